"""How the serving prediction (python -m specforge_k25.serving) moves with the assumptions that
matter: each constant varied alone on both GPU profiles, for a Kimi-shaped EAGLE-3 head at 3/1/4
and the users' prompt lookup (5 drafted, 17 % and 31 % of them accepted). Prints a markdown table
(docs/PERFORMANCE.md §9); predicts, measures nothing.

    python benchmarks/serving_sensitivity.py
"""
from __future__ import annotations

import sys
from dataclasses import replace

from specforge_k25.plan import KIMI_K25
from specforge_k25.serving import per_position_from_ratio
from specforge_k25.serving.at_end import profile_hw
from specforge_k25.serving.cost import Node, uniform_distinct
from specforge_k25.serving.predict import predict_one, settings_for

KIMI_HEAD = [0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45]  # AL 2.72 at 3/1/4 (public Kimi heads: MT-bench 2.69-2.94)
CONTEXT = 4096


def draft_shape():
    from specforge_k25.config import compose_job
    from specforge_k25.serving.sources import draft_shape as shape_of

    return shape_of(compose_job(["target=kimi_k25", "draft=kimi"]), KIMI_K25, "eagle3")


def routing(locality: float):
    """Distinct experts with a share `locality` of a window's later tokens repeating experts already
    drawn in it: its m tokens draw like 1 + (1 - locality)(m - 1) independent ones (0: uniform)."""
    return lambda m, c: uniform_distinct(KIMI_K25, 1 + (1 - locality) * (m - 1), c)


def row(node: Node, shape, locality: float = 0.0, facts=KIMI_K25) -> list[float]:
    chain, ngram = settings_for("eagle3", [3])[0], settings_for("ngram", [5])[0]
    r = routing(locality)
    out = [predict_one(facts, node, r, chain, shape, KIMI_HEAD, c, CONTEXT).speedup for c in (1, 8, 64)]
    out += [predict_one(facts, node, r, ngram, None, per_position_from_ratio(x, 5), 8, CONTEXT).speedup
            for x in (0.17, 0.31)]
    return out


def main(argv: list[str]) -> int:
    shape = draft_shape()
    print("| profile | varied | EAGLE-3 3/1/4 C=1 | C=8 | C=64 | n-gram 17 % C=8 | n-gram 31 % C=8 |")
    print("|---|---|---|---|---|---|---|")
    for name in ("rtxpro6000x8", "b300x8"):
        node = Node.of(profile_hw(name))
        cases = [("as profiled", node, 0.0)]
        cases += [(f"all-reduce latency {f:g}x ({node.allreduce_latency_us * f:.1f} us)",
                   replace(node, allreduce_latency_us=node.allreduce_latency_us * f), 0.0) for f in (0.5, 2.0)]
        cases += [(f"memory efficiency {x}", replace(node, memory_efficiency=x), 0.0) for x in (0.5, 0.9)]
        cases += [(f"compute efficiency {x}", replace(node, compute_efficiency=x), 0.0) for x in (0.2, 0.6)]
        cases += [(f"link {x:g} GB/s", replace(node, link_gbps=x), 0.0) for x in (node.link_gbps / 2, node.link_gbps * 2)]
        cases += [("routing locality 0.5", node, 0.5)]
        for label, n, loc in cases:
            print(f"| {name} | {label} | " + " | ".join(f"{x:.2f}" for x in row(n, shape, loc)) + " |")
    dense = replace(KIMI_K25, n_routed_experts=0, num_moe_layers=0, weight_bytes=KIMI_K25.weight_bytes)
    node = Node.of(profile_hw("rtxpro6000x8"))
    print(f"| rtxpro6000x8 | no MoE term (experts priced as a dense target) | "
          + " | ".join(f"{x:.2f}" for x in row(node, shape, 0.0, dense)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
