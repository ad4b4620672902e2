"""Padding share of the trainer's micro-batches, with and without `train.group_by_length`.

The trainer pads each rank's micro-batch to its longest sequence (train/learner.py); the target
prefills packed tokens, so padding costs the trainer only (plan/throughput.py `predict`'s
`padding_share`). This script tokenizes the run's data exactly as `python -m specforge_k25.train`
does (the same Hydra overrides) and builds the run's schedule at several batch sizes, once in
shuffled order and once grouped by length (train/schedule.py): the share of padded positions
(`padding_share`, what the run plan prints and summary.json counts in the loop) per cell.

    python benchmarks/padding.py                                   # the CPU default's data at max_length 256, 4096
    python benchmarks/padding.py --lengths 256 --batches 2 --small # a 40-sample smoke run
"""
from __future__ import annotations

import argparse
from pathlib import Path

from _common import RESULTS, machine_info, new_figure, print_table, save_figure, write_json

DEFAULT_OUT = RESULTS / "padding.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", default="256,4096", help="data.max_length values")
    p.add_argument("--batches", default="2,4,8", help="train.batch_size values")
    p.add_argument("--small", action="store_true", help="data.num_samples=40 (smoke test)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result (the PNG goes beside it)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides as for specforge_k25.train")
    return p.parse_args(argv)


def measure(overrides: list[str], batches: list[int]) -> dict:
    from specforge_k25.config import compose_job
    from specforge_k25.setup.run import prepare
    from specforge_k25.train.schedule import build_schedule, padding_share

    job = compose_job(overrides)
    setup = prepare(job)
    lengths = [len(s.input_ids) for s in setup.data.train]
    tr = job.train
    rows = []
    for B in batches:
        share = {}
        for grouped in (False, True):
            schedule, _ = build_schedule(len(lengths), len(setup.data.heldout), batch_size=B, grad_accum=1,
                                         epochs=tr.epochs, max_steps=None, eval_every=None, seed=tr.seed,
                                         lengths=lengths if grouped else None)
            share["grouped" if grouped else "shuffled"] = padding_share(schedule, lengths, B)
        rows.append({"batch_size": B, **share})
    return {"max_length": job.data.max_length, "samples": len(lengths),
            "mean_length": sum(lengths) / len(lengths), "longest": max(lengths), "rows": rows}


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(ncols=len(result["points"]))
    for ax, point in zip(axes, result["points"]):
        B = [r["batch_size"] for r in point["rows"]]
        for key in ("shuffled", "grouped"):
            ax.plot(B, [100 * r[key] for r in point["rows"]], marker="o", label=key)
        ax.set_title(f"max_length {point['max_length']} (mean {point['mean_length']:.0f})")
        ax.set_xlabel("train.batch_size")
        ax.set_ylabel("padded positions (%)")
        ax.legend()
    save_figure(fig, path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    extra = ["data.num_samples=40", "data.heldout_samples=4"] if args.small else []
    points = [measure([*args.overrides, *extra, f"data.max_length={L}"], batches)
              for L in (int(x) for x in args.lengths.split(","))]
    print_table("padding share of the trainer's micro-batches (train/schedule.py padding_share)",
                ["max_length", "samples", "mean length", "batch", "shuffled", "grouped by length"],
                [[str(p["max_length"]), str(p["samples"]), f"{p['mean_length']:.0f}", str(r["batch_size"]),
                  f"{r['shuffled']:.1%}", f"{r['grouped']:.1%}"] for p in points for r in p["rows"]])
    result = {"points": points, "overrides": args.overrides, "machine": machine_info()}
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
