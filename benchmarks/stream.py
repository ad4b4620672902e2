"""Streaming throughput: is online training as fast as its slower half?

One run, one data set, one plan of train batches, three phases:

  A  target only   SGLang target in its own process -> shared-memory stream -> the consumer only
                   copies each batch into memory (kept for B) and releases the slot.
  B  trainer only  the DraftLearner steps (make_batch + train_micro + optimizer_step) over the
                   tensors kept in A; no target process is running.
  C  online        a fresh draft and optimizer, the target streaming and the trainer consuming,
                   pipelined exactly as `run_training` does it.

Prints tokens / seconds / tokens/s per phase and `online / min(target_only, trainer_only)`
(goal >= 0.95), and writes everything as JSON. No assertion on any number.

    .venv/bin/python benchmarks/stream.py [--target smollm2|tiny_deepseek] [--samples 48] ...

Token accounting (identical in all three phases): a phase is a loop over the plan; for each
item the consumer receives the batch (A, C: from the stream; B: from memory) and processes it.
The clock starts when item 0 has been processed and stops when the last item has been
processed; the tokens are those of items 1..N-1. Item 0 is thereby excluded from both the
numerator and the denominator: in A and C it carries the engine start-up, in B and C the
trainer's first-step warm-up (optimizer state allocation, allocator growth). The time to the
first batch is reported on its own. One bias remains and is reported: in C the target keeps
producing while the trainer handles item 0, so up to `stream_slots` batches may already be
waiting when the clock starts (`ready_at_start`); this flatters C only when the target is the
bottleneck, by at most that many batches.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from _common import replot
from specforge_k25.config import JobConfig
from specforge_k25.stream.target_stream import TargetStream
from specforge_k25.setup.run import RunSetup, prepare
from specforge_k25.setup.target import make_target_stream
from specforge_k25.train.schedule import build_schedule
from specforge_k25.train.learner import DraftLearner, build_learner

GOAL = 0.95
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "stream.json"


# ------------------------------------------------------------------------------------ setup
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", choices=["smollm2", "tiny_deepseek"], default="smollm2", help="embedded target")
    p.add_argument("--samples", type=int, default=48, help="training conversations (one epoch, no evals)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per target batch = per micro-batch")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process: the target process and the trainer get this many each")
    p.add_argument("--vocab", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the ~10 s check of how fast two concurrent compute-bound processes run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file (the PNG plot goes beside it)")
    p.add_argument("--replot", action="store_true", help="measure nothing: redraw the PNG from the JSON at --out")
    return p.parse_args(argv)


def build_job(args) -> JobConfig:
    job = JobConfig()
    job.target.name = job.target.builtin = args.target
    job.target.end_of_turn_token = "<|im_end|>"  # as conf/target/*.yaml (both targets use SmolLM2's ChatML)
    job.data.num_samples = args.samples
    job.data.heldout_samples = 0
    job.data.max_length = args.max_length
    job.draft.vocab_size = args.vocab
    job.hw.target_threads = job.hw.trainer_threads = args.threads
    job.train.batch_size = args.batch_size
    job.train.grad_accum = 1
    job.train.epochs = 1
    job.train.max_steps = None
    job.train.eval_every = None
    job.train.logger = "none"
    job.train.progress = False
    return job


class TrainerFactory:
    """A fresh trainer per phase, built by `build_learner` exactly as `run_training` does."""

    def __init__(self, job: JobConfig, setup: RunSetup, steps: int):
        self.job, self.setup, self.steps = job, setup, steps

    def __call__(self) -> DraftLearner:
        return build_learner(self.job, self.setup, self.steps, torch.device("cpu"))


def make_stream(job: JobConfig, setup: RunSetup, plan: list[list[int]]) -> TargetStream:
    return make_target_stream(job, setup, setup.data.train, plan)


# ------------------------------------------------------------------------------------ timing
class PhaseClock:
    """Per-item completion times; the steady-state window is item 0 done -> last item done."""

    def __init__(self, name: str):
        self.name = name
        self.t_begin = time.perf_counter()  # phase start (process spawn for A and C)
        self.done: list[float] = []  # perf_counter when each item was fully processed
        self.tokens: list[int] = []

    def item_done(self, tokens: int) -> None:
        self.done.append(time.perf_counter())
        self.tokens.append(tokens)

    def result(self, **extra) -> dict:
        n = len(self.done)
        window = self.done[-1] - self.done[0] if n > 1 else float("nan")
        tokens = sum(self.tokens[1:])
        per_item = [b - a for a, b in zip(self.done, self.done[1:])]
        return {
            "items": n, "tokens": tokens, "seconds": window,
            "tokens_per_s": tokens / window if n > 1 and window > 0 else float("nan"),
            "first_item_s": self.done[0] - self.t_begin if n else float("nan"),
            "first_item_tokens": self.tokens[0] if n else 0,
            "item_s_median": sorted(per_item)[len(per_item) // 2] if per_item else float("nan"),
            "item_s_max": max(per_item) if per_item else float("nan"),
            **extra,
        }


def phase_target_only(job, setup, plan) -> tuple[dict, list]:
    """A: the consumer only copies the two views and releases the slot."""
    kept = []
    stream = make_stream(job, setup, plan)
    clock = PhaseClock("target_only")
    with stream:
        for msg, aux, final in stream:
            kept.append((list(msg.lengths), aux.clone(), final.clone()))
            stream.release(msg)
            clock.item_done(sum(msg.lengths))
    return clock.result(stream_wait_s=stream.wait_s), kept


def phase_trainer_only(factory, setup, plan, kept) -> dict:
    """B: the same trainer steps as online, over the tensors kept in A."""
    trainer = factory()
    clock = PhaseClock("trainer_only")
    for ids, (lengths, aux, final) in zip(plan, kept):
        batch = trainer.make_batch([setup.data.train[i] for i in ids], lengths, aux, final)
        trainer.train_micro(batch)
        trainer.optimizer_step()
        clock.item_done(batch.num_tokens)
    return clock.result()


def phase_online(job, factory, setup, plan) -> dict:
    """C: as `run_training` (grad_accum 1, no evals, no checkpoints, no logging)."""
    trainer = factory()
    stream = make_stream(job, setup, plan)
    clock = PhaseClock("online")
    wait_at_start = ready_at_start = None
    with stream:
        for (msg, aux, final), ids in zip(stream, plan):
            batch = trainer.make_batch([setup.data.train[i] for i in ids], msg.lengths, aux, final)
            stream.release(msg)
            trainer.train_micro(batch)
            trainer.optimizer_step()
            clock.item_done(batch.num_tokens)
            if wait_at_start is None:  # the steady-state window opens now
                wait_at_start, ready_at_start = stream.wait_s, stream.depth()
    res = clock.result(ready_at_start=ready_at_start)
    # wait_s also counts the final EndOfStream read, which falls after the window; nearly zero
    res["stream_wait_s"] = stream.wait_s - wait_at_start
    res["stream_wait_frac"] = res["stream_wait_s"] / res["seconds"]
    return res


# ------------------------------------------------------------------------------ calibration
def _spin(seconds: float, threads: int, out) -> None:
    """A compute-bound matmul loop in its own process; reports iterations/s."""
    torch.set_num_threads(threads)
    a, b = torch.randn(576, 576), torch.randn(512, 576)
    b @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b @ a
        n += 1
    out.put(n / (time.perf_counter() - t0))


def cpu_pair_speed(threads: int, seconds: float = 3.0) -> dict:
    """How fast two concurrent compute-bound processes run, each relative to one alone.

    1.0: the target and the trainer get independent cores, so online can reach min(both).
    ~0.5: they share one core's worth of compute (e.g. vCPUs on SMT siblings of a busy host);
    online then cannot reach min(both) whenever both halves are compute bound.
    """
    ctx = torch.multiprocessing.get_context("spawn")

    def run(k: int) -> list[float]:
        out = ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, threads, out)) for _ in range(k)]
        for p in procs:
            p.start()
        rates = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join()
        return rates

    alone = run(1)[0]
    pair = run(2)
    return {"alone_iters_s": alone, "pair_iters_s": pair, "pair_speed": sum(pair) / len(pair) / alone}


# ------------------------------------------------------------------------------------ report
def machine_info(args) -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model, "platform": platform.platform(), "python": sys.version.split()[0],
        "torch": torch.__version__, "trainer_torch_threads": torch.get_num_threads(),
        "target_threads": args.threads,
    }


def print_table(phases: dict, ratio: float, bottleneck: str, calib: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stream throughput (steady state: items 1..N-1)")
    for col, just in [("phase", "left"), ("items", "right"), ("tokens", "right"), ("seconds", "right"),
                      ("tokens/s", "right"), ("s/item (median)", "right"), ("first item s", "right")]:
        table.add_column(col, justify=just)
    for name, r in phases.items():
        table.add_row(name, str(r["items"]), str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['item_s_median']:.3f}", f"{r['first_item_s']:.2f}")
    console = Console(width=max(110, Console().width))
    console.print(table)
    c = phases["online"]
    mark = "meets" if ratio >= GOAL else "BELOW"
    console.print(f"online / min(target_only, trainer_only) = {ratio:.3f}  ({mark} goal {GOAL}; "
                  f"slower half: {bottleneck})")
    console.print(f"online stream wait fraction = {c['stream_wait_frac']:.3f}  "
                  f"(batches ready when the window opened: {c['ready_at_start']})")
    if calib:
        console.print(f"cpu pair speed = {calib['pair_speed']:.2f}  (two concurrent compute-bound processes, "
                      f"each vs. alone; 1.0 = independent cores)")


def plot(result: dict, path: Path) -> None:
    """tokens/s of the three phases, the goal line (GOAL x the slower half) and the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = result["phases"]
    names = list(phases)
    rates = [phases[n]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    bars = ax.bar(names, rates, color=["#fdae6b", "#e6550d", "#2b8cbe"][: len(names)])
    for bar, n in zip(bars, names):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{phases[n]['tokens_per_s']:.0f}",
                ha="center", va="bottom", fontsize=9)
    slower = phases[result["bottleneck"]]["tokens_per_s"]
    ax.axhline(result["goal"] * slower, color="k", ls="--", lw=1,
               label=f"goal: {result['goal']} x {result['bottleneck']}")
    ax.set_ylabel("tokens/s (steady state, items 1..N-1)")
    ax.set_title(f"stream: online / min(target, trainer) = {result['ratio_online_over_min']:.3f}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        return replot(args.out, plot)
    job = build_job(args)
    torch.set_num_threads(job.hw.trainer_threads)  # the trainer (this process); the target gets hw.target_threads
    t0 = time.perf_counter()
    setup = prepare(job)
    plan_items, steps = build_schedule(len(setup.data.train), 0, batch_size=job.train.batch_size, grad_accum=1,
                                   epochs=1, max_steps=None, eval_every=None, seed=job.train.seed)
    plan = [p.sample_ids for p in plan_items]
    factory = TrainerFactory(job, setup, steps)
    print(f"target {job.target.name} ({setup.info.architecture}, hidden {setup.info.hidden_size}); "
          f"{len(setup.data.train)} samples, {len(plan)} batches of {job.train.batch_size}, "
          f"{sum(len(s.input_ids) for s in setup.data.train)} tokens; threads {args.threads}+{args.threads}; "
          f"prepared in {time.perf_counter() - t0:.1f} s", flush=True)

    print("A: target only ...", flush=True)
    target_only, kept = phase_target_only(job, setup, plan)
    print("B: trainer only ...", flush=True)
    trainer_only = phase_trainer_only(factory, setup, plan, kept)
    del kept
    print("C: online ...", flush=True)
    online = phase_online(job, factory, setup, plan)

    phases = {"target_only": target_only, "trainer_only": trainer_only, "online": online}
    slower = min(("target_only", "trainer_only"), key=lambda k: phases[k]["tokens_per_s"])
    ratio = online["tokens_per_s"] / phases[slower]["tokens_per_s"]
    calib = None if args.no_calibrate else cpu_pair_speed(args.threads)
    print_table(phases, ratio, slower, calib)

    result = {
        "benchmark": "stream", "goal": GOAL, "ratio_online_over_min": ratio, "bottleneck": slower,
        "phases": phases,
        "accounting": "steady state: clock from item 0 processed to last item processed; tokens of items 1..N-1",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "job": dataclasses.asdict(job),
        "setup": {"model_path": setup.model_path, "architecture": setup.info.architecture,
                  "hidden_size": setup.info.hidden_size, "capture_points": setup.capture_points,
                  "batches": len(plan), "data": setup.data.summary()},
        "machine": {**machine_info(args), "cpu_pair_speed": calib},
        "total_wall_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
