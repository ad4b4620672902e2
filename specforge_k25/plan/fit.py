"""The fit search on the memory plan (plan/budget.py): the longest data.max_length that fits and
what binds it, the one override that makes a run fit, and `check_fits`, which refuses a run that
does not with that override named."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .budget import MemoryPlan, node_layout, optimizer_device, plan_memory
from .facts import PlanError, TargetFacts, draft_of, target_facts_for, with_hw_overrides
from .kernels import kernel_problems
from .memory import gib


def fits_with(job, facts, **kw) -> bool:
    """Whether the memory plan fits with the keyword arguments in place of the job's values."""
    return plan_memory(job, facts, **kw).capacity_ok


def largest_fitting(fits, upper: int, step: int = 256) -> Optional[int]:
    """The largest multiple of `step` below `upper` for which `fits(value)` holds (memory grows
    with the value: bisect), or None."""
    best, lo, hi = None, 1, (upper - 1) // step
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid * step):
            best, lo = mid * step, mid + 1
        else:
            hi = mid - 1
    return best


def longest_fitting_length(job, facts: TargetFacts) -> Optional[int]:
    """The longest data.max_length (a multiple of 256, up to the target's context) whose memory fits
    with the job's other settings, the KV pool grown to hold the batch; None when none does."""
    return largest_fitting(lambda length: fits_with(job, facts, max_length=length), facts.max_position_embeddings + 1)


def length_binding(job, facts: TargetFacts, longest: Optional[int]) -> str:
    """What stops data.max_length at `longest` (longest_fitting_length): the target's context, or
    the GPU that overflows one step (256) longer and the items on it that grow with the length,
    largest first, with their size there."""
    if longest is not None and longest + 256 > facts.max_position_embeddings:
        return f"the target's context ({facts.max_position_embeddings}) binds"
    over = (longest or 0) + 256
    short, long_ = plan_memory(job, facts, max_length=over - 256 or 1), plan_memory(job, facts, max_length=over)
    full = [g for g in long_.gpus if g.total() > g.capacity]
    if not full:
        problem = next(iter(long_.problems), "")
        return f"at {over}: {problem}" if problem else ""
    gpu = max(full, key=lambda g: g.total() - g.capacity)
    before = next((g for g in short.gpus if g.gpu == gpu.gpu), None)
    # items that grow with the length, taken where they count: resident, or the GPU's largest phase
    peak = gpu.peak_phase()
    counted = [i for i in gpu.items if i.phase in (None, peak)]
    growth = sorted(((i.bytes - (before.get(i.name) if before else 0), i) for i in counted), key=lambda x: -x[1].bytes)
    grows = [f"{i.name} {gib(i.bytes)}" for d, i in growth if d > 0][:3]
    return (f"at {over}: GPU {gpu.gpu} ({gpu.role}) needs {gib(gpu.total())} of {gib(gpu.capacity)}; growing with "
            f"the length: {'; '.join(grows)}")


def suggest_override(job, facts: TargetFacts) -> Optional[str]:
    """One override (or one pair) that makes the plan fit, or None. Switches that keep the tokens
    per step come first (batch split into accumulation, activation checkpointing, AdamW state on
    the host), then a shorter max_length, then a smaller draft MLP."""
    tr, L = job.train, job.data.max_length
    if tr.batch_size > 1 and fits_with(job, facts, batch_size=1):
        return f"train.batch_size=1 train.grad_accum={tr.grad_accum * tr.batch_size} (same tokens per step)"
    switches = []
    if not tr.activation_checkpointing:
        switches.append(("train.activation_checkpointing=true", {"activation_checkpointing": True}))
    layout = node_layout(job.hw)
    if optimizer_device(tr.optimizer_device, job.hw.device, layout.trainer_gpus) is None:
        switches.append(("train.optimizer_device=cpu", {"optimizer_device": "cpu"}))
    for n in range(1, len(switches) + 1):
        names = " ".join(name for name, _ in switches[:n])
        changes = {k: v for _, c in switches[:n] for k, v in c.items()}
        if fits_with(replace(job, train=replace(tr, **changes)), facts):
            return f"{names} (same tokens per step)"
    for B in ([tr.batch_size] + ([1] if tr.batch_size > 1 else [])):
        best = largest_fitting(lambda length: fits_with(job, facts, max_length=length, batch_size=B), L)
        if best:
            batch = "" if B == tr.batch_size else f"train.batch_size=1 train.grad_accum={tr.grad_accum * tr.batch_size} "
            return f"{batch}lower data.max_length to {best} (data.max_length={best})"
    best = largest_fitting(lambda width: fits_with(job, facts, intermediate_size=width),
                           draft_of(job, facts)[1].intermediate_size)
    if best:
        return f"a smaller draft MLP: draft.intermediate_size={best} (at data.max_length={L})"
    return None


def check_fits(job, target_facts: TargetFacts | None = None) -> MemoryPlan:
    """The plan of `job`, or PlanError (a ValueError) naming an override that fits."""
    facts = with_hw_overrides(job.hw, target_facts or target_facts_for(job.target))
    plan = plan_memory(job, facts)
    plan.problems += kernel_problems(job.hw, facts)  # not a size: no override search (plan_memory leaves them out)
    if plan.fits:
        return plan
    lines = ["the run does not fit:"] + [f"  - {p}" for p in plan.problems]
    if not plan.capacity_ok and job.hw.gpu_memory_mib > 0 and facts.weight_bytes > 0:
        fix = suggest_override(job, facts)
        if fix:
            lines.append(f"  fits with: {fix}")
        else:
            worst = max(plan.gpus, key=lambda g: g.resident() - g.capacity)
            lines.append(
                f"  no single override fits: GPU {worst.gpu} holds {gib(worst.resident())} of {gib(worst.capacity)} "
                f"before any activation (target {gib(sum(i.bytes for i in worst.items if i.owner == 'target'))}, "
                f"trainer {gib(sum(i.bytes for i in worst.items if i.owner == 'trainer' and i.phase is None))}"
                f"), so no data.max_length, batch size or draft.intermediate_size >= 256 fits, even with "
                "train.activation_checkpointing=true train.optimizer_device=cpu; "
                + ("the co-located trainer ranks do not fit beside the TP ranks: use hw.trainer_layout=dedicated"
                   if node_layout(job.hw).colocated else
                   "the trainer must move to a GPU of its own (hw.trainer_gpu) or the target to more GPUs")
                + " (see `python -m specforge_k25.plan`)")
    raise PlanError("\n".join(lines))
