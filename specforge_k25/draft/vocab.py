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


VOCAB_MAPS = ("d2t", "t2d")


def without_identity_maps(tensors: dict, draft_vocab_size: int, vocab_size: int) -> dict:
    """An export's tensors: the vocab maps left out when the draft vocab is the target's (they are
    the identity). vLLM >= 0.30 builds no d2t parameter then and refuses the tensor; SGLang 0.5.23
    reads a folder without d2t as the identity."""
    if draft_vocab_size != vocab_size:
        return tensors
    return {k: v for k, v in tensors.items() if k not in VOCAB_MAPS}


def with_identity_maps(tensors: dict, draft_vocab_size: int, vocab_size: int) -> dict:
    """A loaded export's tensors with the identity maps a full-vocab export leaves out."""
    if draft_vocab_size != vocab_size or all(k in tensors for k in VOCAB_MAPS):
        return tensors
    return {**tensors, "d2t": torch.zeros(vocab_size, dtype=torch.int64), "t2d": torch.ones(vocab_size, dtype=torch.bool)}


def vocab_map_problems(tensors: dict, draft_vocab_size: int, vocab_size: int) -> list[str]:
    """What is wrong with an export's d2t [Vd] int64 / t2d [V] bool: required below the full vocab,
    and then mapping draft ids to strictly increasing target ids that t2d marks; at the full vocab
    absent (or, in folders written before, the identity)."""
    present = [k for k in VOCAB_MAPS if k in tensors]
    if draft_vocab_size == vocab_size and not present:
        return []
    problems = [f"missing tensor {k}" for k in VOCAB_MAPS if k not in tensors]
    for name, shape, dtype in (("d2t", (draft_vocab_size,), torch.int64), ("t2d", (vocab_size,), torch.bool)):
        if name in tensors and (tuple(tensors[name].shape) != shape or tensors[name].dtype != dtype):
            problems.append(f"{name} is {tuple(tensors[name].shape)} {tensors[name].dtype}, expected {shape} {dtype}")
    if problems:
        return problems
    used = draft_to_target(tensors["d2t"])
    if used.min() < 0 or used.max() >= vocab_size or not bool(torch.all(used[1:] > used[:-1])):
        return ["d2t does not map draft ids to strictly increasing target ids"]
    if not torch.equal(tensors["t2d"].nonzero().flatten(), used):
        return ["t2d disagrees with d2t"]
    return []
