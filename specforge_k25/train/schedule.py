"""The order in which target batches reach the trainer: the start evaluation, the training
micro-batches with evaluations interleaved, the end evaluation. Deterministic in the seed, so a
resumed run walks the same list from its saved cursor."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BatchItem:
    kind: str  # "train" | "eval"
    sample_ids: list[int]
    tag: str = ""  # eval: which evaluation ("start", "step_40", "end")


# micro-batches per length-sorted window: wide enough that neighbours in length share a batch,
# narrow enough that an epoch's order stays mixed (the batches of a window are shuffled)
GROUP_WINDOW = 32


def _grouped(order: list[int], lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled sample ids -> micro-batches of similar length: each window of GROUP_WINDOW batches is
    sorted by length, cut into batches, and the batches shuffled (a random order of lengths)."""
    window = batch_size * GROUP_WINDOW
    micro = []
    for w in range(0, len(order), window):
        ids = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches = [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]
        rng.shuffle(batches)
        micro += batches
    return micro


def padding_share(schedule: list[BatchItem], lengths: list[int], per_rank: int) -> float:
    """Padded share of the training micro-batches as the trainer ranks pad them (each rank its slice
    of `per_rank` samples to [per_rank, longest]): 0 at batch 1."""
    padded = real = 0
    for item in schedule:
        for r in range(0, len(item.sample_ids), per_rank) if item.kind == "train" else ():
            n = [lengths[i] for i in item.sample_ids[r:r + per_rank]]
            padded += len(n) * max(n)
            real += sum(n)
    return 1.0 - real / padded if padded else 0.0


def build_schedule(n_train: int, n_heldout: int, *, batch_size: int, grad_accum: int, epochs: int,
                   max_steps: int | None, eval_every: int | None, seed: int,
                   lengths: list[int] | None = None) -> tuple[list[BatchItem], int]:
    """Order of target batches: eval(start), train micro-batches with evals interleaved, eval(end).

    Held-out sample ids are n_train..n_train+n_heldout-1. `lengths` (of the training samples):
    group micro-batches by length (`_grouped`), so less of each is padding (the lengths of
    regenerated samples are their dataset answers': a guess of what the target will answer). Returns (schedule,
    optimizer steps).
    """
    rng = random.Random(seed)
    micro = []
    for _ in range(epochs):
        order = list(range(n_train))
        rng.shuffle(order)
        if lengths is not None and batch_size > 1:
            micro += _grouped(order, lengths, batch_size, rng)
        else:
            micro += [order[i:i + batch_size] for i in range(0, n_train, batch_size)]
    steps = len(micro) // grad_accum
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps < 1:
        raise ValueError(f"{n_train} samples make no optimizer step with batch_size={batch_size} x grad_accum={grad_accum}")
    micro = micro[: steps * grad_accum]
    held = list(range(n_train, n_train + n_heldout))
    eval_batches = [held[i:i + batch_size] for i in range(0, n_heldout, batch_size)]

    def evals(tag):
        return [BatchItem("eval", b, tag) for b in eval_batches]

    schedule = evals("start")
    for step in range(steps):
        schedule += [BatchItem("train", b) for b in micro[step * grad_accum:(step + 1) * grad_accum]]
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            schedule += evals(f"step_{step + 1}")
    schedule += evals("end")
    return schedule, steps
