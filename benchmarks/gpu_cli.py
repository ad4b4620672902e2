"""The real command on the GPU check's machine: `python -m specforge_k25.train`, co-located, then resumed.

    python benchmarks/gpu_cli.py --device cuda --target llama --out $OUT       # a step of gpu_check.py
    python benchmarks/gpu_cli.py --device cpu --small --target deepseek        # the CPU mode

A random target is built in a temp folder: `llama` (SmolLM2-135M's shape, benchmarks/gpu_targets.py)
or `deepseek` (the tiny DeepSeek-V3 of `target=tiny_deepseek`: MLA + MoE, Kimi-K2.5's code path),
both with a word-level tokenizer and a chat template, and random conversations as a JSONL file: the
lent machine has no packaged model or data set. Per variant (gpu: EAGLE-3 with AdamW on the trainer's
device; cpu: train.optimizer_device=cpu; dflash: DFlash, whose co-located rank holds a slice of the
target's lm_head):
  run     the CLI under torchrun as one co-located rank in a process group of its own (NCCL on CUDA,
          gloo on a CPU; SPECFORGE_ONE_RANK_GROUP=1, train/distributed.py): the draft sharded with
          FSDP2 (with cpu: FSDP2's CPU offload) as on a node, ~20 optimizer steps on CUDA (4 in
          --small), a checkpoint at half-way, the serving export at the end;
  resume  (the first variant) a fresh folder holding only the half-way checkpoint, train.resume=auto:
          its export against the run's (bit-identical on CPU; on CUDA within --resume-rtol);
  memory  at stream start the trainer wrote memory_report.json (train/memory_report.py); SGLang's
          measured free memory and KV tokens are read from the run's log (a sitecustomize on the
          run's PYTHONPATH raises those SGLang loggers to info); `compare` fails on the trainer's
          cached-but-unused memory beyond --max-cached-gib, on SGLang measuring less free memory or
          allocating a smaller KV pool than the plan counted. On CUDA the engine's figures must be
          in the log.
On CUDA a run that fails on a kernel the image lacks says which and is SKIP, not FAIL (all
skipped: exit 3, gpu_check.py's SKIP_EXIT). One JSON, --out/gpu_cli_<target>.json, rewritten after
every run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_targets import SMALL, SMOLLM2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
USER, ASSISTANT, END = "t3", "t4", "t5"  # role and end-of-turn words of the word-level template
TEMPLATE = ("{% for m in messages %}{{ '" + USER + " ' if m['role'] == 'user' else '" + ASSISTANT + " ' }}"
            "{{ m['content'] }} " + END + " {% endfor %}{% if add_generation_prompt %}" + ASSISTANT + " {% endif %}")
# kernel packages the H200 image lacks (PERFORMANCE section 7), as a traceback names them, and a
# kernel not built for the GPU: the run is skipped naming it. Any other failure, a missing Python
# module of the wheel list included, is a FAIL.
MISSING_KERNEL = re.compile(r"No module named '(sgl_kernel|flashinfer|deep_gemm|flash_mla|cutlass)|"
                            r"no kernel image is available for execution")


def build_targets(work: Path, kind: str, small: bool, seed: int = 0) -> str:
    """The random target's HF folder with a chat template (built into `work`)."""
    import gpu_e2e

    llama = Path(gpu_e2e.build_random_target(work / "llama", small, seed))
    config = json.loads((llama / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (llama / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    if kind == "llama":
        return str(llama)
    from specforge_k25.target_engine import models

    os.environ["SPECFORGE_CACHE"] = str(work / "cache")  # not the user's cached tiny DeepSeek (SmolLM2's tokenizer)
    return str(models.tiny_deepseek_path(llama, 8, 128, seed))  # conf/target/tiny_deepseek.yaml's shape


def write_data(path: Path, rows: int, vocab: int, seed: int = 0) -> Path:
    """Conversations of random words t6..t<vocab-1>: not the template's own words, nor any whose text holds
    a special token's ("t12" holds "t1", the BOS: such a row is skipped as special_token_in_text)."""
    rng = random.Random(seed)
    pool = [n for n in range(6, vocab) if str(n)[0] not in "012"]
    words = lambda n: " ".join(f"t{rng.choice(pool)}" for _ in range(n))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"conversations": [{"from": "human", "value": words(rng.randint(4, 12))},
                                                  {"from": "gpt", "value": words(rng.randint(20, 50))}]}) + "\n")
    return path


# per variant: the draft method's settings and where AdamW lives. dflash scores tokens over the
# target's vocabulary: co-located, its rank holds a slice of the lm_head (train/vocab_parallel.py)
VARIANTS = {"gpu": ("eagle3", False), "cpu": ("eagle3", True), "dflash": ("dflash", False)}
DRAFTS = {"eagle3": ["draft.vocab_size=256", "draft.ttt_length=3"],
          "dflash": ["draft=dflash", "draft.block_size=4", "draft.num_layers=1", "draft.num_anchors=16"]}


def overrides(args, model: str, data: Path, variant: str) -> list[str]:
    steps = 4 if args.small else 20
    batch = 2
    method, optimizer_cpu = VARIANTS[variant]
    out = [f"target.path={model}", "target.builtin=none", f"target.end_of_turn_token={END}", "target.aux_layers=null",
           "data.source=jsonl", f"data.path={data}", f"data.num_samples={steps * batch}", "data.heldout_samples=2",
           "data.max_length=64" if args.small else "data.max_length=256", *DRAFTS[method],
           f"train.batch_size={batch}", "train.grad_accum=1", "train.epochs=1",
           f"train.checkpoint_every={steps // 2}", "train.keep_checkpoints=10", "train.log_every=1",
           "train.progress=false", "train.logger=none", "hw.trainer_layout=colocated"]
    if args.device == "cuda":  # the plan needs the GPU's memory to count what SGLang should find free
        import torch

        mib = torch.cuda.get_device_properties(0).total_memory >> 20
        out += ["hw.device=cuda", "hw.num_gpus=1", f"hw.gpu_memory_mib={mib}", "hw.target_dtype=bfloat16",
                "hw.autocast=bf16"]
    if optimizer_cpu:
        out.append("train.optimizer_device=cpu")
    return out


# SGLang's memory lines are logged at info; the project's engines run at warning (target_engine/sglang_engine.py).
# Every process of the run imports this first (PYTHONPATH): those loggers print, then the sitecustomize
# it shadows runs as it would have.
LOG_HOOK = """import logging, sys
for _name in ("sglang.srt.model_executor.model_runner", "sglang.srt.mem_cache.memory_pool",
              "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"):
    _log = logging.getLogger(_name)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[sglang] %(message)s"))
    _log.setLevel(logging.INFO)
    _log.addHandler(_handler)
    _log.propagate = False
# then the sitecustomize this one shadows, if any (an image's own, the test suite's image-only one)
import importlib.util, os
_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path[1:]:
    _f = os.path.join(os.path.abspath(_p or "."), "sitecustomize.py")
    if os.path.dirname(_f) != _here and os.path.isfile(_f):
        _spec = importlib.util.spec_from_file_location("_sitecustomize_shadowed", _f)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
"""


def log_hook(folder: Path, env: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(LOG_HOOK)
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q])


def run_cli(run_dir: Path, ovr: list[str], timeout_s: float, env: dict) -> tuple[int | None, str, float]:
    # one rank in its own process group (train/distributed.py ONE_RANK_GROUP): NCCL on CUDA, gloo on a
    # CPU, the draft sharded with FSDP2 as on a node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "specforge_k25.train", *ovr, f"train.out_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra"]
    env = dict(env, SPECFORGE_ONE_RANK_GROUP="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if time.time() - t0 > timeout_s:
                raise subprocess.TimeoutExpired(cmd, timeout_s)
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, "".join(lines), time.time() - t0


def missing_kernel(log: str) -> str | None:
    """The last line naming a kernel the image lacks, or None."""
    for line in reversed(log.splitlines()):
        if MISSING_KERNEL.search(line):
            return line.strip()[:300]
    return None


def max_rel_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return float("inf")
    return max(((x[k].double() - y[k].double()).abs().max() / y[k].double().abs().max().clamp(min=1e-30)).item()
               for k in x if x[k].numel())


def memory_row(run_dir: Path, log: str, args) -> dict:
    from specforge_k25.train.memory_report import REPORT, compare, engine_figures

    report = json.loads((run_dir / REPORT).read_text())
    report["engine"] = engine = engine_figures(log)
    problems = compare(report["trainer"], report["plan"], engine, int(args.max_cached_gib * (1 << 30)))
    if not report["sharded"]:
        problems.append("the draft was not sharded (FSDP2): not the node's code path")
    if args.device == "cuda":
        problems += [f"SGLang's {k} is not in the log" for k, v in engine.items() if v is None]
        problems += [f"the plan has no {k}" for k in ("free_before_load", "kv_pool_tokens") if report["plan"][k] is None]
        problems += [f"the trainer's {k} was not measured" for k in ("allocated", "reserved")
                     if report["trainer"][k] is None]
    report.update(problems=problems, ok=not problems)
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny target and 4 steps (the CPU mode)")
    p.add_argument("--target", choices=["llama", "deepseek"], default="llama")
    p.add_argument("--variants", default="gpu,cpu,dflash", help="runs: gpu (EAGLE-3, AdamW on the trainer's device), "
                                                                "cpu (train.optimizer_device=cpu), dflash (DFlash: the "
                                                                "vocab-split head); the first is also resumed")
    p.add_argument("--no-resume", action="store_true", help="no resumed run")
    p.add_argument("--timeout-s", type=float, default=240.0, help="seconds per CLI run")
    p.add_argument("--max-cached-gib", type=float, default=1.0, help="bound on memory_reserved - memory_allocated")
    p.add_argument("--resume-rtol", type=float, default=1e-3, help="cuda: resumed export vs the run's, relative")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_cli.json (default: $OUT, else .)")
    args = p.parse_args(argv)
    out = (args.out or Path(os.environ.get("OUT") or ".")) / f"gpu_cli_{args.target}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": args.device, "target": args.target, "runs": [], "ok": True}

    def record(row: dict) -> None:
        res["runs"].append(row)
        res["ok"] &= row["status"] in ("pass", "skipped")
        out.write_text(json.dumps(res, indent=1, default=str))
        print(f"{row['status'].upper()} {row['name']}: " + "; ".join(f"{k} {row[k]}" for k in (
            "wall_s", "reason", "problems", "export_rel_diff") if row.get(k) not in (None, [])), flush=True)

    work = Path(tempfile.mkdtemp(prefix="specforge-gpu-cli-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    try:
        model = build_targets(work, args.target, args.small)
        env["SPECFORGE_CACHE"] = str(work / "cache")
        log_hook(work / "log_hook", env)
        vocab = (SMALL if args.small else SMOLLM2)["vocab_size"]
        data = write_data(work / "data.jsonl", 64 if args.small else 200, vocab)
        first = None
        for variant in args.variants.split(","):
            name = f"{args.target} {variant}"
            ovr = overrides(args, model, data, variant)
            run_dir = work / f"run_{variant}"
            rc, log, wall = run_cli(run_dir, ovr, args.timeout_s, env)
            row = {"name": name, "wall_s": round(wall, 1), "exit": rc, "log_tail": log[-3000:]}
            if rc != 0:
                kernel = missing_kernel(log) if rc is not None and args.device == "cuda" else None
                row.update(status="skipped" if kernel else ("timeout" if rc is None else "fail"),
                           reason=f"a kernel the image lacks: {kernel}" if kernel else f"exit {rc}")
                record(row)
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            row["steps"], row["tokens_per_s"] = summary["steps"], summary.get("tokens_per_s")
            row["memory"] = memory_row(run_dir, log, args)
            row["problems"] = list(row["memory"]["problems"])
            if not (run_dir / "export" / "model.safetensors").is_file():
                row["problems"].append("no serving export")
            row["status"] = "pass" if not row["problems"] else "fail"
            record(row)
            if first is None:
                first = (variant, run_dir, ovr, summary["steps"])
        if first is not None and not args.no_resume:
            variant, run_dir, ovr, steps = first
            half = sorted(p.name for p in (run_dir / "checkpoints").iterdir())[0]
            resumed = work / f"resumed_{variant}"
            (resumed / "checkpoints").mkdir(parents=True)
            shutil.copytree(run_dir / "checkpoints" / half, resumed / "checkpoints" / half)
            rc, log, wall = run_cli(resumed, ovr + ["train.resume=auto"], args.timeout_s, env)
            row = {"name": f"{args.target} {variant} resumed from {half}", "wall_s": round(wall, 1),
                   "exit": rc, "log_tail": log[-3000:], "problems": []}
            if rc == 0:
                summary = json.loads((resumed / "summary.json").read_text())
                row["export_rel_diff"] = diff = max_rel_diff(resumed / "export" / "model.safetensors",
                                                             run_dir / "export" / "model.safetensors")
                bound = 0.0 if args.device == "cpu" else args.resume_rtol
                if not str(summary.get("resumed_from", "")).endswith(half):
                    row["problems"].append(f"not resumed from {half}: {summary.get('resumed_from')}")
                if summary["steps"] != steps:
                    row["problems"].append(f"{summary['steps']} steps, the run {steps}")
                if not diff <= bound:
                    row["problems"].append(f"export differs from the run's by {diff:.3g} (bound {bound})")
                row["status"] = "pass" if not row["problems"] else "fail"
            else:
                row.update(status="timeout" if rc is None else "fail", reason=f"exit {rc}")
            record(row)
    except Exception as err:  # the target build or the data: one FAIL line with its reason
        import traceback

        record({"name": f"{args.target} setup", "status": "fail", "reason": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-3000:]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["skipped"] = bool(res["runs"]) and all(r["status"] == "skipped" for r in res["runs"])
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"{'ALL PASS' if res['ok'] else 'SOME FAILED'}; wrote {out}", flush=True)
    if res["skipped"]:
        print(f"SKIP {args.target}: " + "; ".join(r["reason"] for r in res["runs"]), flush=True)
    return res


if __name__ == "__main__":
    result = main()
    sys.exit(3 if result["skipped"] else 0 if result["ok"] else 1)  # 3: gpu_check.py's SKIP_EXIT
