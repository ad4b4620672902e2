"""The resource plan of a run, checked before any process starts: facts (target and draft),
memory items (what each part holds), the per-GPU budget and the one fit search, and the
throughput of both trainer layouts (seconds per token on every GPU, node tokens/s).

`python -m specforge_k25.plan` prints it; `check_fits(job)` returns the `MemoryPlan` or raises
`PlanError` naming an override that fits; `predict_layouts(job, facts)` returns the throughput;
`compare_methods(job, facts)` the memory and throughput of every draft method in the job's place.
The draft's part is asked of its method (draft/method.py `plan`); the plan names none.
"""
from .budget import GpuBudget, MemoryPlan, plan_memory
from .fit import check_fits, longest_fitting_length, suggest_override
from .facts import (KIMI_K25, GiB, MiB, PlanError, TargetFacts, draft_of, draft_param_counts, facts_from_folder,
                    method_of_config, num_capture_points, resolve_draft, target_facts_for, trainable_params,
                    with_hw_overrides)
from .memory import (PHASE_OPT, PHASE_TEACHER, PHASE_DRAFT, Item, optimizer_items, trainer_items, saved_bytes,
                     step_bytes)
from .throughput import (Throughput, allreduce_bytes_per_token, draft_step_flops, predict, predict_layouts,
                         target_flops_per_token, target_params_per_token)
from .choose import MethodRow, compare_methods

__all__ = [
    "GpuBudget",
    "MemoryPlan",
    "check_fits",
    "longest_fitting_length",
    "plan_memory",
    "suggest_override",
    "KIMI_K25",
    "GiB",
    "MiB",
    "PlanError",
    "TargetFacts",
    "draft_of",
    "draft_param_counts",
    "facts_from_folder",
    "method_of_config",
    "num_capture_points",
    "resolve_draft",
    "target_facts_for",
    "trainable_params",
    "with_hw_overrides",
    "PHASE_OPT",
    "PHASE_TEACHER",
    "PHASE_DRAFT",
    "Item",
    "optimizer_items",
    "trainer_items",
    "saved_bytes",
    "step_bytes",
    "MethodRow",
    "Throughput",
    "allreduce_bytes_per_token",
    "compare_methods",
    "draft_step_flops",
    "predict",
    "predict_layouts",
    "target_flops_per_token",
    "target_params_per_token",
]
