"""Training on the target's own answers (data.regenerate): which prompt each sample gives the
target, and which tokens of the regenerated conversation the loss covers.

Choice for multi-turn rows: only the final assistant turn that starts within data.max_length is
regenerated. The prompt is the conversation up to that turn's first token, exactly as the server
would see it (the chat template's or the Kimi renderer's generation prompt included, so Kimi's
thinking | instant mode follows target.chat_mode); earlier assistant turns stay as the data wrote
them, as context without loss. Regenerating them too would take one generation pass per turn.
"""
from __future__ import annotations

import torch

from .tokenize import Sample

# what happened to a regenerated answer (counted in the run summary)
ENDED, CUT_KEPT, CUT_DROPPED, EMPTY, NO_ROOM = "ended", "cut_kept", "cut_dropped", "empty_generation", "prompt_too_long"
SKIPPED = (CUT_DROPPED, EMPTY, NO_ROOM)


def regeneration_prompt(sample: Sample) -> torch.Tensor:
    """input_ids up to the first token of the final supervised (assistant) run [P] int64."""
    mask = sample.loss_mask
    supervised = mask.nonzero().flatten()
    if not len(supervised):
        return sample.input_ids
    last = int(supervised[-1])
    start = last
    while start > 0 and bool(mask[start - 1]):
        start -= 1
    return sample.input_ids[:start]


def regenerated_sample(ids: torch.Tensor, prompt_len: int, stop_ids, cut: str) -> tuple[Sample, str]:
    """The regenerated conversation ids [T] (prompt + answer) -> (Sample, status).

    The loss covers exactly the generated tokens, the end-of-turn token included when the answer
    ends with one. An answer cut at its budget is kept with that mask (cut="keep") or masked out
    (cut="drop"); an empty answer (nothing, or only the end token) and a prompt with no room left
    are masked out. A masked-out sample still runs through the target (its batch is already
    formed) but adds nothing to the loss or the metrics."""
    answer = ids[prompt_len:]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    if len(answer) == 0:  # the engine answers every prompt with a budget: none was left
        return Sample(ids, mask), NO_ROOM
    ended = int(answer[-1]) in stop_ids
    if ended and len(answer) == 1:
        return Sample(ids, mask), EMPTY
    if not ended and cut == "drop":
        return Sample(ids, mask), CUT_DROPPED
    mask[prompt_len:] = True
    return Sample(ids, mask, truncated=not ended), (ENDED if ended else CUT_KEPT)
