"""Will this head pay on my node? The predicted decode speedup of a draft head per concurrency and
context on a hw profile, and the serving settings that get it (docs/PERFORMANCE.md §9).

- cost.py: one target decode / verify step and the draft's work per step (weights, distinct
  experts, KV, FLOPs, all-reduces), constants from the hw profile;
- predict.py: acceptance length per setting, speedups, the best setting per concurrency;
- sources.py: the head's per-position acceptance (run / eval / export folder), the served draft's
  shape, the routing (measured during training, target_engine/routing.py, or the uniform prior);
- commands.py: SGLang flags, vLLM speculative_config and its per-batch-size schedule;
- report.py: table, plot, JSON, the short form train / eval print.
`python -m specforge_k25.serving` prints it; `predict_job(job)` returns it as a dict.
"""
from __future__ import annotations

from .cost import Node, ServingError
from .predict import acceptance_length, best_per_concurrency, per_position_from_ratio, predict_all, settings_for


def predict_job(job, acceptance_rates: list[float] | None = None, run: str | None = None,
                command_args: str = "") -> dict:
    """The whole prediction of a composed serving job (ServingJobConfig, or a JobConfig with the
    defaults of serving.*): acceptance from `acceptance_rates` / `run` / job.serving."""
    from ..plan.facts import target_facts_for, with_hw_overrides
    from .commands import serving_commands
    from .config import ServingConfig
    from .report import as_dicts
    from .sources import Acceptance, acceptance_of_folder, draft_shape, routing_for, served_method

    sv = getattr(job, "serving", None) or ServingConfig()
    run = run or sv.run
    acc = acceptance_of_folder(run) if run else None
    rates = acceptance_rates if acceptance_rates is not None else (list(sv.acceptance) if sv.acceptance else None)
    if rates is not None:
        acc = Acceptance([float(a) for a in rates], acc.method if acc else None, "serving.acceptance",
                         acc.target if acc else None, acc.folder if acc else None)
    if acc is None:
        raise ServingError("no acceptance: give serving.run=<run, eval or export folder> or serving.acceptance=[a_1,...]")
    node = Node.of(job.hw)
    facts = with_hw_overrides(job.hw, target_facts_for(job.target))
    method = served_method(sv.method, acc, job.draft)
    settings = settings_for(method, list(sv.depths))
    routing, routing_note = routing_for(sv.routing, facts, acc, job.target.name)
    preds = predict_all(facts, node, routing, settings, draft_shape(job, facts, method), acc.rates,
                        [int(c) for c in sv.concurrency], [int(c) for c in sv.context])
    best = {ctx: best_per_concurrency(preds, ctx) for ctx in sv.context}
    notes = [f"acceptance per position {', '.join(f'{a:.3f}' for a in acc.rates)} from {acc.source}"
             + (f"; positions past {len(acc.rates)} repeat the last rate" if max(sv.depths) > len(acc.rates) else ""),
             f"routing: {routing_note}; constants: hw.allreduce_latency_us={node.allreduce_latency_us}, "
             f"hw.decode_memory_efficiency={node.memory_efficiency}, hw.target_efficiency={node.compute_efficiency} "
             f"(docs/PERFORMANCE.md §9)"]
    if acc.target and acc.target != job.target.name:
        notes.append(f"the head was measured behind {acc.target}; its acceptance is taken as it would be behind "
                     f"{job.target.name}")
    first = sv.context[0]
    return {"hw": job.hw.name, "tp": node.tp, "target": job.target.name, "method": method,
            "acceptance": acc.rates, "acceptance_source": acc.source, "routing": routing_note,
            "contexts": list(sv.context), "concurrency": list(sv.concurrency),
            "predictions": as_dicts(preds),
            "best": {str(ctx): {str(c): (p.as_dict() if p else None) for c, p in b.items()} for ctx, b in best.items()},
            "commands": serving_commands(settings, best[first]), "notes": notes, "command_args": command_args}


__all__ = ["Node", "ServingError", "acceptance_length", "best_per_concurrency", "per_position_from_ratio",
           "predict_all", "predict_job", "settings_for"]
