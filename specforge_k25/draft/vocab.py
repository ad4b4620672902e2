"""Draft vocabulary: the Vd most frequent supervised target tokens, and the d2t / t2d maps."""
from __future__ import annotations

import torch


def count_tokens(samples, vocab_size: int) -> torch.Tensor:
    """Frequency [V] int64 of tokens under loss_mask = 1 across `samples` (vectorised bincount)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s.input_ids[s.loss_mask]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} >= target vocab size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] -> (d2t [Vd] int64, t2d [V] bool).

    used = the Vd most frequent ids (ties broken by lower id), padded with the lowest unseen ids
    when fewer than Vd tokens were seen, sorted ascending; d2t[i] = used[i] - i.
    """
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft vocab {draft_vocab_size} > target vocab {vocab_size}")
    ids = torch.arange(vocab_size)
    # Sort by (-count, id): stable sort on -count keeps ascending ids within ties.
    order = torch.sort(-counts, stable=True).indices
    used = torch.sort(ids[order[:draft_vocab_size]]).values  # seen first; unseen ones are the lowest ids
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target ids of the draft tokens."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] draft id of each target token, -1 where the token is not in the draft vocab."""
    out = torch.full((vocab_size,), -1, dtype=torch.int64, device=d2t.device)
    out[draft_to_target(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return out
