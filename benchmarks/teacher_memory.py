"""Trainer memory as the target vocabulary grows (chunked teacher), and draft step time vs T and K.

Part 1, memory. One draft training step (DraftLearner: make_batch with the teacher ->
train_micro -> optimizer_step) at fixed T and fixed draft vocab Vd, for target vocabs V = 32k,
64k, 128k, 164k, each in a fresh subprocess, twice: with the teacher in chunks of `--chunk`
positions (as the trainer runs) and with one chunk covering the whole batch (what a non-chunked
teacher does: [B*T, V] fp32 logits at once). Measured: the peak resident set during the step
minus the resident set just before it (Linux VmHWM, reset through /proc/self/clear_refs after a
small warm-up step that allocates the AdamW state; the same counter getrusage's ru_maxrss reads).
Each child runs with MALLOC_MMAP_THRESHOLD_=1 MiB so that freed tensors leave the resident set at
once. Beside it: the analytic size of the non-chunked [B*T, V] fp32 logits and of one
[chunk, V] fp32 chunk. What stays in memory across steps and grows with V (the frozen embedding
[V, H] and the target lm_head [V, Ht], fp32) is reported apart (resident before the step).

Part 2, time (this process). Median step time of a SmolLM2-shaped draft (the CPU default: H 576,
9/3 heads, I 1536, V 49152, Vd 4096, fp32) vs T at K = 7, and vs ttt_length K at fixed T, split
into teacher / fwd+bwd / optimizer.

    .venv/bin/python benchmarks/teacher_memory.py            # ~3-4 min on 2 CPU cores
    .venv/bin/python benchmarks/teacher_memory.py --small    # seconds (smoke test)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, replot, MiB, fmt_bytes, machine_info, new_figure, print_table, save_figure, set_threads, write_json

DEFAULT_OUT = RESULTS / "teacher_memory.json"
SMOLLM2_DRAFT = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, draft_vocab=4096)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes and few configs (smoke test, seconds)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of every measuring process")
    g = p.add_argument_group("part 1: memory vs target vocab (one subprocess per config)")
    g.add_argument("--vocabs", default=None, help="target vocab sizes (default 32768,65536,131072,163840)")
    g.add_argument("--mem-seq-len", type=int, default=None, help="T (default 2048; --small 256)")
    g.add_argument("--chunk", type=int, default=None, help="teacher chunk, positions (default 256; --small 32)")
    g.add_argument("--mem-hidden", type=int, default=None, help="draft = target hidden H (default 256; --small 64)")
    g.add_argument("--mem-draft-vocab", type=int, default=None, help="draft vocab Vd, fixed (default 4096; --small 256)")
    g = p.add_argument_group("part 2: step time vs T and vs ttt_length (SmolLM2-shaped draft)")
    g.add_argument("--seq-lens", default=None, help="T at K=7 (default 128,256,512,1024; --small 32,64)")
    g.add_argument("--ttt-lengths", default=None, help="K at --k-seq-len (default 1,2,3,4,5,6,7; --small 1,2)")
    g.add_argument("--k-seq-len", type=int, default=None, help="T of the K sweep (default 512; --small 32)")
    g.add_argument("--reps", type=int, default=2, help="timed steps per config (after one warm-up)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (the PNG goes beside it)")
    p.add_argument("--replot", action="store_true", help="measure nothing: redraw the PNG from the JSON at --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one memory config as JSON
    args = p.parse_args(argv)

    def ints(text, default, small):
        return [int(x) for x in (text or (small if args.small else default)).split(",")]

    args.vocabs = ints(args.vocabs, "32768,65536,131072,163840", "2048,4096")
    args.seq_lens = ints(args.seq_lens, "128,256,512,1024", "32,64")
    args.ttt_lengths = ints(args.ttt_lengths, "1,2,3,4,5,6,7", "1,2")
    for name, full, small in (("mem_seq_len", 2048, 256), ("chunk", 256, 32), ("mem_hidden", 256, 64),
                              ("mem_draft_vocab", 4096, 256), ("k_seq_len", 512, 32)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    return args


# --------------------------------------------------------------------------- trainer pieces
def make_trainer(*, hidden, heads, kv_heads, head_dim, intermediate, vocab, draft_vocab, chunk, ttt_length=7):
    """A DraftLearner on CPU, fp32, random weights; d2t = 0 (draft ids = the first Vd target ids)."""
    import torch

    from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
    from specforge_k25.train.optim import build_optimizer, build_scheduler
    from specforge_k25.draft.registry import method_of
    from specforge_k25.train.learner import DraftLearner

    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      draft_vocab_size=draft_vocab, target_hidden_size=hidden, max_position_embeddings=8192)
    draft = Eagle3Draft(cfg)
    lm_head = torch.randn(vocab, hidden) * hidden**-0.5
    optimizer = build_optimizer(draft.trainable_parameters(), 5e-5, (0.9, 0.95), 0.0)
    scheduler = build_scheduler(optimizer, 1000, 0.015)
    method = method_of(draft)
    return DraftLearner(method, draft, lm_head, optimizer, scheduler, spec=method.spec_class(ttt_length=ttt_length), grad_accum=1,
                        grad_clip=0.5, teacher_chunk=chunk, autocast_bf16=False)


def random_batch_inputs(trainer, seq_len: int, batch: int = 1):
    """Samples + packed aux/final hidden states, as the stream hands them over."""
    import torch

    from specforge_k25.data.tokenize import Sample

    cfg = trainer.draft.cfg
    samples = []
    for _ in range(batch):
        mask = torch.ones(seq_len, dtype=torch.bool)
        mask[: seq_len // 8] = False
        samples.append(Sample(torch.randint(0, cfg.vocab_size, (seq_len,)), mask))
    n = batch * seq_len
    return samples, [seq_len] * batch, torch.randn(n, 3 * cfg.target_hidden_size), torch.randn(n, cfg.target_hidden_size)


def train_step(trainer, inputs) -> dict:
    t0 = time.perf_counter()
    batch = trainer.make_batch(*inputs)
    t1 = time.perf_counter()
    trainer.train_micro(batch)
    t2 = time.perf_counter()
    trainer.optimizer_step()
    t3 = time.perf_counter()
    return {"step_s": t3 - t0, "teacher_s": t1 - t0, "fwd_bwd_s": t2 - t1, "optim_s": t3 - t2}


# ---------------------------------------------------------------------------- part 1 child
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Linux >= 4.0: VmHWM (and getrusage's ru_maxrss) restart from the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def child_memory(spec: dict) -> dict:
    set_threads(spec["threads"])
    import torch  # noqa: F401  (imported before the baseline)

    rss_import = rss_bytes()
    trainer = make_trainer(hidden=spec["hidden"], heads=spec["heads"], kv_heads=spec["kv_heads"],
                           head_dim=spec["head_dim"], intermediate=spec["intermediate"], vocab=spec["vocab"],
                           draft_vocab=spec["draft_vocab"], chunk=spec["chunk"])
    train_step(trainer, random_batch_inputs(trainer, 16))  # warm-up: AdamW state, kernels
    inputs = random_batch_inputs(trainer, spec["seq_len"])
    gc.collect()
    rss_before = rss_bytes()
    reset_peak_rss()
    batch = trainer.make_batch(*inputs)  # the teacher
    peak_teacher = peak_rss_bytes()
    reset_peak_rss()  # back to the current resident set, which still holds the batch
    trainer.train_micro(batch)
    trainer.optimizer_step()
    peak_ttt = peak_rss_bytes()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return {
        "resident_before_step": rss_before - rss_import,
        "teacher_peak_delta": peak_teacher - rss_before,
        "ttt_peak_delta": peak_ttt - rss_before,
        "step_peak_delta": max(peak_teacher, peak_ttt) - rss_before,
        "ru_maxrss_minus_vmhwm": ru_maxrss - peak_ttt,  # ~0: the two read the same high-water mark
    }


def run_memory_config(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MALLOC_MMAP_THRESHOLD_": str(MiB),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory child {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def part_memory(args) -> list[dict]:
    rows = []
    T = args.mem_seq_len
    shape = dict(hidden=args.mem_hidden, heads=4, kv_heads=2, head_dim=args.mem_hidden // 4,
                 intermediate=3 * args.mem_hidden, draft_vocab=args.mem_draft_vocab, seq_len=T, threads=args.threads)
    for vocab in args.vocabs:
        for mode, chunk in (("chunked", args.chunk), ("one chunk (non-chunked)", T)):
            spec = {**shape, "vocab": vocab, "chunk": chunk}
            t0 = time.perf_counter()
            res = run_memory_config(spec)
            row = {"vocab": vocab, "mode": mode, "chunk": chunk, "seq_len": T, **res,
                   "analytic_full_logits_bytes": 4 * T * vocab, "analytic_chunk_logits_bytes": 4 * min(chunk, T) * vocab,
                   "analytic_vocab_state_bytes": 4 * vocab * 2 * args.mem_hidden,
                   "wall_s": time.perf_counter() - t0}
            print(f"  V={vocab} {mode}: step peak +{fmt_bytes(row['step_peak_delta'])} "
                  f"(teacher +{fmt_bytes(row['teacher_peak_delta'])})", flush=True)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------- part 2
def part_time(args) -> dict:
    set_threads(args.threads)
    if args.small:
        shape = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=2048, draft_vocab=256)
    else:
        shape = SMOLLM2_DRAFT
    trainer = make_trainer(**shape, chunk=1024)

    def measure(seq_len: int, k: int) -> dict:
        trainer.spec = dataclasses.replace(trainer.spec, ttt_length=k)
        trainer.depth = k  # the TTT unroll: the EAGLE-3 method's depth
        inputs = random_batch_inputs(trainer, seq_len)
        train_step(trainer, inputs)  # warm-up
        steps = [train_step(trainer, inputs) for _ in range(args.reps)]
        row = {"seq_len": seq_len, "ttt_length": k, **{key: statistics.median(s[key] for s in steps) for key in steps[0]}}
        row["tokens_per_s"] = seq_len / row["step_s"]
        print(f"  T={seq_len} K={k}: {row['step_s']:.3f} s/step", flush=True)
        return row

    vs_t = [measure(T, 7) for T in args.seq_lens]
    vs_k = [measure(args.k_seq_len, k) for k in args.ttt_lengths]
    return {"draft_shape": shape, "teacher_chunk": 1024, "dtype": "float32", "vs_seq_len": vs_t, "vs_ttt_length": vs_k}


# ------------------------------------------------------------------------------------ report
def plot(result: dict, path: Path) -> None:
    panels = (1 if result["memory"] else 0) + (2 if result["time"] else 0)
    fig, axes = new_figure(max(panels, 1), width=5.0)
    i = 0
    if result["memory"]:
        ax = axes[i]
        i += 1
        rows = result["memory"]
        for mode, color in (("chunked", "tab:blue"), ("one chunk (non-chunked)", "tab:red")):
            sel = [r for r in rows if r["mode"] == mode]
            name = f"chunk {sel[0]['chunk']}" if mode == "chunked" else "non-chunked"
            x = [r["vocab"] / 1000 for r in sel]
            ax.plot(x, [r["step_peak_delta"] / MiB for r in sel], "o-", color=color, label=f"whole step, {name}")
            ax.plot(x, [r["teacher_peak_delta"] / MiB for r in sel], "s--", color=color, alpha=0.6,
                    label=f"teacher phase, {name}")
        sel = [r for r in rows if r["mode"] == "chunked"]
        ax.plot([r["vocab"] / 1000 for r in sel], [r["analytic_full_logits_bytes"] / MiB for r in sel], "k--",
                label="analytic [T, V] fp32 logits")
        ax.plot([r["vocab"] / 1000 for r in sel], [r["analytic_chunk_logits_bytes"] / MiB for r in sel], "k:",
                label="analytic [chunk, V] fp32")
        ax.set_xlabel("target vocab V (thousands)")
        ax.set_ylabel("MiB above the resident set")
        ax.set_title(f"peak memory, one training step, T={rows[0]['seq_len']}", fontsize=10)
        ax.legend(fontsize=7)
    if result["time"]:
        t = result["time"]
        for key, xlabel, title in (("vs_seq_len", "T (tokens, one sequence)", "step time vs T (K=7)"),
                                   ("vs_ttt_length", "ttt_length K", f"step time vs K (T={t['vs_ttt_length'][0]['seq_len']})")):
            ax = axes[i]
            i += 1
            rows = t[key]
            x = [r["seq_len" if key == "vs_seq_len" else "ttt_length"] for r in rows]
            bottom = [0.0] * len(rows)
            for part, name in (("teacher_s", "teacher"), ("fwd_bwd_s", "TTT fwd+bwd"), ("optim_s", "optimizer")):
                vals = [r[part] for r in rows]
                ax.bar([str(v) for v in x], vals, bottom=bottom, label=name)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xlabel(xlabel)
            ax.set_ylabel("seconds per step (median)")
            ax.set_title(title)
            ax.legend(fontsize=7)
    save_figure(fig, path)


def print_report(result: dict) -> None:
    if result["memory"]:
        rows = [[str(r["vocab"]), r["mode"], str(r["chunk"]), fmt_bytes(r["resident_before_step"]),
                 fmt_bytes(r["teacher_peak_delta"]), fmt_bytes(r["step_peak_delta"]),
                 fmt_bytes(r["analytic_chunk_logits_bytes"]), fmt_bytes(r["analytic_full_logits_bytes"])]
                for r in result["memory"]]
        m = result["memory"][0]
        print_table(f"peak memory of one training step vs target vocab (T={m['seq_len']}, Vd fixed; "
                    f"peak RSS delta, fresh process each)",
                    ["V", "teacher", "chunk", "resident before", "teacher peak +", "step peak +",
                     "chunk x V fp32", "T x V fp32"], rows)
    if result["time"]:
        t = result["time"]
        for key, title in (("vs_seq_len", "draft step time vs T (K=7)"), ("vs_ttt_length", "draft step time vs ttt_length")):
            rows = [[str(r["seq_len"]), str(r["ttt_length"]), f"{r['step_s']:.3f}", f"{r['teacher_s']:.3f}",
                     f"{r['fwd_bwd_s']:.3f}", f"{r['optim_s']:.3f}", f"{r['tokens_per_s']:.0f}"] for r in t[key]]
            print_table(f"{title}; draft {t['draft_shape']}", ["T", "K", "step s", "teacher s", "fwd+bwd s", "optim s",
                                                               "tokens/s"], rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        return replot(args.out, plot)
    if args.child:
        print("RESULT " + json.dumps(child_memory(json.loads(args.child))), flush=True)
        return {}
    t0 = time.perf_counter()
    memory = time_part = None
    if not args.skip_memory:
        print(f"part 1: memory, V {args.vocabs}, T {args.mem_seq_len}, chunk {args.chunk} ...", flush=True)
        memory = part_memory(args)
    if not args.skip_time:
        print(f"part 2: step time, T {args.seq_lens}, K {args.ttt_lengths} ...", flush=True)
        time_part = part_time(args)
    result = {
        "benchmark": "teacher_memory", "memory": memory, "time": time_part,
        "memory_method": ("peak RSS delta: /proc/self/status VmHWM after resetting it via /proc/self/clear_refs "
                          "(the counter getrusage ru_maxrss reads), minus VmRSS before the step; fresh subprocess "
                          "per config, MALLOC_MMAP_THRESHOLD_=1MiB, after a 16-token warm-up step"),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine_info(threads=args.threads), "total_wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print_report(result)
    return result


if __name__ == "__main__":
    main()
