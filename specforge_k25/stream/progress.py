"""How far each target rank got through the batches, so that a stalled stream names the rank the
others wait on instead of the rank that fills the ring (which waits in a collective with it).

Every target process on the trainer's node writes its own row of one shared int64 tensor (one
writer per row: no lock, and nothing named in /dev/shm for a `kill -9` to leave behind, as for the
ring's tensors): the batches it started and the batches it finished. A TP rank > 0 starts a batch
when TP rank 0's broadcast of it (or of its regeneration) reaches it; every pipeline rank walks the
batches itself.

What a rank must have done for the ring's filler to get on with its batch j: a TP rank of the
filler's stage runs batch j's forward with it (its collectives need every rank), so it must have
started batch j; an earlier pipeline stage must have finished batch j (the filler's stage forwards
what it sends). A rank short of that is behind; the furthest behind are named. A rank hung inside
the batch the others are in looks like them, and then nobody is named.
"""
from __future__ import annotations

import torch


class BatchProgress:
    """Per world rank of the target: (batches started, batches finished) of this stream's list."""

    def __init__(self, world_size: int):
        self.counts = torch.zeros(world_size, 2, dtype=torch.int64).share_memory_()

    # a target process, on its own row only -------------------------------------------------
    def started(self, rank: int, item: int) -> None:
        self.counts[rank, 0] = item + 1

    def finished(self, rank: int, item: int) -> None:
        self.counts[rank, 1] = item + 1

    # the trainer ------------------------------------------------------------------------------
    def behind(self, filler: int, ranks, tp_size: int) -> list[int]:
        """The ranks (of `ranks`, this node's) furthest short of what the filler's current batch
        needs of them; [] when none is short."""
        counts = self.counts.tolist()
        needed = counts[filler][0]  # the filler's batch j is item needed - 1
        short = {}
        for rank in ranks:
            started, finished = counts[rank]
            if rank == filler or rank // tp_size > filler // tp_size:  # the filler waits on no later stage
                continue
            if (finished if rank // tp_size < filler // tp_size else started) < needed:
                short[rank] = started + finished
        least = min(short.values(), default=None)
        return [rank for rank, at in short.items() if at == least]

    def where(self, rank: int) -> str:
        started, finished = self.counts[rank].tolist()
        if started == 0:
            return "has started no batch (engine start or warm-up)"
        if started > finished:
            return f"is in batch {started - 1}"
        return f"finished batch {finished - 1} and has not started batch {finished}"
