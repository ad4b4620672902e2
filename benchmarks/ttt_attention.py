"""One draft attention forward + backward at TTT step k: the exact attention (draft/eagle3/ttt_attention.py)
beside the dense-mask attention it replaced, peak memory and time against T.

The draft's `Attention` module (q/k/v/o projections, RoPE, the TTT attention) at step k = 3 of one
sequence: x [1, T, 2H] and the k earlier steps' (K_j, V_j) [1, nkv, T, hd] are leaves that need
gradients (as in training, where they come from the earlier steps), out [1, T, H] is summed and
back-propagated. "dense" is the same module with `ttt_attention_dense_reference` (one SDPA call over
[B, nh, (k+1)T, hd] keys with the [T, (k+1)T] bool mask), i.e. the code before issue 22.

Shapes: SmolLM2 (the CPU default draft: H 576, 9/3 heads x 64) and a scaled-down Kimi-K2.5 draft
(the plan's 56/8 heads x 128 at H 7168, one eighth: 7/1 heads x 128, H 896; same GQA ratio and
head dim). fp32, one intra-op thread.

Memory: peak RSS delta, Linux VmHWM (reset through /proc/self/clear_refs right before the call;
the counter getrusage's ru_maxrss reads) minus VmRSS just before it, inputs already allocated and
the parameter gradients allocated by a warm-up call; one child process per (shape, attention)
running the T points in ascending order, with MALLOC_MMAP_THRESHOLD_=1MiB so that freed tensors
leave the resident set at once. Time: wall clock of the same call (median of 3 up to T = 2048,
one call above; the memory is the largest of those calls). The dense attention stops when its next
point (4x the last: quadratic in T) would pass --dense-max-bytes or --dense-max-s.

    .venv/bin/python benchmarks/ttt_attention.py           # ~7-8 min on 2 shared CPU cores
    .venv/bin/python benchmarks/ttt_attention.py --small   # seconds (smoke test)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

from _common import (MiB, RESULTS, fmt_bytes, machine_info, new_figure, print_table, replot, run_child_points, save_figure,
                     set_threads, write_json)

DEFAULT_OUT = RESULTS / "ttt_attention.json"
SHAPES = {
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64),
    "kimi_1/8": dict(hidden=896, heads=7, kv_heads=1, head_dim=128),
}
SMALL_SHAPES = {"tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16)}
METHODS = ("new", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shape, T 64,128 (smoke test, seconds)")
    p.add_argument("--seq-lens", default=None, help="T points (default 256,...,16384; --small 64,128)")
    p.add_argument("--k", type=int, default=3, help="TTT step measured (k earlier steps' keys)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each child")
    p.add_argument("--dense-max-bytes", type=float, default=8e9, help="stop the dense one before a point predicted "
                                                                      "to need more")
    p.add_argument("--dense-max-s", type=float, default=200.0, help="stop the dense one before a point predicted "
                                                                    "to take longer")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (the .md and .png go beside it)")
    p.add_argument("--replot", action="store_true", help="measure nothing: redraw the PNG from the JSON at --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one (shape, method) as JSON
    args = p.parse_args(argv)
    args.seq_lens = [int(t) for t in (args.seq_lens or ("64,128" if args.small else
                                                         "256,512,1024,2048,4096,8192,16384")).split(",")]
    return args


# ---------------------------------------------------------------------------- child process
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(spec: dict) -> None:
    """One (shape, method): each T in order, one RESULT line per point (the parent reads them)."""
    set_threads(spec["threads"])
    import torch

    import specforge_k25.draft.eagle3.model as draft_model
    from specforge_k25.draft.eagle3.ttt_attention import ttt_attention_dense_reference

    if spec["method"] == "dense":
        draft_model.ttt_attention = ttt_attention_dense_reference  # the module looks the name up per call
    s, k = spec["shape"], spec["k"]
    cfg = draft_model.DraftConfig(hidden_size=s["hidden"], intermediate_size=1, num_attention_heads=s["heads"],
                                  num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=8,
                                  draft_vocab_size=8, target_hidden_size=s["hidden"])
    torch.manual_seed(0)
    attn = draft_model.Attention(cfg)

    def inputs(T):
        x = torch.randn(1, T, 2 * cfg.hidden_size, requires_grad=True)  # [1, T, 2H]
        past = [tuple(torch.randn(1, cfg.num_key_value_heads, T, cfg.head_dim, requires_grad=True) for _ in "kv")
                for _ in range(k)]  # (K_j, V_j) [1, nkv, T, hd]
        positions = (torch.arange(T) + k)[None]
        return x, positions, past

    def call(x, positions, past):
        out, _ = attn(x, positions, past)  # [1, T, H]
        out.sum().backward()

    call(*inputs(32))  # warm-up: parameter .grad tensors, kernels
    max_s = spec["dense_max_s"] if spec["method"] == "dense" else float("inf")
    max_b = spec["dense_max_bytes"] if spec["method"] == "dense" else float("inf")
    last = None
    for T in spec["seq_lens"]:
        if last is not None:
            growth = (T / last["seq_len"]) ** 2  # dense: the mask and the scores are quadratic in T
            if last["peak_delta"] * growth > max_b or last["time_s"] * growth > max_s:
                print("RESULT " + json.dumps({"seq_len": T, "status": "skipped",
                                              "why": f"predicted {fmt_bytes(last['peak_delta'] * growth)}, "
                                                     f"{last['time_s'] * growth:.0f} s"}), flush=True)
                continue
        times, peaks = [], []
        for _ in range(3 if T <= 2048 else 1):
            x, positions, past = inputs(T)
            attn.zero_grad(set_to_none=False)
            gc.collect()
            rss_before = _status_kib("VmRSS") * 1024
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current resident set
            t0 = time.perf_counter()
            call(x, positions, past)
            times.append(time.perf_counter() - t0)
            peaks.append(_status_kib("VmHWM") * 1024 - rss_before)
            del x, positions, past
        last = {"seq_len": T, "status": "ok", "time_s": statistics.median(times), "times_s": times,
                "peak_delta": max(peaks), "tokens_per_s": T / statistics.median(times)}
        print("RESULT " + json.dumps(last), flush=True)


def run_child(spec: dict) -> list[dict]:
    return run_child_points(__file__, spec)


# ------------------------------------------------------------------------------------ report
def slope(rows: list[dict], key: str, t_min: int) -> float | None:
    """Least-squares exponent a of key ~ T^a over the measured points with T >= t_min."""
    pts = [(math.log(r["seq_len"]), math.log(r[key])) for r in rows
           if r["status"] == "ok" and r["seq_len"] >= t_min and r[key] > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def summarize(rows: list[dict], t_min: int) -> dict:
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for method in METHODS:
            sel = [r for r in rows if r["shape"] == shape and r["method"] == method]
            out[f"{shape}/{method}"] = {"memory_exponent": slope(sel, "peak_delta", t_min),
                                        "time_exponent": slope(sel, "time_s", t_min)}
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"One draft attention forward+backward at TTT step k={result['k']}, fp32, 1 thread "
             f"(peak RSS delta, VmHWM; time in s).", "",
             "| shape | T | new peak + | dense peak + | new s | dense s | dense / new memory | dense / new time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["shape"], r["method"], r["seq_len"]): r for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for T in sorted({r["seq_len"] for r in rows if r["shape"] == shape}):
            n, d = by.get((shape, "new", T)), by.get((shape, "dense", T))
            ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
            cells = [shape, str(T),
                     fmt_bytes(n["peak_delta"]) if ok(n) else "-", fmt_bytes(d["peak_delta"]) if ok(d) else "skipped",
                     f"{n['time_s']:.2f}" if ok(n) else "-", f"{d['time_s']:.2f}" if ok(d) else "skipped",
                     f"{d['peak_delta'] / n['peak_delta']:.1f}x" if ok(n) and ok(d) and n["peak_delta"] > 0 else "",
                     f"{d['time_s'] / n['time_s']:.1f}x" if ok(n) and ok(d) and n["time_s"] > 0 else ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Exponents a of a T^a least-squares fit over T >= {result['slope_t_min']}:", "",
              "| shape / attention | memory a | time a |", "|---|---:|---:|"]
    for name, s in result["exponents"].items():
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {name} | {fmt(s['memory_exponent'])} | {fmt(s['time_exponent'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(2, width=5.5)
    colors = dict(zip(dict.fromkeys(r["shape"] for r in result["rows"]), ("tab:blue", "tab:orange", "tab:green")))
    for ax, key, scale, ylabel in ((axes[0], "peak_delta", MiB, "peak RSS delta (MiB)"),
                                   (axes[1], "time_s", 1.0, "seconds")):
        for shape, color in colors.items():
            for method, style in (("new", "o-"), ("dense", "s--")):
                sel = [r for r in result["rows"] if r["shape"] == shape and r["method"] == method and r["status"] == "ok"]
                ax.plot([r["seq_len"] for r in sel], [r[key] / scale for r in sel], style, color=color,
                        label=f"{shape} {method}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].set_title(f"peak memory, attention fwd+bwd, k={result['k']}", fontsize=10)
    axes[1].set_title("time", fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        return replot(args.out, plot)
    if args.child:
        child(json.loads(args.child))
        return {}
    t0 = time.perf_counter()
    shapes = SMALL_SHAPES if args.small else SHAPES
    rows = []
    for name, shape in shapes.items():
        for method in METHODS:
            rows += run_child({"shape_name": name, "shape": shape, "method": method, "k": args.k,
                               "seq_lens": args.seq_lens, "threads": args.threads,
                               "dense_max_bytes": args.dense_max_bytes, "dense_max_s": args.dense_max_s})
    t_min = min(1024, max(args.seq_lens))
    result = {
        "benchmark": "ttt_attention", "k": args.k, "shapes": shapes, "rows": rows, "slope_t_min": t_min,
        "exponents": summarize(rows, t_min),
        "memory_method": ("peak RSS delta: /proc/self/status VmHWM after resetting it via /proc/self/clear_refs "
                          "(the counter getrusage ru_maxrss reads), minus VmRSS before the call; one child process "
                          "per (shape, attention), MALLOC_MMAP_THRESHOLD_=1MiB, after a 32-token warm-up call"),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine_info(threads=args.threads), "total_wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)
    md = markdown(result)
    args.out.with_suffix(".md").write_text(md)
    print(f"wrote {args.out.with_suffix('.md')}")
    plot(result, args.out.with_suffix(".png"))
    print_table(f"TTT attention fwd+bwd at k={args.k} (peak RSS delta, s)",
                ["shape", "attention", "T", "peak +", "s"],
                [[r["shape"], r["method"], str(r["seq_len"]), fmt_bytes(r.get("peak_delta")),
                  f"{r['time_s']:.2f}" if r["status"] == "ok" else "skipped"] for r in rows])
    print(md)
    return result


if __name__ == "__main__":
    main()
