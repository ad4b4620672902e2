"""What an EAGLE-3 head (either attention) proposes at every root of a greedy output, as SGLang's
and vLLM's chain drafting does under greedy verification (eval/acceptance.py replays it)."""
from __future__ import annotations

import torch

from ..objective import shift
from ..vocab import draft_to_target


@torch.no_grad()
def chain_proposals(draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The draft's chain proposals at every position, teacher-forced as in training (TTT).

    aux_hidden [T, K*Ht], input_ids [T] -> target token ids [steps, T]: row k, column t is what
    draft step k proposes for x[t+k+2] when x[..t+1] is committed (x[t+1] the root). Under
    greedy verification the inputs of an accepted chain ARE the output tokens, so these are
    exactly the proposals SGLang's draft makes at a verify step whose root is x[t+1].
    `step`'s cache entries (K/V, or MLA's latent and roped key) are kept for the later steps, as in training.
    """
    ids = input_ids[None]  # [1, T]
    positions = torch.arange(ids.shape[1])[None]
    dtype = next(p.dtype for p in draft.parameters() if p.is_floating_point())
    hidden = draft.project(aux_hidden[None].to(dtype))  # [1, T, H]
    cache: list = []
    to_target = draft_to_target(draft.d2t)
    rows = []
    for k in range(steps):
        hidden, kv = draft.step(shift(ids, k + 1, 0), hidden, positions + k, cache)
        cache.append(kv)
        rows.append(to_target[draft.logits(hidden).argmax(-1)][0])  # [T]
    return torch.stack(rows)
