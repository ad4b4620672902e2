"""One DFlash draft attention forward + backward: the tiled block attention
(draft/dflash/block_attention.py) beside the dense-mask attention it replaced, peak memory and time
against T.

The draft's `DFlashAttention` module (q/k/v/o projections, q/k norms, RoPE, the attention) over the
A blocks of one sequence: x [1, Q, H] (Q = A*8 block tokens) and the context ctx [1, T, H] are
leaves that need gradients (as in training, where they come from the previous layer and from fc),
out [1, Q, H] is summed and back-propagated. A = min(512, T - 2) anchors (the default
draft.num_anchors) spread evenly over 1..T-8 (dflash/plan.py `planned_anchors`). "dense" is the same
module with its block attention swapped for `dense_reference`, the attention loss.py used before
issue 22: the boolean mask [1, Q, T+Q] (context key < anchor | own block), K/V repeated to nh
heads, one masked SDPA call (on CPU its flash kernel, which converts the mask to an additive fp32
one). The tiling is built before the call, as the model builds it once per forward for all layers;
the dense mask is built inside the call, so its own Q (T+Q) bytes count in the dense peak.

Shape: a scaled-down Kimi-K2.5 draft (the plan's 56/8 heads x 128 at H 7168, one eighth: 7/1 heads
x 128, H 896; same GQA ratio and head dim), block 8, the default tile (512 rows x 1024 keys). fp32,
one intra-op thread.

Memory: peak RSS delta, Linux VmHWM (reset through /proc/self/clear_refs right before the call)
minus VmRSS just before it, inputs already allocated and the parameter gradients allocated by a
warm-up call; one child process per attention running the T points in ascending order, with
MALLOC_MMAP_THRESHOLD_=1MiB so that freed tensors leave the resident set at once (as
benchmarks/ttt_attention.py). Time: wall clock of the same call (median of 3 up to T = 2048, one
call above).

    .venv/bin/python benchmarks/dflash_attention.py           # a few minutes on 2 shared CPU cores
    .venv/bin/python benchmarks/dflash_attention.py --small   # seconds (smoke test)
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from _common import MiB, RESULTS, fmt_bytes, machine_info, new_figure, print_table, replot, save_figure, run_child_points, set_threads, \
    write_json
from ttt_attention import _status_kib, slope

DEFAULT_OUT = RESULTS / "dflash_attention.json"
SHAPES = {"kimi_1/8": dict(hidden=896, heads=7, kv_heads=1, head_dim=128, anchors=512, block=8)}
SMALL_SHAPES = {"tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, anchors=16, block=4)}
METHODS = ("new", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shape, T 64,128 (smoke test, seconds)")
    p.add_argument("--seq-lens", default=None, help="T points (default 256,...,16384; --small 64,128)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each child")
    p.add_argument("--max-s", type=float, default=150.0, help="stop an attention before a point predicted to "
                                                              "take longer (time grows ~linearly in T at fixed Q)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (the .md and .png go beside it)")
    p.add_argument("--replot", action="store_true", help="measure nothing: redraw the PNG from the JSON at --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one (shape, method) as JSON
    args = p.parse_args(argv)
    args.seq_lens = [int(t) for t in (args.seq_lens or ("64,128" if args.small else
                                                         "256,512,1024,2048,4096,8192,16384")).split(",")]
    return args


# ---------------------------------------------------------------------------- child process
def child(spec: dict) -> None:
    """One (shape, method): each T in order, one RESULT line per point (the parent reads them)."""
    set_threads(spec["threads"])
    import torch

    from specforge_k25.draft.dflash import plan
    from specforge_k25.draft.dflash import model as dflash_model
    from specforge_k25.draft.dflash.block_attention import dense_reference, make_tiling
    from specforge_k25.draft.dflash.model import DFlashAttention, DFlashConfig
    from specforge_k25.draft.layers import rope_cos_sin

    s = spec["shape"]
    cfg = DFlashConfig(hidden_size=s["hidden"], intermediate_size=1, num_hidden_layers=1, num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=8,
                       target_hidden_size=s["hidden"], block_size=s["block"], num_anchors=s["anchors"])
    torch.manual_seed(0)
    attn = DFlashAttention(cfg)
    if spec["method"] == "dense":  # the module looks block_attention up per call
        dflash_model.block_attention = (lambda q, k_c, v_c, k_b, v_b, prefix, scale, tiling:
                                        dense_reference(q, k_c, v_c, k_b, v_b, prefix, scale, tiling.block_size))
    Bk = cfg.block_size

    def inputs(T):
        anchors = torch.tensor(plan.planned_anchors(cfg, T))[None]  # [1, A]
        Q = anchors.shape[1] * Bk
        x = torch.randn(1, Q, cfg.hidden_size, requires_grad=True)  # [1, Q, H]
        ctx = torch.randn(1, T, cfg.hidden_size, requires_grad=True)  # [1, T, H]
        block_pos = (anchors[:, :, None] + torch.arange(Bk)).view(1, Q)
        rope_b = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, torch.float32)
        rope_c = rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta, torch.float32)
        return x, ctx, rope_b, rope_c, anchors, make_tiling(anchors, Bk, cfg.attention_tile_rows,
                                                           cfg.attention_tile_keys)

    def call(x, ctx, rope_b, rope_c, prefix, tiling):
        attn(x, ctx, rope_b, rope_c, prefix, tiling).sum().backward()

    call(*inputs(32))  # warm-up: parameter .grad tensors, kernels
    last = None
    for T in spec["seq_lens"]:
        if last is not None:
            growth = T / last["seq_len"]  # at most linear in T once A is at num_anchors
            if last["time_s"] * growth > spec["max_s"]:
                print("RESULT " + json.dumps({"seq_len": T, "status": "skipped",
                                              "why": f"predicted {last['time_s'] * growth:.0f} s"}), flush=True)
                continue
        times, peaks = [], []
        for _ in range(3 if T <= 2048 else 1):
            args = inputs(T)
            attn.zero_grad(set_to_none=False)
            gc.collect()
            rss_before = _status_kib("VmRSS") * 1024
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current resident set
            t0 = time.perf_counter()
            call(*args)
            times.append(time.perf_counter() - t0)
            peaks.append(_status_kib("VmHWM") * 1024 - rss_before)
            del args
        A = len(plan.planned_anchors(cfg, T))
        last = {"seq_len": T, "anchors": A, "queries": A * Bk, "status": "ok", "time_s": statistics.median(times),
                "times_s": times, "peak_delta": max(peaks)}
        print("RESULT " + json.dumps(last), flush=True)


def run_child(spec: dict) -> list[dict]:
    return run_child_points(__file__, spec, lambda row: f"T={row['seq_len']:6d} Q={row['queries']:5d}")


# ------------------------------------------------------------------------------------ report
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
    lines = ["One DFlash draft attention forward+backward (projections, norms, RoPE, attention) over the A "
             "blocks of one sequence, fp32, 1 thread (peak RSS delta, VmHWM; time in s).", "",
             "| shape | T | Q | new peak + | dense peak + | new s | dense s | dense / new memory | dense / new time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["shape"], r["method"], r["seq_len"]): r for r in rows}
    ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for T in sorted({r["seq_len"] for r in rows if r["shape"] == shape}):
            n, d = by.get((shape, "new", T)), by.get((shape, "dense", T))
            q = (n if ok(n) else d if ok(d) else {}).get("queries", "")
            cells = [shape, str(T), str(q),
                     fmt_bytes(n["peak_delta"]) if ok(n) else "-", fmt_bytes(d["peak_delta"]) if ok(d) else "skipped",
                     f"{n['time_s']:.2f}" if ok(n) else "-", f"{d['time_s']:.2f}" if ok(d) else "skipped",
                     f"{d['peak_delta'] / n['peak_delta']:.1f}x" if ok(n) and ok(d) and n["peak_delta"] > 0 else "",
                     f"{d['time_s'] / n['time_s']:.1f}x" if ok(n) and ok(d) and n["time_s"] > 0 else ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Exponents a of a T^a least-squares fit over T >= {result['slope_t_min']} (Q fixed at "
                  "8 x num_anchors there):", "",
              "| shape / attention | memory a | time a |", "|---|---:|---:|"]
    for name, s in result["exponents"].items():
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {name} | {fmt(s['memory_exponent'])} | {fmt(s['time_exponent'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(2, width=5.5)
    for ax, key, scale, ylabel in ((axes[0], "peak_delta", MiB, "peak RSS delta (MiB)"),
                                   (axes[1], "time_s", 1.0, "seconds")):
        for method, style in (("new", "o-"), ("dense", "s--")):
            sel = [r for r in result["rows"] if r["method"] == method and r["status"] == "ok"]
            ax.plot([r["seq_len"] for r in sel], [r[key] / scale for r in sel], style, label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].set_title("peak memory, DFlash attention fwd+bwd", fontsize=10)
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
            rows += run_child({"shape_name": name, "shape": shape, "method": method, "seq_lens": args.seq_lens,
                               "threads": args.threads, "max_s": args.max_s})
    t_min = min(1024, max(args.seq_lens))
    result = {
        "benchmark": "dflash_attention", "shapes": shapes, "rows": rows, "slope_t_min": t_min,
        "exponents": summarize(rows, t_min),
        "memory_method": ("peak RSS delta: /proc/self/status VmHWM after resetting it via /proc/self/clear_refs, "
                          "minus VmRSS before the call; one child process per (shape, attention), "
                          "MALLOC_MMAP_THRESHOLD_=1MiB, after a 32-token warm-up call"),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine_info(threads=args.threads), "total_wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)
    md = markdown(result)
    args.out.with_suffix(".md").write_text(md)
    print(f"wrote {args.out.with_suffix('.md')}")
    plot(result, args.out.with_suffix(".png"))
    print_table("DFlash attention fwd+bwd (peak RSS delta, s)", ["shape", "attention", "T", "Q", "peak +", "s"],
                [[r["shape"], r["method"], str(r["seq_len"]), str(r.get("queries", "")), fmt_bytes(r.get("peak_delta")),
                  f"{r['time_s']:.2f}" if r["status"] == "ok" else "skipped"] for r in rows])
    print(md)
    return result


if __name__ == "__main__":
    main()
