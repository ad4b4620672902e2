"""Dedicated vs co-located trainer ranks on the CPU, in one run: the same TP2 target, data and
global batch, launched through the real CLI.

  dedicated   `python -m specforge_k25.train hw.target_tp=2 train.batch_size=2B`: one trainer rank
              reading TP rank 0's ring; TP rank 1 only computes.
  colocated   `torchrun --nproc-per-node 2 -m specforge_k25.train hw.target_tp=2
              hw.trainer_layout=colocated train.batch_size=B`: a trainer rank beside each TP rank,
              each reading its own TP rank's ring, the draft sharded over the two (FSDP2, gloo).

Reports each run's trained tokens/s (summary.json: rank 0's clock from its first training batch)
and every process's busy share (CPU seconds / the run's wall seconds, sampled with psutil), and
writes everything as JSON. No assertion on any number.

The target is the tiny DeepSeek-V3 (Kimi's code path) because SmolLM2-135M's 9 attention heads do
not split over 2 TP ranks. On a 2-core machine the two layouts run 3 and 4 busy processes on 2
cores: the co-located layout cannot show its GPU advantage (a trainer rank per GPU) here; the
busy shares say where the cores went.

    .venv/bin/python benchmarks/colocated.py                 # ~4 min on 2 cores
    .venv/bin/python benchmarks/colocated.py --smoke         # 13 samples: the structure only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import RESULTS, machine_info, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = RESULTS / "colocated.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=96, help="training conversations (one epoch)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per trainer rank (dedicated: x2)")
    p.add_argument("--tiny-hidden", type=int, default=256, help="hidden size of the tiny DeepSeek target")
    p.add_argument("--smoke", action="store_true", help="13 samples, max_length 64: the structure only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    return p.parse_args(argv)


def overrides(args, run_dir: Path) -> list[str]:
    return ["target=tiny_deepseek", f"target.tiny_hidden={args.tiny_hidden}", "hw.target_tp=2",
            f"data.num_samples={args.samples}", "data.heldout_samples=4", f"data.max_length={args.max_length}",
            "draft.vocab_size=1024", "draft.ttt_length=3", "train.eval_every=null", "train.checkpoint_every=0",
            "train.progress=false", "train.logger=none", f"train.out_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra"]


def role(cmd: str, is_launcher: bool, parent_role: str | None) -> str:
    """What a process of a run is: the launcher, a trainer rank, a target process (a TP rank the
    trainer spawned), or other. A target is recognised by its parent, not its command line alone:
    whatever the target itself spawns (a compile worker on a cold cache, which also runs
    `spawn_main`) is other, not one more TP rank."""
    if "spawn_main" in cmd:
        return "target" if parent_role == "trainer" else "other"
    if is_launcher and "torch.distributed.run" in cmd:
        return "launcher"
    if parent_role in (None, "launcher") and "specforge_k25.train" in cmd:
        return "trainer"
    return "other"


def run(name: str, cmd: list[str], run_dir: Path, poll_s: float = 0.5) -> dict:
    """Launch one run, sample every process's CPU time until it ends; its summary and busy shares."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, dict] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        for p in [root, *root.children(recursive=True)]:
            try:
                with p.oneshot():
                    cpu, cmd = p.cpu_times(), " ".join(p.cmdline())
                    # The command line is re-read every poll: a child caught between fork and exec
                    # still shows its parent's, so a role fixed at first sight can be wrong.
                    entry = seen.setdefault(p.pid, {"pid": p.pid, "started": p.create_time(), "ppid": p.ppid()})
                    entry["cmd"] = cmd or entry.get("cmd", "")
                    entry["cpu_s"] = cpu.user + cpu.system
            except psutil.Error:
                continue
        time.sleep(poll_s)
    log = proc.stdout.read()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{log[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    procs = sorted(seen.values(), key=lambda e: e["started"])
    for e in procs:  # parents start before their children, so a parent's role is known first
        is_root = e["pid"] == proc.pid
        parent = None if is_root else seen.get(e["ppid"])
        e["role"] = role(e["cmd"], is_root, parent and parent["role"])
    counters: dict[str, int] = {}
    shares = {}
    for e in procs:
        if e["role"] == "other":
            continue
        i = counters[e["role"]] = counters.get(e["role"], -1) + 1
        shares[f"{e['role']} {i}"] = round(e["cpu_s"] / wall, 3)
    return {"layout": name, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1),
            "train_wall_s": summary["train_wall_s"], "tokens_trained": summary["tokens_trained"],
            "tokens_per_s": summary["tokens_per_s"], "stream_wait_frac": summary["stream_wait_frac"],
            "busy_share": shares, "cpu_s_total": round(sum(e["cpu_s"] for e in procs), 1)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.samples, args.max_length, args.tiny_hidden = 13, 64, 128
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("dedicated", "colocated"):
            run_dir = Path(tmp) / name
            if name == "dedicated":
                cmd = [sys.executable, "-m", "specforge_k25.train", *overrides(args, run_dir),
                       f"train.batch_size={2 * args.batch_size}"]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "-m", "specforge_k25.train", *overrides(args, run_dir), "hw.trainer_layout=colocated",
                       f"train.batch_size={args.batch_size}"]
            print(f"running {name} ...", flush=True)
            results.append(run(name, cmd, run_dir))
    dedicated, colocated = results
    result = {"benchmark": "colocated", "args": {k: str(v) for k, v in vars(args).items()},
              "runs": results, "colocated_over_dedicated_tokens_per_s":
                  round(colocated["tokens_per_s"] / dedicated["tokens_per_s"], 3),
              "machine": machine_info()}
    rows = [[r["layout"], f"{r['tokens_trained']:,}", f"{r['train_wall_s']:.1f}", f"{r['tokens_per_s']:.1f}",
             f"{r['stream_wait_frac']:.0%}", ", ".join(f"{k} {v:.0%}" for k, v in r["busy_share"].items()),
             f"{r['cpu_s_total']:.0f}"] for r in results]
    print_table("dedicated vs co-located trainer ranks (TP2 target, CPU)",
                ["layout", "tokens", "train s", "tokens/s", "trainer waits", "busy share (CPU s / wall s)", "CPU s"],
                rows)
    print(f"co-located / dedicated tokens/s: {result['colocated_over_dedicated_tokens_per_s']:.3f}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
