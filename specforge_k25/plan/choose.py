"""The plan's choices among candidates, built on plan/throughput.py and plan/pipeline.py (which
import neither this module nor each other back): the node's pipeline shapes, fastest first, and the
fastest whose memory fits (`best_pipeline`); and every draft method in the job's place
(`compare_methods`: memory, tokens/s of both trainer layouts and of its best pipeline shape).

Arithmetic only, as the modules it composes; nothing is measured here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..draft.registry import METHODS
from ..draft.spec import carried_over
from .budget import plan_memory
from .facts import PlanError, TargetFacts, draft_of, trainable_params
from .fit import longest_fitting_length
from .pipeline import PipelinePlan, first_stages_partition, predict_pipeline
from .throughput import predict_layouts


# ------------------------------------------------------------------------------ pipeline shapes
def pipeline_shapes(num_gpus: int) -> list[tuple[int, int, int]]:
    """(pp, tp, replicas) with pp >= 2 and pp x tp x replicas = the node's GPUs, powers of two."""
    out = []
    for pp in (2, 4, 8, 16):
        for tp in (1, 2, 4, 8):
            if pp * tp <= num_gpus and num_gpus % (pp * tp) == 0:
                out.append((pp, tp, num_gpus // (pp * tp)))
    return out


def predict_pipelines(job, facts: TargetFacts) -> list[PipelinePlan]:
    """Every (pp, tp, replicas) shape of the node (`pipeline_shapes`), fastest first; each with
    SGLang's default split, or the first-stages partition when only that one fits the memory."""
    plans = []
    for pp, tp, r in pipeline_shapes(job.hw.num_gpus):
        if pp > facts.num_layers:
            continue
        plan = predict_pipeline(job, facts, pp, tp, r)
        alt = first_stages_partition(facts.num_layers, pp)
        if plan.memory is not None and not plan.fits and alt is not None:
            other = predict_pipeline(job, facts, pp, tp, r, alt)
            plan = other if other.fits else plan
        plans.append(plan)
    return sorted(plans, key=lambda p: -p.throughput.tokens_per_s)


def best_pipeline(job, facts: TargetFacts, plans: list[PipelinePlan] | None = None) -> Optional[PipelinePlan]:
    """The fastest pipeline shape whose memory fits (on CUDA); when none fits, the one whose
    fullest GPU needs the least (marked by `fits`); None without a shape."""
    plans = predict_pipelines(job, facts) if plans is None else plans
    if job.hw.device != "cuda" or not plans:
        return plans[0] if plans else None
    fitting = [p for p in plans if p.fits]
    return fitting[0] if fitting else min(plans, key=lambda p: max(g.total() for g in p.memory))


# -------------------------------------------------------------------------------- draft methods

@dataclass
class MethodRow:
    """One draft method on the job's target, hw profile and settings (`compare_methods`)."""

    method: str
    describe: str = ""
    trainable_params: int = 0
    trainer_flops_per_token: float = 0.0  # draft_step_flops total / tokens, at data.max_length
    peak_bytes: int = 0  # the fullest GPU's peak (hw.trainer_layout), at data.max_length
    capacity_bytes: int = 0
    fits: bool = False  # memory only (MemoryPlan.capacity_ok)
    longest_length: Optional[int] = None  # longest data.max_length that fits (multiple of 256)
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # per layout, at data.max_length
    pipeline: str = ""  # the fastest pipeline shape whose memory fits (plan/pipeline.py; predicted)
    pipeline_tokens_per_s: Optional[float] = None
    pipeline_fits: bool = False  # its memory fits (always true off CUDA: not checked)
    refused: str = ""  # the method cannot run this job (its reason); the numbers are then unset


def compare_methods(job, facts: TargetFacts, names: list[str] | None = None) -> list[MethodRow]:
    """Every registered draft method (or `names`) in the job's place: its config with every field it
    shares with job.draft kept (sizes, vocab, TTT knobs), the rest at its defaults; all other settings kept."""
    rows = []
    for name in names or list(METHODS):
        variant = replace(job, draft=carried_over(job.draft, METHODS[name].spec_class))
        row = MethodRow(name)
        try:
            method, cfg = draft_of(variant, facts)
        except PlanError as err:
            row.refused = str(err)
            rows.append(row)
            continue
        B, L = job.train.batch_size, job.data.max_length
        row.describe = method.describe(cfg)
        row.trainable_params = trainable_params(cfg, method)
        flops = method.plan.draft_step_flops(cfg, B, L, method.depth(variant.draft, cfg),
                                             job.train.activation_checkpointing)
        row.trainer_flops_per_token = flops["total"] / (B * L)
        plan = plan_memory(variant, facts)
        fullest = max(plan.gpus, key=lambda g: g.total())
        row.peak_bytes, row.capacity_bytes, row.fits = fullest.total(), fullest.capacity, plan.capacity_ok
        if job.hw.device == "cuda":
            row.longest_length = longest_fitting_length(variant, facts)
        try:
            row.tokens_per_s = {layout: t.tokens_per_s for layout, t in predict_layouts(variant, facts).items()}
            best = best_pipeline(variant, facts)
            if best is not None:
                row.pipeline, row.pipeline_tokens_per_s = best.name, best.throughput.tokens_per_s
                row.pipeline_fits = best.fits or best.memory is None
        except PlanError:
            pass  # no throughput inputs in this hw profile
        rows.append(row)
    return rows
