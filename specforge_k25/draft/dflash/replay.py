"""What a DFlash head proposes at every root of a greedy output, as SGLang's DFLASH worker drafts
under greedy verification (eval/acceptance.py replays it)."""
from __future__ import annotations

import torch

from ..vocab import draft_to_target


@torch.no_grad()
def block_proposals(draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, block_size: int,
                    queries_per_chunk: int = 512) -> torch.Tensor:
    """The block drafter's proposals at every root, in the chain replay's layout (so the eval's
    proposer and step counts read both).

    aux_hidden [T, K*Ht], input_ids [T] -> target token ids [block_size - 1, T]: column t holds
    what the drafter proposes for x[t+2..t+B] when x[..t+1] is committed, x[t+1] the last
    accepted token: the block [x[t+1], MASK x (B-1)] at positions t+1..t+B over the context's
    states x[0..t] (model.py `draft_block`). Under greedy verification the committed tokens ARE
    the output, so these are the proposals of the verify step whose root is x[t+1]. All roots are
    drafted in one forward per chunk of blocks (the model's block attention: no [Q, T+Q] mask),
    which equals one `draft_block` per root. The last column (no root) stays -1.
    """
    T, B = len(input_ids), block_size
    dtype = next(p.dtype for p in draft.parameters() if p.is_floating_point())
    aux = aux_hidden[None].to(dtype)
    ctx_positions = torch.arange(T)
    to_target = draft_to_target(draft.d2t)
    out = torch.full((B - 1, T), -1, dtype=torch.int64)
    for roots in torch.arange(1, T).split(max(1, queries_per_chunk // B)):
        n = len(roots)
        ids = torch.full((n, B), draft.cfg.mask_token_id, dtype=torch.int64)
        ids[:, 0] = input_ids[roots]
        positions = roots[:, None] + torch.arange(B)
        # each block sees the context before its root and itself, both directions
        hidden = draft(aux, ctx_positions[None], ids.view(1, -1), positions.view(1, -1), prefix=roots[None])[0]
        drafted = hidden.view(n, B, -1)[:, 1:]  # block positions 1..B-1 draft x[r+1..r+B-1]
        out[:, roots - 1] = to_target[draft.logits(drafted).argmax(-1)].T
    return out
