"""The one device command of the GPU check: every check in priority order under one global deadline.

    python3 benchmarks/gpu_check.py --device cuda            # on the lent GPU (docs/PERFORMANCE.md section 7)
    python benchmarks/gpu_check.py --device cpu --small      # the same steps on a CPU, tiny shapes

Each step is its own process (group) with its own timeout, cut to what is left of the global deadline
(--budget-s, 480 s by default: a machine start of 1-2 minutes plus 8 minutes leaves a rerun inside the
15 minutes of device time). A step not started because too little time is left is recorded as skipped
with the reason; a step past its timeout is killed with everything it started (SGLang's processes
included) and recorded as such; the next step still runs. Every step writes its results to $OUT (--out)
as they arrive, and this script rewrites $OUT/gpu_check.json after every step and keeps the whole log
in $OUT/gpu_check.log: a run cut short anywhere still brings back what it had. $OUT stays within the
device tool's 8 files.

Before the steps (in this process, inherited by all): gpu_preflight.prepare_env (CUDA toolkit and a
CUDA_HOME the JIT can link against, the Python radix tree core, TRITON_F32_DEFAULT=ieee).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
MAX_FILES = 8  # what the device tool brings back from $OUT
# the device tool's 15 minutes hold a machine start of up to 4, the command, and a rerun of what failed
# (`--rerun-failed --budget-s 180` on the still-warm machine)
DEVICE_BUDGET_S, MACHINE_START_S, DEFAULT_BUDGET_S, RERUN_BUDGET_S = 900, 240, 390, 180


@dataclass
class Step:
    name: str
    argv: list[str]  # after the python executable
    timeout_s: float  # its own limit
    min_s: float  # not started with less than this left before the deadline
    what: str = ""
    outputs: list[str] = field(default_factory=list)  # files under out it writes


SKIP_EXIT = 3  # a step that exits with this skipped itself; its last "SKIP ..." line says why


def steps_for(device: str, small: bool, out: Path, deadline: float, compile_on_cpu: bool = True) -> list[Step]:
    """The checks in priority order, by what a minute of device time tells: the real command and the
    online memory first (nothing else measures them), SGLang's kernels and speculative decoding next,
    what an earlier lent run already measured (docs/PERFORMANCE.md section 3) last. On a CPU the
    throughput step b is left out: its CPU path is tests/benchmarks/test_benchmarks.py's
    test_gpu_e2e_cpu_mode, and b measures nothing on a CPU that the device run needs."""
    py = [str(HERE / "gpu_preflight.py"), "--device", device, "--out", str(out)] + ([] if compile_on_cpu else
                                                                                     ["--no-compile"])
    e2e = [str(HERE / "gpu_e2e.py"), "--device", device, "--out", str(out / "gpu_e2e.json"), "--merge",
           "--deadline", f"{deadline:.0f}"] + (["--small"] if small else [])
    kimi = [str(HERE / "gpu_kimi_shapes.py"), "--device", device, "--out", str(out / "gpu_kimi_shapes.json"),
            "--no-plot"] + (["--small", "--seq-lens", "32,64"] if small else ["--seq-lens", "2048,4096", "--iters", "3"])
    checks = [str(HERE / "gpu_trainer_checks.py"), "--out", str(out)] + (["--small"] if small else [])
    cli = [str(HERE / "gpu_cli.py"), "--device", device, "--out", str(out)] + (["--small"] if small else [])
    cuda = device == "cuda"
    # the device: the Kimi-shaped target's EAGLE-3 (run, resumed) and DFlash, then the Llama with
    # AdamW offloaded; a CPU (the suite's time): one run each, the DeepSeek's EAGLE-3, the Llama's
    # DFlash (a resume at world size 1 is bit-identical there: measured once, PERFORMANCE section 7)
    deepseek = ["--variants", "gpu,dflash"] if cuda else ["--variants", "gpu", "--no-resume"]
    llama = ["--variants", "cpu" if cuda else "dflash", "--no-resume"]
    return [
        Step("cli_deepseek", cli + ["--target", "deepseek", *deepseek], 240 if cuda else 600, 60,
             "python -m specforge_k25.train co-located on the tiny DeepSeek-V3 (MLA + MoE, Kimi's code path), "
             "resumed, exported; memory at stream start vs plan", ["gpu_cli_deepseek.json"]),
        Step("cli_llama", cli + ["--target", "llama", *llama], 120 if cuda else 600, 40,
             "the same on a random Llama", ["gpu_cli_llama.json"]),
        *([Step("b", e2e + ["--checks", "b"], 150, 60, "online memory vs plan per owner, throughput (>= 200 batches)",
                ["gpu_e2e.json"])] if cuda else []),
        Step("preflight", py, 120 if cuda else 300, 30, "CUDA toolkit, Rust radix extension, SGLang JIT builds",
             ["gpu_preflight.json"]),
        Step("c", e2e + ["--checks", "c"], 120 if cuda else 300, 60, "slot hand-off (+ planted no-sync), a) fp32",
             ["gpu_e2e.json"]),
        Step("d", e2e + ["--checks", "d"], 150 if cuda else 300, 60, "EAGLE-3 in SGLang, graphs off and on"),
        Step("e", e2e + ["--checks", "e"], 120 if cuda else 300, 60, "DFlash and MLA EAGLE-3 in SGLang"),
        Step("mps", [str(HERE / "gpu_mps.py")], 60, 5, "co-located step time with and without MPS (several GPUs)"),
        Step("kimi_steps", kimi + ["--methods", "dflash,eagle3"], 120, 40,
             "one DFlash layer and the EAGLE-3 draft at Kimi shapes: time, peak vs plan", ["gpu_kimi_shapes.json"]),
        Step("trainer_checks", checks, 90 if cuda else 120, 30, "TTT numerics, SDPA kernel, host AdamW",
             ["gpu_trainer_checks.json"]),
    ]


def to_rerun(previous: dict) -> list[str]:
    """The steps of a previous summary that did not pass (a step that skipped itself stays skipped)."""
    return [r["step"] for r in previous.get("steps", []) if r["status"] != "pass" and not r.get("self_skipped")]


class Check:
    """Runs the steps; the summary JSON and the log under `out`."""

    def __init__(self, out: Path, budget_s: float, env: dict):
        self.out, self.env, self.t0 = out, env, time.time()
        self.deadline = self.t0 + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu_check.log", "a", buffering=1)
        self.summary = {"benchmark": "gpu_check", "budget_s": budget_s, "started": self.t0, "steps": []}
        self._last: dict[str, str] = {}  # per step, its last SKIP line

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        self.summary["wall_s"] = time.time() - self.t0
        steps = self.summary["steps"]
        self.summary["ok"] = all(s["status"] == "pass" or s.get("self_skipped") for s in steps)
        self.summary["files"] = sorted(p.name for p in self.out.iterdir() if p.is_file())
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_check.json")

    def run(self, step: Step) -> dict:
        left = self.deadline - time.time()
        row = {"step": step.name, "what": step.what, "argv": step.argv}
        if left < step.min_s:
            row.update(status="skipped", reason=f"deadline: {max(left, 0):.0f} s left, the step needs {step.min_s:.0f}")
            self.say(f"SKIP step {step.name}: {row['reason']}")
            return self._record(row)
        timeout = min(step.timeout_s, left)
        self.say(f"STEP {step.name} ({step.what}): timeout {timeout:.0f} s, {left:.0f} s left")
        t0 = time.time()
        self._last[step.name] = ""
        proc = subprocess.Popen([sys.executable, *step.argv], cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        reader = threading.Thread(target=self._pump, args=(proc, step.name), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
            status = {0: "pass", SKIP_EXIT: "skipped"}.get(rc, "fail")
        except subprocess.TimeoutExpired:
            self._kill(proc)
            rc, status = None, "timeout"
        reader.join(timeout=10)
        row.update(status=status, exit=rc, wall_s=round(time.time() - t0, 1), timeout_s=round(timeout, 1))
        if status == "skipped":
            row.update(self_skipped=True, reason=self._last[step.name] or "the step skipped itself")
        if status == "timeout":
            row["reason"] = f"killed after its {timeout:.0f} s (its results so far are in its files)"
        self.say(f"END step {step.name}: {status.upper()} in {row['wall_s']:.0f} s"
                 + (f" ({row['reason']})" if "reason" in row else ""))
        return self._record(row)

    def _record(self, row: dict) -> dict:
        self.summary["steps"].append(row)
        self.save()
        return row

    def _pump(self, proc, name: str) -> None:
        for line in proc.stdout:
            self.say(f"[{name}] {line.rstrip()}")
            if line.startswith("SKIP"):
                self._last[name] = line.strip()

    @staticmethod
    def _kill(proc) -> None:
        """The step's whole process group (SGLang's schedulers and detokenizers with it)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU mode)")
    p.add_argument("--budget-s", type=float, default=float(DEFAULT_BUDGET_S),
                   help="global deadline, seconds from the start")
    p.add_argument("--out", type=Path, default=None, help="result folder (default: $OUT, else "
                                                          "benchmarks/results/gpu_check_<device>)")
    p.add_argument("--no-compile", action="store_true", help="cpu: the preflight does not compile SGLang's JIT "
                                                                   "kernels with this machine's nvcc")
    p.add_argument("--only", default=None, help="comma-separated step names (default: all, in priority order)")
    p.add_argument("--rerun-failed", action="store_true", help="only the steps that did not pass in --previous; "
                                                               "its rows kept in the summary")
    p.add_argument("--previous", type=Path, default=None, help="the first run's gpu_check.json (default: the one "
                                                               "under --out; the device's $OUT starts empty, so "
                                                               "there: docs/gpu_h200/gpu_check.json)")
    args = p.parse_args(argv)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else
                       HERE / "results" / f"gpu_check_{args.device}")
    env = dict(os.environ, OUT=str(out), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q])
    from gpu_preflight import prepare_env

    previous = None
    if args.rerun_failed:
        try:
            previous = json.loads((args.previous or out / "gpu_check.json").read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"--rerun-failed: no previous {args.previous or out / 'gpu_check.json'} ({err})")
    check = Check(out, args.budget_s, env)
    check.summary["prepared"] = prepare_env(env, Path(tempfile.mkdtemp(prefix="specforge-cuda-home-")),
                                            cuda=args.device == "cuda")
    kit = check.summary["prepared"]["toolkit"]
    check.say(f"INFO CUDA toolkit: {kit['home'] or 'none'} ({kit['layout']}; nvcc {kit.get('nvcc_version')}); "
              f"CUDA_HOME for SGLang's JIT: {kit['cuda_home']}")
    check.save()
    steps = steps_for(args.device, args.small, out, check.deadline, not args.no_compile)
    names = args.only.split(",") if args.only else None
    if previous is not None:
        names = to_rerun(previous)
        check.summary["previous"] = [dict(r, rerun=r["step"] in names) for r in previous["steps"]]
        check.say(f"INFO rerun of {names or 'nothing'}; kept from the previous run: "
                  f"{[r['step'] for r in previous['steps'] if r['step'] not in names]}")
    if names is not None:
        unknown = set(names) - {s.name for s in steps}
        if unknown:
            raise SystemExit(f"--only: no step {sorted(unknown)}; steps: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in names]
    for step in steps:
        check.run(step)
    files = check.summary["files"]
    if len(files) > MAX_FILES:
        check.say(f"WARN {len(files)} files under {out}: the device tool brings back {MAX_FILES}")
    counts = {s: sum(r["status"] == s for r in check.summary["steps"]) for s in ("pass", "fail", "timeout", "skipped")}
    check.say(f"{'ALL PASS' if check.summary['ok'] else 'NOT ALL PASS'}: {counts} in {time.time() - check.t0:.0f} s")
    return check.summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
