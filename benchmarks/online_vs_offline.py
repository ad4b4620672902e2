"""Online vs offline EAGLE-3 training on the same data: wall time and bytes written to disk.

Same samples, same plan of batches, same trainer (`build_learner`, same seed) in every run:

  online   the SGLang target in its own process streams hidden states through shared memory
           while the trainer trains on them, pipelined as train/trainer.py does (target and
           trainer get --threads each, at the same time).
  offline  two passes, as offline EAGLE pipelines work:
           1. dump: the same target process runs over every batch; the trainer process writes
              each batch to one safetensors file (aux [N, 3Ht], final [N, Ht], input_ids,
              loss_mask, lengths) in a temp dir on a real disk, fsyncs it and drops it from the
              page cache (posix_fadvise DONTNEED; --warm-cache keeps it), so that
           2. train: the trainer reads the files back from disk (the next file is prefetched by
              a thread, as a DataLoader worker would) and trains.
           Two offline runs by default (--offline-threads): each pass with --threads (the same
           per-role compute as online; the other core idles) and each pass with 2 x --threads
           (the same total hardware as online, since offline never runs both halves at once).

Wall time of a run: from starting the target process to the last optimizer step (offline: the
two passes added). Each run starts one engine; the time to its first batch (engine start-up +
the first prefill) is shown apart, and the ratio is also given without it. Bytes on disk: the
processes' I/O counters (/proc/<pid>/io write_bytes: the trainer's over the run, the target's
over its streaming phase) and the allocated size of the dump folder. Kimi-K2.5's hidden states
cost (3 aux + 1 final) x 7168 x 2 bytes (bf16) = 57,344 bytes per token.

    .venv/bin/python benchmarks/online_vs_offline.py          # ~5 min on 2 CPU cores (3 engine starts)
    .venv/bin/python benchmarks/online_vs_offline.py --samples 48 --offline-threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

from _common import RESULTS, replot, fmt_bytes, machine_info, new_figure, print_table, save_figure, set_threads, write_json
from specforge_k25.data.tokenize import Sample
from specforge_k25.setup.run import prepare
from specforge_k25.setup.target import make_target_stream
from specforge_k25.train.schedule import build_schedule
from specforge_k25.train.disk import allocated_bytes
from specforge_k25.train.learner import build_learner
from stream import build_job, cpu_pair_speed

DEFAULT_OUT = RESULTS / "online_vs_offline.json"
GOAL = 1.5  # the project's goal: online >= 1.5x faster than offline
KIMI_HIDDEN, KIMI_AUX_LAYERS, KIMI_DTYPE_BYTES = 7168, 3, 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", choices=["smollm2", "tiny_deepseek"], default="smollm2", help="embedded target")
    p.add_argument("--engine", choices=["sglang", "hf"], default="sglang",
                   help="target engine in the target process (hf: the HF reference, for quick checks)")
    p.add_argument("--samples", type=int, default=16, help="training conversations (one epoch)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per target batch = per micro-batch")
    p.add_argument("--vocab", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--threads", type=int, default=1, help="online: CPU threads of the target and of the trainer each")
    p.add_argument("--offline-threads", default=None,
                   help="comma-separated threads per pass, one offline run each (default: --threads and 2 x "
                        "--threads: the online run's per-role and total compute)")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="parent folder of the offline dump (default: the system temp dir); must be a real disk")
    p.add_argument("--warm-cache", action="store_true", help="keep the dump in the page cache (no DONTNEED)")
    p.add_argument("--keep-dump", action="store_true", help="do not delete the dump folder")
    p.add_argument("--no-calibrate", action="store_true", help="skip the ~10 s two-process CPU speed check")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (the PNG goes beside it)")
    p.add_argument("--replot", action="store_true", help="measure nothing: redraw the PNG from the JSON at --out")
    args = p.parse_args(argv)
    args.offline_threads = [int(x) for x in (args.offline_threads or f"{args.threads},{2 * args.threads}").split(",")]
    return args


# ------------------------------------------------------------------------------- the dump
def dump_batch(path: Path, samples, lengths: list[int], aux: torch.Tensor, final: torch.Tensor,
               drop_cache: bool = True) -> None:
    """One batch as one safetensors file, fsync'ed to disk (and dropped from the page cache)."""
    save_file({
        "aux": aux.contiguous(), "final": final.contiguous(),
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
    }, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_batch(path: Path) -> tuple[list[Sample], list[int], torch.Tensor, torch.Tensor]:
    """The inverse of dump_batch: (samples, lengths, aux, final), everything read from the file."""
    t = load_file(str(path))
    lengths = t["lengths"].tolist()
    ids, mask = t["input_ids"].split(lengths), t["loss_mask"].split(lengths)
    return [Sample(i, m) for i, m in zip(ids, mask)], lengths, t["aux"], t["final"]


def filesystem_of(path: Path) -> str:
    path = path.resolve()
    best = None
    for part in psutil.disk_partitions(all=True):
        if str(path).startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    return f"{best.fstype} ({best.device} on {best.mountpoint})" if best else "unknown"


# -------------------------------------------------------------------------------- the runs
class Io:
    """This process's /proc/self/io byte counters since construction."""

    def __init__(self):
        self.proc = psutil.Process()
        self.start = self.proc.io_counters()

    def delta(self) -> dict:
        now = self.proc.io_counters()
        return {"write_bytes": now.write_bytes - self.start.write_bytes,
                "read_bytes": now.read_bytes - self.start.read_bytes}


def train_on(trainer, samples, lengths, aux, final) -> tuple[float, int]:
    batch = trainer.make_batch(samples, lengths, aux, final)
    res = trainer.train_micro(batch)
    trainer.optimizer_step()
    return float(res.loss.detach()), batch.num_tokens


def run_online(job, setup, plan, steps, threads: int, engine: str = "sglang") -> dict:
    job.hw.target_threads = job.hw.trainer_threads = threads
    set_threads(threads)
    trainer = build_learner(job, setup, steps, torch.device("cpu"))
    losses, tokens, t_first = [], 0, None
    stream = make_target_stream(job, setup, setup.data.train, plan, engine=engine)
    io = Io()
    t0 = time.perf_counter()
    with stream:
        for (msg, aux, final), ids in zip(stream, plan):
            t_first = t_first or time.perf_counter()
            batch = trainer.make_batch([setup.data.train[i] for i in ids], msg.lengths, aux, final)
            stream.release(msg)
            res = trainer.train_micro(batch)
            trainer.optimizer_step()
            losses.append(float(res.loss.detach()))
            tokens += batch.num_tokens
    t_end = time.perf_counter()
    trainer_io = io.delta()
    target_written = stream.target_io.streaming_write_bytes
    return {
        "mode": "online", "threads": f"{threads}+{threads} concurrent",
        "wall_s": t_end - t0, "to_first_batch_s": t_first - t0, "tokens": tokens, "losses": losses,
        "phases": {"engine start + first batch": t_first - t0, "stream + train": t_end - t_first},
        "trainer_write_bytes": trainer_io["write_bytes"], "target_write_bytes": target_written,
        "target_startup_write_bytes": stream.target_io.startup_write_bytes,
        # the target process produces every hidden state: its writes while streaming bound what reached disk
        "hidden_state_bytes_on_disk": target_written,
        "dump_bytes": 0, "trainer_read_bytes": trainer_io["read_bytes"],
    }


def run_offline(job, setup, plan, steps, threads: int, dump_parent: Path | None = None, drop_cache: bool = True,
                keep_dump: bool = False, engine: str = "sglang") -> dict:
    job.hw.target_threads = job.hw.trainer_threads = threads
    set_threads(threads)
    dump = Path(tempfile.mkdtemp(prefix="eagle3_offline_dump_", dir=dump_parent))
    try:
        # pass 1: target -> files
        stream = make_target_stream(job, setup, setup.data.train, plan, engine=engine)
        io = Io()
        t0 = time.perf_counter()
        t_first = None
        files = []
        with stream:
            for (msg, aux, final), ids in zip(stream, plan):
                t_first = t_first or time.perf_counter()
                path = dump / f"batch_{msg.item:06d}.safetensors"
                dump_batch(path, [setup.data.train[i] for i in ids], msg.lengths, aux, final, drop_cache)
                stream.release(msg)
                files.append(path)
        t_dumped = time.perf_counter()
        dump_io = io.delta()
        dump_bytes = allocated_bytes(dump)

        # pass 2: files -> trainer
        trainer = build_learner(job, setup, steps, torch.device("cpu"))
        losses, tokens = [], 0
        io = Io()
        t1 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(load_batch, files[0])
            for i in range(len(files)):
                loaded = pending.result()
                if i + 1 < len(files):
                    pending = pool.submit(load_batch, files[i + 1])
                loss, n = train_on(trainer, *loaded)
                losses.append(loss)
                tokens += n
        t_trained = time.perf_counter()
        train_io = io.delta()
    finally:
        if not keep_dump:
            shutil.rmtree(dump, ignore_errors=True)
    target_written = stream.target_io.streaming_write_bytes
    return {
        "mode": "offline", "threads": f"{threads}, then {threads}", "threads_per_pass": threads,
        "wall_s": (t_dumped - t0) + (t_trained - t1), "to_first_batch_s": t_first - t0, "tokens": tokens,
        "losses": losses,
        "phases": {"engine start + first batch": t_first - t0, "target pass + dump": t_dumped - t_first,
                   "read back + train": t_trained - t1},
        "trainer_write_bytes": dump_io["write_bytes"] + train_io["write_bytes"], "target_write_bytes": target_written,
        "target_startup_write_bytes": stream.target_io.startup_write_bytes,
        "dump_write_bytes": dump_io["write_bytes"],  # the trainer process's writes during the dump pass
        "hidden_state_bytes_on_disk": dump_bytes + target_written,
        "dump_bytes": dump_bytes, "trainer_read_bytes": train_io["read_bytes"], "dump_dir": str(dump),
        "dump_filesystem": filesystem_of(dump.parent), "page_cache_dropped": drop_cache,
    }


# ------------------------------------------------------------------------------------ report
def kimi_extrapolation(tokens: int, dump_bytes: int, hidden: int, elem_bytes: int) -> dict:
    ours = (KIMI_AUX_LAYERS + 1) * hidden * elem_bytes
    kimi = (KIMI_AUX_LAYERS + 1) * KIMI_HIDDEN * KIMI_DTYPE_BYTES
    measured = dump_bytes / tokens if tokens else float("nan")
    return {
        "this_target_bytes_per_token_analytic": ours,
        "this_target_bytes_per_token_measured": measured,  # incl. ids, mask, file headers, block rounding
        "kimi_bytes_per_token": kimi,
        "kimi_bytes_per_1m_tokens": kimi * 10**6,
        "kimi_bytes_per_1b_tokens": kimi * 10**9,
        "kimi_bytes_per_1b_tokens_with_measured_overhead": kimi * 10**9 * measured / ours,
    }


def plot(result: dict, path: Path) -> None:
    fig, (ax,) = new_figure(1, width=8.0, height=1.6 + 0.8 * len(result["runs"]))
    colors = {"engine start + first batch": "#bbbbbb", "stream + train": "#2b8cbe",
              "target pass + dump": "#fdae6b", "read back + train": "#e6550d"}
    labels = []
    for y, run in enumerate(result["runs"]):
        left = 0.0
        for name, sec in run["phases"].items():
            ax.barh(y, sec, left=left, color=colors.get(name), label=name if name not in labels else None)
            labels.append(name)
            left += sec
        ax.text(left, y, f" {run['wall_s']:.0f} s, {fmt_bytes(run['hidden_state_bytes_on_disk'])} of hidden states on disk",
                va="center", fontsize=8)
    ax.set_yticks(range(len(result["runs"])), [f"{r['mode']}\n{r['threads']} thr" for r in result["runs"]])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (wall)")
    ax.set_xlim(0, max(r["wall_s"] for r in result["runs"]) * 1.35)
    ratios = ", ".join(f"{c['ratio_end_to_end']:.2f}x ({c['offline_threads']} thr)" for c in result["comparisons"])
    ax.set_title(f"{result['tokens']} tokens of {result['setup']['target']}: offline / online wall = {ratios}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4)
    save_figure(fig, path)


def print_report(result: dict) -> None:
    rows = []
    for r in result["runs"]:
        phases = r["phases"]
        dump_s = phases.get("target pass + dump")
        rows.append([r["mode"], r["threads"], f"{r['to_first_batch_s']:.1f}", "-" if dump_s is None else f"{dump_s:.1f}",
                     f"{phases.get('read back + train', phases.get('stream + train')):.1f}", f"{r['wall_s']:.1f}",
                     f"{r['tokens'] / r['wall_s']:.0f}", fmt_bytes(r["hidden_state_bytes_on_disk"]),
                     fmt_bytes(r["target_write_bytes"]), fmt_bytes(r["trainer_write_bytes"]),
                     fmt_bytes(r["trainer_read_bytes"])])
    print_table(f"online vs offline on the same {result['batches']} batches / {result['tokens']} tokens "
                f"({result['setup']['target']}, {result['setup']['architecture']})",
                ["run", "threads", "to 1st batch s", "target+dump s", "train s", "wall s", "tokens/s",
                 "hidden states on disk", "target wrote", "trainer wrote", "trainer read"], rows)
    print(f"(writes/reads: /proc/<pid>/io over the run; smallest batch of hidden states = "
          f"{fmt_bytes(result['smallest_batch_hidden_bytes'])}, so a spilled batch could not hide in the trainer's "
          f"other writes below that)")
    for r in result["comparisons"]:
        mark = "meets" if r["ratio_end_to_end"] >= GOAL else "BELOW"
        print(f"offline[{r['offline_threads']} thr] / online = {r['ratio_end_to_end']:.2f}x end to end "
              f"({mark} goal {GOAL}x); {r['ratio_after_first_batch']:.2f}x after the first batch; "
              f"max |loss difference| over steps {r['max_abs_loss_diff']:.2e}")
    k = result["kimi"]
    print(f"hidden-state bytes per token: this target {k['this_target_bytes_per_token_analytic']} analytic, "
          f"{k['this_target_bytes_per_token_measured']:.0f} measured in the dump; Kimi-K2.5 "
          f"{k['kimi_bytes_per_token']} B/token = {fmt_bytes(k['kimi_bytes_per_1m_tokens'])} per 1M tokens = "
          f"{k['kimi_bytes_per_1b_tokens'] / 1e12:.1f} TB per 1B tokens (offline); online: 0")
    if result["machine"].get("cpu_pair_speed"):
        print(f"cpu pair speed = {result['machine']['cpu_pair_speed']['pair_speed']:.2f} (two concurrent compute-bound "
              f"processes, each vs alone; 1.0 = independent cores)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        return replot(args.out, plot)
    job = build_job(args)
    set_threads(args.threads)
    t0 = time.perf_counter()
    setup = prepare(job)
    plan_items, steps = build_schedule(len(setup.data.train), 0, batch_size=job.train.batch_size, grad_accum=1,
                                   epochs=1, max_steps=None, eval_every=None, seed=job.train.seed)
    plan = [p.sample_ids for p in plan_items]
    tokens = sum(len(setup.data.train[i].input_ids) for b in plan for i in b)
    print(f"target {job.target.name} ({setup.info.architecture}, hidden {setup.info.hidden_size}); {len(plan)} batches "
          f"of {job.train.batch_size}, {tokens} tokens; prepared in {time.perf_counter() - t0:.1f} s", flush=True)

    print(f"online ({args.threads}+{args.threads} threads) ...", flush=True)
    runs = [run_online(job, setup, plan, steps, args.threads, args.engine)]
    for threads in args.offline_threads:
        print(f"offline ({threads} threads per pass) ...", flush=True)
        runs.append(run_offline(job, setup, plan, steps, threads, args.dump_dir, not args.warm_cache, args.keep_dump,
                                args.engine))
    online = runs[0]
    comparisons = []
    for off in runs[1:]:
        comparisons.append({
            "offline_threads": off["threads_per_pass"],
            "ratio_end_to_end": off["wall_s"] / online["wall_s"],
            "ratio_after_first_batch": (off["wall_s"] - off["to_first_batch_s"]) / (online["wall_s"] - online["to_first_batch_s"]),
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(off["losses"], online["losses"])),
        })
    calib = None if args.no_calibrate else cpu_pair_speed(args.threads)
    elem = torch.finfo(getattr(torch, job.hw.target_dtype)).bits // 8
    dump_bytes = max((r["dump_bytes"] for r in runs[1:]), default=0)
    smallest = min(sum(len(setup.data.train[i].input_ids) for i in b) for b in plan)
    job_dict = dataclasses.asdict(job)
    result = {
        "benchmark": "online_vs_offline", "goal_offline_over_online": GOAL, "batches": len(plan), "tokens": tokens,
        "comparisons": comparisons, "runs": runs,
        "smallest_batch_hidden_bytes": smallest * (KIMI_AUX_LAYERS + 1) * setup.info.hidden_size * elem,
        "kimi": kimi_extrapolation(tokens, dump_bytes, setup.info.hidden_size, elem),
        "byte_accounting": ("write_bytes / read_bytes from /proc/<pid>/io: the trainer process over the run "
                            "(offline: dump + train passes), the target process over its streaming phase; "
                            "dump size = allocated blocks of the dump folder"),
        "setup": {"target": job.target.name, "engine": args.engine, "model_path": setup.model_path,
                  "architecture": setup.info.architecture, "hidden_size": setup.info.hidden_size,
                  "target_dtype": job.hw.target_dtype, "capture_points": setup.capture_points,
                  "data": setup.data.summary()},
        "args": vars(args), "job": job_dict,
        "machine": machine_info(cpu_pair_speed=calib), "total_wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print_report(result)
    return result


if __name__ == "__main__":
    main()
