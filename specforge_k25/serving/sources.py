"""Where a prediction's inputs come from: the head's per-position acceptance (a run, eval or export
folder), the served draft's shape (its config, sized for the target) and the routing (measured
in the run folder, or the uniform prior)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..draft.registry import get_method, method_of_export, method_of_spec
from ..plan.facts import TargetFacts, draft_param_counts, num_capture_points, resolve_draft
from ..target_engine.routing import RoutingCounts, load_counts
from .cost import DraftShape, ServingError, uniform_distinct
from .predict import NGRAM


@dataclass
class Acceptance:
    rates: list[float]  # a_1..a_k
    method: str | None  # the head's draft method (registry name), None when not known
    source: str  # where the rates were read, for the output
    target: str | None = None  # the run's target name
    folder: Path | None = None  # the run folder (its routing counts)


def _summary_rates(summary: dict) -> list[float]:
    end = (summary.get("eval") or {}).get("end") or {}
    return [float(end[f"acc_{k}"]) for k in range(sum(1 for key in end if key.startswith("acc_")))]


def acceptance_of_folder(folder: str | Path) -> Acceptance:
    """A train run folder (summary.json: the end-of-run held-out acc_0.., teacher-forced per
    position, what tau_sim is computed from); an eval folder (eval.json: the trained head's replayed
    acceptance per position on the greedy outputs of every prompt, its longest setting); an export
    folder (its run's summary.json, one level up)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ServingError(f"serving.run={folder}: no such folder")
    method = None
    if (folder / "config.json").is_file() and not (folder / "summary.json").is_file():  # an export folder
        try:
            method = method_of_export(folder).name
        except ValueError:
            pass
        folder = folder.parent
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
        rates = _summary_rates(summary)
        if not rates:
            raise ServingError(f"{folder}/summary.json has no end-of-run held-out acceptance (eval.end.acc_*)")
        if method is None and (folder / "export" / "config.json").is_file():
            try:
                method = method_of_export(folder / "export").name
            except ValueError:
                pass
        return Acceptance(rates, method, f"{folder}/summary.json eval.end acc_0..{len(rates) - 1} (held-out)",
                          summary.get("target"), folder)
    if (folder / "eval.json").is_file():
        ev = json.loads((folder / "eval.json").read_text())
        rows = [r for r in ev.get("rows", []) if r.get("method") == "trained" and r.get("prompt_set") == "all"
                and r.get("acc")]
        if not rows:
            raise ServingError(f"{folder}/eval.json has no replayed acceptance of a trained head (rows 'acc')")
        row = max(rows, key=lambda r: len(r["acc"]))
        method = ((ev.get("heads") or {}).get("trained") or {}).get("method")
        return Acceptance([float(a) for a in row["acc"]], method,
                          f"{folder}/eval.json trained {row['chain']} replayed acc (all prompts)", None, None)
    raise ServingError(f"serving.run={folder}: neither a run folder (summary.json), an eval folder (eval.json) "
                       f"nor an export folder")


def served_method(requested: str | None, acceptance: Acceptance | None, draft) -> str:
    """serving.method, else the head's own method, else the method of the `draft` profile."""
    if requested:
        return requested
    if acceptance is not None and acceptance.method:
        return acceptance.method
    return method_of_spec(draft).name


def draft_shape(job, facts: TargetFacts, method: str) -> DraftShape | None:
    """The served draft's weights per forward, layers and KV per token: job.draft when it is of
    that method (e.g. draft=kimi, draft=kimi_dflash), else the method's defaults sized for the target."""
    if method == NGRAM:
        return None
    spec, points = job.draft, None  # None: the method's default capture points (plan/facts.py)
    if method_of_spec(spec).name == method:
        points = num_capture_points(job, facts)  # the run's: target.aux_layers, else the method's default
    else:
        spec = get_method(method).spec_class()
    cfg = resolve_draft(spec, facts, points)
    counts = draft_param_counts(cfg)
    params = sum(n for name, n in counts.items() if name != "embed_tokens (frozen)")  # the embedding is a lookup
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    if getattr(cfg, "kv_lora_rank", None):
        kv = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    else:
        kv = 2 * layers * cfg.num_key_value_heads * cfg.head_dim * 2
    return DraftShape(params, layers, kv, cfg.hidden_size)


def routing_for(choice: str, facts: TargetFacts, acceptance: Acceptance | None, target_name: str):
    """(routing function, description): the run's measured counts when asked (auto) and they are of
    the predicted target, else the uniform prior."""
    if choice not in ("auto", "uniform"):
        raise ServingError(f"serving.routing={choice!r}: expected auto | uniform")
    counts = load_counts(acceptance.folder) if (choice == "auto" and acceptance and acceptance.folder) else None
    if counts is not None and counts.tokens == 0:
        counts = None  # a run whose routing SGLang never reported (routing.json: skipped_batches)
    if counts is not None and acceptance.target == target_name:
        return measured(counts, facts), f"measured in {acceptance.folder} ({counts.tokens} tokens)"
    why = ""
    if counts is not None:
        why = f" (the run's routing is {acceptance.target}'s, not {target_name}'s)"
    return (lambda window, c: uniform_distinct(facts, window, c)), f"uniform top-{facts.num_experts_per_tok} prior{why}"


def measured(counts: RoutingCounts, facts: TargetFacts):
    """Distinct experts summed over MoE layers from measured counts; windows longer than counted
    are refused rather than extrapolated."""
    def distinct(window: int, concurrency: int) -> float:
        if window > counts.max_window:
            raise ServingError(f"routing counted windows up to {counts.max_window} tokens, a setting needs {window}")
        return float(counts.expected_distinct(window, concurrency).sum())
    return distinct
