"""What a checkpoint must agree with to be resumed (its `fingerprint` in state.json), and what a
resume may change: the number of trainer ranks and their layout, as long as the global batch stays,
and settings that bound memory, not results. Everything recorded changes what is learned: the
target (its config, weights and dtype), the draft, both data splits, the schedule and the optimizer
settings; a resume with any of them changed is refused by name (docs/RELIABILITY.md)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..config import JobConfig
from ..draft.registry import FIRST_METHOD, METHODS
from ..setup.run import RunSetup
from ..target_engine.folder_digest import target_digest

# The settings of the update (AdamW, the LR schedule, clipping, the loss's step weights): a resume
# keeps the checkpoint's optimizer state and schedule, so one with any of them changed would run
# half old, half new; it is refused by name instead, with the override that resumes.
OPTIMIZER = {"lr": "train.lr", "betas": "train.betas", "weight_decay": "train.weight_decay",
             "warmup_ratio": "train.warmup_ratio", "grad_clip": "train.grad_clip", "loss_decay": "draft.loss_decay"}

# Objective settings every run recorded before each method owned its config; a method that has
# none of them (DFlash) does not record them, so an older checkpoint's are not compared.
FORMERLY_SHARED = ("ttt_length", "loss_decay")

# Keys checkpoints recorded only later: absent from an older checkpoint, they are not compared
# (the resume says so, `unrecorded`), since what that run used is not known.
RECORDED_LATER = ("target_digest", "target_dtype", "heldout_data_sha1", *OPTIMIZER)


def draft_fingerprint(setup: RunSetup) -> dict:
    """The draft config without the method's memory-only fields (chunk and tile sizes)."""
    return {k: v for k, v in dataclasses.asdict(setup.draft_cfg).items() if k not in setup.method.memory_only}


def run_fingerprint(job: JobConfig, setup: RunSetup, n_items: int, ranks: int = 1) -> dict:
    """What a checkpoint must agree with to be resumed: target, draft shape, data, schedule,
    optimizer settings; and how the trainer ranks cut it, which a resume may change
    (`check_fingerprint`)."""
    tr = job.train
    return {
        "target_architecture": setup.info.architecture, "target_layers": setup.info.num_layers,
        "target_hidden": setup.info.hidden_size, "target_vocab": setup.info.vocab_size,
        "target_digest": target_digest(setup.model_path), "target_dtype": job.hw.target_dtype,
        "capture_points": list(setup.capture_points), "draft_method": setup.method.name,
        "draft": draft_fingerprint(setup),
        "train_data_sha1": setup.data.train_sha1(), "heldout_data_sha1": setup.data.heldout_sha1(),
        "schedule_items": n_items, "seed": job.train.seed,
        "lr": tr.lr, "betas": list(tr.betas), "weight_decay": tr.weight_decay, "warmup_ratio": tr.warmup_ratio,
        "lr_schedule": tr.lr_schedule, "decay_ratio": tr.decay_ratio if tr.lr_schedule == "wsd" else None,
        "grad_clip": tr.grad_clip, **setup.method.objective_fingerprint(job.draft),
        "regeneration": json.loads(json.dumps(dataclasses.asdict(setup.regeneration))) if setup.regeneration else None,
        "regen_cut": job.data.regen_cut if setup.regeneration else None,
        "batch_size": job.train.batch_size, "grad_accum": job.train.grad_accum,
        "group_by_length": job.train.group_by_length, "trainer_ranks": ranks, "trainer_layout": job.hw.trainer_layout,
        "context_parallel": job.hw.context_parallel,
    }


# Fingerprint keys a resume may change. The schedule is cut into GLOBAL batches (train.batch_size
# x trainer ranks / hw.context_parallel) and the data cursor is an item of it, so with the same global batch the cursor
# names the same samples on any number of ranks; checkpoints hold the full state (FSDP2 gathers
# it), loaded into either layout (`optimizer_state_for`).
RESHARDABLE = ("batch_size", "trainer_ranks", "trainer_layout", "context_parallel")


def fingerprint_defaults(fingerprint: dict) -> dict:
    """A saved fingerprint with the keys older checkpoints left out at the value they meant: the
    trainer ranks were recorded only when there were several (absent: one), the layout only when
    co-located, regen_cut not at all (absent while regenerating: its default, keep), the LR schedule
    not at all (cosine, whose decay_ratio means nothing), the draft
    method not at all (the one method there was), nor the config fields its method added later
    (`DraftMethod.config_recorded_later`), nor length grouping (off), nor context parallelism
    (none); and the method's memory-only draft fields, which older checkpoints recorded, left out."""
    fp = {"trainer_ranks": 1, "trainer_layout": "dedicated", "draft_method": FIRST_METHOD, "group_by_length": False,
          "context_parallel": 1, "lr_schedule": "cosine", "decay_ratio": None, **fingerprint}
    if isinstance(fp.get("draft"), dict):  # the method's fields added later, at the value older checkpoints meant
        method = METHODS.get(fp["draft_method"])  # a method this version does not know: compare everything
        memory_only = method.memory_only if method else ()  # recorded by older checkpoints, not compared
        fp["draft"] = {**(method.config_recorded_later if method else {}),
                       **{k: v for k, v in fp["draft"].items() if k not in memory_only}}
    fp.setdefault("regen_cut", "keep" if fp.get("regeneration") else None)
    return fp


def global_batch(fingerprint: dict) -> int | None:
    b, ranks, cp = fingerprint.get("batch_size"), fingerprint.get("trainer_ranks"), fingerprint.get("context_parallel", 1)
    return b * ranks // cp if isinstance(b, int) and isinstance(ranks, int) and isinstance(cp, int) else None


def check_fingerprint(saved: dict, current: dict, checkpoint: Path) -> None:
    """Refuse a checkpoint of another run, listing every difference; a key recorded on one side
    only is one, unless an older checkpoint left it out before it was recorded (RECORDED_LATER).
    The trainer ranks, their layout and the per-rank batch may differ while the global batch
    stays (RESHARDABLE). A changed optimizer setting is named with the override that resumes."""
    saved, current = fingerprint_defaults(saved), fingerprint_defaults(current)
    absent = "(not recorded)"
    diffs = [f"{k}: checkpoint {saved.get(k, absent)!r} vs now {current.get(k, absent)!r}"
             for k in [*saved, *(k for k in current if k not in saved)]
             if k not in RESHARDABLE and not (k in RECORDED_LATER and k not in saved)
             and not (k in FORMERLY_SHARED and k not in current)
             and (k not in saved or k not in current or saved[k] != current[k])]
    changed = [k for k in OPTIMIZER if k in saved and k in current and saved[k] != current[k]]
    if changed:
        diffs.append("the optimizer settings are the run's own (its AdamW state and LR schedule continue): resume "
                     "with " + " ".join(f"{OPTIMIZER[k]}={_override(saved[k])}" for k in changed) + ", or start a new run")
    before, now = global_batch(saved), global_batch(current)
    if before is None or before != now:
        ranks, cp = current["trainer_ranks"], current["context_parallel"]
        owners = ranks // cp  # sequence owners: ranks, or their context-parallel groups
        hint = (f"resume on {ranks} rank(s) with train.batch_size={before // owners}" if before and before % owners == 0
                else f"resume on a number of ranks that divides {before}" if before else "it cannot be resumed")
        diffs.append(f"global batch (train.batch_size x trainer ranks / hw.context_parallel): checkpoint "
                     f"{saved.get('batch_size', absent)!r} x {saved['trainer_ranks']!r} / {saved['context_parallel']!r} "
                     f"vs now {current.get('batch_size')!r} x {ranks!r} / {cp!r}; the schedule "
                     f"and its cursor count global batches: {hint}")
    if diffs:
        raise ValueError(f"cannot resume from {checkpoint}: it belongs to a different run\n  " + "\n  ".join(diffs))


def unrecorded(saved: dict, current: dict | None = None) -> list[str]:
    """The keys an older checkpoint did not record (not compared on resume: `RECORDED_LATER`);
    given the `current` fingerprint, only those it records (DFlash records no loss_decay)."""
    return [k for k in RECORDED_LATER if k not in saved and (current is None or k in current)]


def with_recorded_optimizer(saved: dict, state: dict) -> dict:
    """A saved fingerprint with the optimizer settings an older checkpoint did not list but its
    optimizer state holds (AdamW's param group: the peak lr as the LR schedule saw it, betas,
    weight decay), so that those are compared too."""
    groups = state.get("optimizer", {}).get("param_groups") or [{}]
    group = groups[0]
    held = {"lr": group.get("initial_lr"), "betas": list(group["betas"]) if "betas" in group else None,
            "weight_decay": group.get("weight_decay")}
    return {**{k: v for k, v in held.items() if v is not None}, **saved}


def _override(value) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)

