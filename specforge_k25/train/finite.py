"""A diverged run: a NaN or inf loss or gradient norm stops training at that optimizer step, and
nothing non-finite is checkpointed or exported.

The policy is to stop at the first such step, not to skip it: by the time the gradient norm is
known AdamW has applied the update (a NaN gradient makes every weight NaN), and a run whose loss
overflows once will overflow again from the same weights. The saved progress is then the newest
periodic checkpoint, which was written only after its own step passed this check and its tensors
were checked finite (`check_finite`). Resuming it with the same settings diverges again (a CPU run
is deterministic): the way on is a new run with a lower `train.lr` or `train.grad_clip`.

Every trainer rank takes the same decision without a collective of its own: the gradient norm is
that of the gradients summed over the ranks (or, sharded, all-reduced by the clip), and the loss
is summed over the ranks (`DraftLearner.loss_value`), so every rank sees the same two numbers."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..draft.export_folder import nonfinite_names


class NonFiniteError(RuntimeError):
    """The run diverged (a non-finite loss, gradient norm, or tensor about to be written)."""


def diverged(step: int, loss: float, grad_norm: float) -> str | None:
    """The reason to stop after optimizer step `step`, or None when both numbers are finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    return f"training diverged at optimizer step {step}: loss {loss}, gradient norm {grad_norm}"


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """NonFiniteError naming the first tensors of `tensors` that hold a NaN or an inf."""
    bad = nonfinite_names(tensors)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise NonFiniteError(f"{what}: {len(bad)} of {len(tensors)} tensors hold NaN or inf ({shown}); not written")


def nonfinite_weights(model: torch.nn.Module) -> int:
    """How many trainable parameters of `model` hold NaN or inf (of a sharded one, this rank's shards)."""
    bad = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's own shard: no collective
            bad += int(not bool(torch.isfinite(local.detach()).all()))
    return bad


def diverged_message(err: Exception, last_good: Path | None, run_dir: Path) -> str:
    """What a diverged run ends with: the step, the newest checkpoint written before it, the way on."""
    if last_good is None:
        where = "no checkpoint was written before it"
    else:
        where = (f"last good checkpoint: {last_good} (train.resume=auto train.out_dir={run_dir} continues from it "
                 f"with the same settings, which diverge again)")
    return (f"{err}\nnothing was exported; {where}; start a new run with a lower train.lr (or train.grad_clip)")
