"""Pipeline-parallel target on CPU: do the stages overlap? The same batches streamed through TP1
(one process, one core) and PP2 x TP1 (two stage processes, one core each), optionally TP2.

Each configuration starts a `TargetStream` (stream/target_stream.py) over the same N batches of
random token sequences (seeded; SmolLM2, SGLang's default capture points), with `num_threads`
intra-op threads per target process (default 1). The consumer does nothing but release each
message at once (the first batch's states are cloned for the check below).

Clock: from the arrival of batch 0 to the arrival of batch N-1 (engine start-up, weight loading and
warm-up precede batch 0 and are reported apart as `first_batch_s`); batches/s = (N-1) / that time,
tokens/s = tokens of batches 1..N-1 / that time. With PP2, stage 0 starts on batch 1 while stage 1
runs batch 0, so in steady state it is about one batch ahead when the clock starts; this bias is at
most one stage-0 forward and shrinks as N grows (24 by default). Stages that overlap (stage s
forwards batch i while stage s+1 forwards batch i-1) give PP2 / TP1 near 2 on two free cores;
stages that take turns give about 1 (each does half the layers, one at a time) or less (the
proxies' send/recv cost).

Correctness: each configuration's first batch (aux [N, K*H] and final [N, H]) is compared with
TP1's; the max |diff| and the worst |diff| / (1e-4 * max(1, |ref|)) are printed (<= --tol is
agreement, as in tests/target_engine/test_target_pp.py). A configuration that disagrees is marked
INVALID, its ratio is not reported as a speed-up, and the script exits 1 (after writing the JSON).

    .venv/bin/python benchmarks/pipeline_stream.py                        # TP1, PP2 (24 x 4 x 256)
    .venv/bin/python benchmarks/pipeline_stream.py --configs tp1,pp2,tp2  # and TP2
    .venv/bin/python benchmarks/pipeline_stream.py --quick                # 4 x 2 x 64 (smoke run)

Run it on an otherwise idle machine with at least pp_size * num_threads free cores.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from _common import RESULTS, machine_info, print_table, set_threads, write_json

DEFAULT_OUT = RESULTS / "pipeline_stream.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 batches of 2 x 64 tokens (smoke run)")
    p.add_argument("--batches", type=int, default=None, help="batches streamed (default 24; --quick 4)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default 4; --quick 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; --quick 64)")
    p.add_argument("--configs", default="tp1,pp2", help="comma-separated layouts: tpT, ppP or ppPtpT (tp1 is "
                                                        "always run first: the reference)")
    p.add_argument("--num-threads", type=int, default=1, help="intra-op threads of each target process")
    p.add_argument("--prefill-chunk", type=int, default=None, help="tokens per target forward (None: one forward)")
    p.add_argument("--slots", type=int, default=3, help="stream ring slots")
    p.add_argument("--mem-fraction-static", type=float, default=0.05, help="SGLang KV pool's share of memory")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="SGLang KV pool cap (tokens)")
    p.add_argument("--tol", type=float, default=1.0, help="states agree when max |diff| / (1e-4 * max(1, |ref|)) "
                                                          "is at most this")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--timeout-s", type=float, default=600.0, help="stream timeout between batches")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    args = p.parse_args(argv)
    q = args.quick
    args.batches = args.batches or (4 if q else 24)
    args.batch_size = args.batch_size or (2 if q else 4)
    args.seq_len = args.seq_len or (64 if q else 256)
    if args.batches < 2:
        p.error("--batches must be >= 2 (the clock runs from batch 0 to the last)")
    names = [c.strip().lower() for c in args.configs.split(",") if c.strip()]
    layouts = {}
    for name in ["tp1", *names]:
        m = re.fullmatch(r"(?:pp(\d+))?(?:tp(\d+))?", name)
        if not m or not (m.group(1) or m.group(2)):
            p.error(f"--configs: {name!r} is not tpT, ppP or ppPtpT")
        pp, tp = int(m.group(1) or 1), int(m.group(2) or 1)
        label = "TP1" if (pp, tp) == (1, 1) else (f"PP{pp}" + (f" x TP{tp}" if tp > 1 else "") if pp > 1
                                                    else f"TP{tp}")
        layouts.setdefault((pp, tp), label)
    args.layouts = [(label, pp, tp) for (pp, tp), label in layouts.items()]
    return args


def sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def run_layout(label: str, pp: int, tp: int, args, model_path: str, info, points, seqs, plan) -> tuple:
    """Stream the plan through one layout; the arrival times and the first batch's states."""
    from specforge_k25.stream.target_stream import TargetStream
    from specforge_k25.target_engine.factory import TargetSpec

    spec = TargetSpec(engine="sglang", model_path=model_path, architecture=info.architecture, capture_points=points,
                      pp_size=pp, tp_size=tp, num_threads=args.num_threads, prefill_chunk=args.prefill_chunk,
                      mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens)
    print(f"{label}: starting {pp * tp} target process(es), {args.num_threads} thread(s) each ...", flush=True)
    arrivals, tokens, first = [], [], None
    t_start = time.perf_counter()
    with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=args.slots,
                      timeout_s=args.timeout_s) as stream:
        for msg, aux, final in stream:
            arrivals.append(time.perf_counter())  # before anything else the consumer does
            tokens.append(int(sum(msg.lengths)))
            if first is None:
                first = (list(msg.lengths), aux.clone(), final.clone())
            stream.release(msg)
        wait_s = stream.wait_s
    elapsed = arrivals[-1] - arrivals[0]
    n = len(arrivals) - 1
    row = {
        "layout": label, "pp_size": pp, "tp_size": tp, "processes": pp * tp, "num_threads": args.num_threads,
        "batches": len(arrivals), "first_batch_s": arrivals[0] - t_start, "elapsed_s": elapsed,
        "timed_batches": n, "timed_tokens": sum(tokens[1:]),
        "batches_per_s": n / elapsed if elapsed > 0 else float("nan"),
        "tokens_per_s": sum(tokens[1:]) / elapsed if elapsed > 0 else float("nan"),
        "intervals_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "consumer_wait_s": wait_s, "total_s": time.perf_counter() - t_start,
    }
    print(f"{label}: first batch after {row['first_batch_s']:.1f} s; {n} batches in {elapsed:.2f} s "
          f"({row['batches_per_s']:.2f} batches/s, {row['tokens_per_s']:.0f} tokens/s)", flush=True)
    return row, first


def compare(first, ref) -> dict:
    """max |diff| and the scaled worst (as test_target_pp._worst) of aux and final against TP1's."""
    lengths, aux, final = first
    r_lengths, r_aux, r_final = ref
    if lengths != r_lengths or aux.shape != r_aux.shape or final.shape != r_final.shape:
        return {"same_shape": False, "max_abs_diff": float("inf"), "worst_scaled": float("inf")}
    diffs = [(a - r).abs() for a, r in ((aux, r_aux), (final, r_final))]
    scaled = [(d / (1e-4 * r.abs().clamp(min=1.0))).max().item() for d, r in zip(diffs, (r_aux, r_final))]
    return {"same_shape": True, "max_abs_diff": max(d.max().item() for d in diffs),
            "max_abs_diff_aux": diffs[0].max().item(), "max_abs_diff_final": diffs[1].max().item(),
            "worst_scaled": max(scaled), "ref_max_abs": max(r_aux.abs().max().item(), r_final.abs().max().item())}


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(1)  # the consumer; OMP_NUM_THREADS=1 is inherited by the target processes
    import torch

    from specforge_k25.target_engine.hf_config import read_target_info
    from specforge_k25.target_engine.layers import default_capture_points
    from specforge_k25.target_engine.models import smollm2_path

    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    model_path = str(smollm2_path())
    info = read_target_info(model_path)
    points = default_capture_points(info.num_layers)
    g = torch.Generator().manual_seed(args.seed)
    n_seqs = args.batches * args.batch_size
    seqs = [torch.randint(3, info.vocab_size, (args.seq_len,), generator=g) for _ in range(n_seqs)]
    plan = [list(range(b * args.batch_size, (b + 1) * args.batch_size)) for b in range(args.batches)]
    print(f"SmolLM2 ({info.num_layers} layers, H {info.hidden_size}), capture points {points}; "
          f"{args.batches} batches of {args.batch_size} x {args.seq_len} tokens; os.cpu_count()={os.cpu_count()}, "
          f"load {load_at_start}", flush=True)

    rows, ref = [], None
    for label, pp, tp in args.layouts:
        row, first = run_layout(label, pp, tp, args, model_path, info, points, seqs, plan)
        if ref is None:
            ref = first
        row["check_vs_tp1"] = compare(first, ref)
        row["valid"] = row["check_vs_tp1"]["worst_scaled"] <= args.tol
        c = row["check_vs_tp1"]
        print(f"{label}: batch 0 vs TP1: max |diff| {c['max_abs_diff']:.3e} (scaled worst {c['worst_scaled']:.3f}, "
              f"tol {args.tol}) -> {'ok' if row['valid'] else 'INVALID'}", flush=True)
        rows.append(row)

    base = rows[0]
    for row in rows:
        ok = row["valid"] and base["batches_per_s"] > 0
        row["ratio_vs_tp1"] = row["batches_per_s"] / base["batches_per_s"] if ok else None
    torch_threads = torch.get_num_threads()
    result = {
        "benchmark": "pipeline_stream", "target": "smollm2", "model_path": model_path,
        "num_layers": info.num_layers, "hidden_size": info.hidden_size, "capture_points": points,
        "batches": args.batches, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "clock": "arrival of batch 0 to arrival of batch N-1 (consumer side); rates over batches 1..N-1",
        "rows": rows,
        "ratios": {f"{r['layout']}/TP1": r["ratio_vs_tp1"] for r in rows[1:]},
        "all_valid": all(r["valid"] for r in rows),
        "args": {k: v for k, v in vars(args).items() if k != "layouts"},
        "machine": machine_info(os_cpu_count=os.cpu_count(), torch_threads_consumer=torch_threads,
                                target_num_threads=args.num_threads, sglang=sglang_version(),
                                load_avg_at_start=load_at_start),
        "total_wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    print_table(f"Target stream, {args.batches} batches of {args.batch_size} x {args.seq_len} tokens, "
                f"{args.num_threads} thread(s) per process (os.cpu_count()={os.cpu_count()}, "
                f"sglang {sglang_version()})",
                ["layout", "processes", "first batch s", f"{base['timed_batches']} batches s", "batches/s",
                 "tokens/s", "vs TP1", "batch 0 max |diff|", "check"],
                [[r["layout"], str(r["processes"]), f"{r['first_batch_s']:.1f}", f"{r['elapsed_s']:.2f}",
                  f"{r['batches_per_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                  fmt(r["ratio_vs_tp1"], ".2f") + ("x" if r["ratio_vs_tp1"] is not None else ""),
                  f"{r['check_vs_tp1']['max_abs_diff']:.2e}", "ok" if r["valid"] else "INVALID"] for r in rows])
    for r in rows[1:]:
        if r["ratio_vs_tp1"] is None:
            print(f"{r['layout']}/TP1: not reported: its states differ from TP1's (INVALID run)")
        else:
            print(f"{r['layout']}/TP1 = {r['ratio_vs_tp1']:.2f} (batches/s; stages that overlap -> near "
                  f"{r['processes']} on {r['processes']} free cores, stages taking turns -> about 1)")
    return 0 if result["all_valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
