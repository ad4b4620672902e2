"""Host AdamW: nanoseconds per parameter of one optimizer step over fp32 tensors in host memory,
torch's default per-tensor loop vs foreach vs the fused CPU kernel (what train/optim.py's HostAdamW
and OffloadedAdamW run), on 1 and N intra-op threads.

A co-located rank with train.optimizer_device=cpu steps AdamW over its FSDP2 shard in host memory
(docs/PERFORMANCE.md §3.1); the throughput plan (plan/throughput.py) charges the fused 1-thread
figure divided by the rank's threads (hw.host_threads_per_rank). The shard is split into tensors
of `--tensor-mib` like a draft's weight matrices; the first step (m/v allocated) is not timed.
The figure is the fastest of `--steps` steps (the median is in the JSON): on a shared machine the
other processes only ever add time.

    python benchmarks/host_adamw.py                         # 32M params (512 MiB of p/g/m/v), 1 and all cores
    python benchmarks/host_adamw.py --params 2e6 --steps 2  # a smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _common import RESULTS, machine_info, print_table, write_json

DEFAULT_OUT = RESULTS / "host_adamw.json"
MODES = ("loop", "foreach", "fused")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=float, default=2 ** 25, help="parameters in the shard")
    p.add_argument("--tensor-mib", type=float, default=16.0, help="size of one fp32 tensor of the shard")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and this machine's cores)")
    p.add_argument("--modes", default=",".join(MODES), help="AdamW implementations: loop | foreach | fused")
    p.add_argument("--steps", type=int, default=7, help="timed steps per cell (the fastest is reported)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    return p.parse_args(argv)


def shard(params: int, tensor_mib: float):
    """fp32 parameters (with gradients) summing to `params`, each at most tensor_mib."""
    import torch

    per = max(1, int(tensor_mib * 2 ** 20 / 4))
    sizes = [per] * (params // per) + ([params % per] if params % per else [])
    g = torch.Generator().manual_seed(0)
    out = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g)
        out.append(p)
    return out


def time_step(params, mode: str, threads: int, steps: int) -> tuple[float, float]:
    """(fastest, median) seconds of one AdamW step of `mode` on `threads` threads (after one untimed step)."""
    import torch

    kw = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[mode]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8, **kw)
    torch.set_num_threads(threads)
    opt.step()  # m and v allocated
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    del opt
    return min(times), statistics.median(times)


def measure(params: int, tensor_mib: float, threads: list[int], modes: list[str], steps: int) -> dict:
    shard_params = shard(params, tensor_mib)
    rows = []
    for mode in modes:
        for n in threads:
            s, median = time_step(shard_params, mode, n, steps)
            rows.append({"mode": mode, "threads": n, "step_s": s, "median_step_s": median, "ns_per_param": s / params * 1e9})
    fused1 = next((r["ns_per_param"] for r in rows if r["mode"] == "fused" and r["threads"] == 1), None)
    for r in rows:
        r["ns_per_param_thread"] = r["ns_per_param"] * r["threads"]  # the per-thread model's constant
        r["vs_fused_1_thread"] = r["ns_per_param"] / fused1 if fused1 else None
    return {"params": params, "tensors": len(shard_params), "tensor_mib": tensor_mib, "steps": steps, "rows": rows}


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; expected {', '.join(MODES)}")
    before = torch.get_num_threads()
    try:
        result = measure(int(args.params), args.tensor_mib, threads, modes, args.steps)
    finally:
        torch.set_num_threads(before)
    result["machine"] = machine_info()
    print_table(f"host AdamW step, {result['params'] / 1e6:.1f}M fp32 params in {result['tensors']} tensors "
                f"(fastest of {args.steps})", ["implementation", "threads", "step (s)", "ns/param", "ns/param x threads"],
                [[r["mode"], r["threads"], f"{r['step_s']:.4f}", f"{r['ns_per_param']:.3f}",
                  f"{r['ns_per_param_thread']:.3f}"] for r in result["rows"]])
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
