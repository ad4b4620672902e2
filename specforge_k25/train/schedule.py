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


def build_schedule(n_train: int, n_heldout: int, *, batch_size: int, grad_accum: int, epochs: int,
                   max_steps: int | None, eval_every: int | None, seed: int) -> tuple[list[BatchItem], int]:
    """Order of target batches: eval(start), train micro-batches with evals interleaved, eval(end).

    Held-out sample ids are n_train..n_train+n_heldout-1. Returns (schedule, optimizer steps).
    """
    rng = random.Random(seed)
    micro = []
    for _ in range(epochs):
        order = list(range(n_train))
        rng.shuffle(order)
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
