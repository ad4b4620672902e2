"""What a checkpoint must agree with to be resumed (its `fingerprint` in state.json), and what a
resume may change: the number of trainer ranks and their layout, as long as the global batch stays."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..config import JobConfig
from ..draft.registry import FIRST_METHOD
from ..setup.run import RunSetup


def run_fingerprint(job: JobConfig, setup: RunSetup, n_items: int, ranks: int = 1) -> dict:
    """What a checkpoint must agree with to be resumed: target, draft shape, data, schedule; and
    how the trainer ranks cut it, which a resume may change (`check_fingerprint`)."""
    return {
        "target_architecture": setup.info.architecture, "target_layers": setup.info.num_layers,
        "target_hidden": setup.info.hidden_size, "target_vocab": setup.info.vocab_size,
        "capture_points": list(setup.capture_points), "draft_method": setup.method.name,
        "draft": dataclasses.asdict(setup.draft_cfg),
        "train_data_sha1": setup.data.train_sha1(), "schedule_items": n_items, "seed": job.train.seed,
        "regeneration": json.loads(json.dumps(dataclasses.asdict(setup.regeneration))) if setup.regeneration else None,
        "regen_cut": job.data.regen_cut if setup.regeneration else None,
        "batch_size": job.train.batch_size, "grad_accum": job.train.grad_accum, "ttt_length": job.train.ttt_length,
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
    co-located, regen_cut not at all (absent while regenerating: its default, keep), the draft
    method not at all (the one method there was), nor its fc_norm / norm_output (off), nor
    length grouping (off), nor context parallelism (none)."""
    fp = {"trainer_ranks": 1, "trainer_layout": "dedicated", "draft_method": FIRST_METHOD, "group_by_length": False,
          "context_parallel": 1, **fingerprint}
    if isinstance(fp.get("draft"), dict):  # the draft's EAGLE-3.1 options (draft/model.py), off when not recorded
        fp["draft"] = {"fc_norm": False, "norm_output": False, **fp["draft"]}
    fp.setdefault("regen_cut", "keep" if fp.get("regeneration") else None)
    return fp


def global_batch(fingerprint: dict) -> int | None:
    b, ranks, cp = fingerprint.get("batch_size"), fingerprint.get("trainer_ranks"), fingerprint.get("context_parallel", 1)
    return b * ranks // cp if isinstance(b, int) and isinstance(ranks, int) and isinstance(cp, int) else None


def check_fingerprint(saved: dict, current: dict, checkpoint: Path) -> None:
    """Refuse a checkpoint of another run, listing every difference; a key recorded on one side
    only is one. The trainer ranks, their layout and the per-rank batch may differ while the
    global batch stays (RESHARDABLE)."""
    saved, current = fingerprint_defaults(saved), fingerprint_defaults(current)
    absent = "(not recorded)"
    diffs = [f"{k}: checkpoint {saved.get(k, absent)!r} vs now {current.get(k, absent)!r}"
             for k in [*saved, *(k for k in current if k not in saved)]
             if k not in RESHARDABLE and (k not in saved or k not in current or saved[k] != current[k])]
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
