"""Co-located trainer ranks beside the stages of a pipeline-parallel target (hw.target_pp > 1,
hw.trainer_layout=colocated): how each rank's target process fills its trainer's ring.

Only the last stage holds a batch's states. Its ranks write their own trainer's share straight into
their rings; its TP rank 0 sends every earlier stage's rank that rank's share (whole sequences:
aux [n, K*H] and final [n, H]), point to point (`send_states`), and that rank receives it
(`recv_states`) into a buffer it then writes into its own ring. A rank of stage s receives batch
i's share only after its own forward of batch i is done, so the sends wait for nothing that the
pipeline's forwards need; the receives are waited for lazily, in order, with at most `lag` batches
in flight, so an early stage keeps forwarding the next batches meanwhile (no bubble from the
hand-back). Per token, what crosses GPUs is the K+1 states of the sequences a rank trains:
(K+1) x H x 2 bytes in bf16 (57.3 KB for Kimi with K=3), for 1 - tp/world of the tokens.
"""
from __future__ import annotations

from collections import deque

import torch

from .ring import SlotRing


def _rows(t: torch.Tensor, starts: list[int], positions: list[int]) -> torch.Tensor:
    return torch.cat([t[starts[p]:starts[p + 1]] for p in positions])


class StageShares:
    """One target rank's side (world rank `rank`): `deliver` after each batch's forward, `finish`
    after the last (after the end-of-batches broadcast, before the engine closes). `routes[i][j]`:
    the positions in batch i of world rank j's trainer share (every rank of the replica)."""

    def __init__(self, target, rank: int, ring: SlotRing, routes: list[list[list[int]]], *, tp_size: int,
                 pp_size: int):
        self.target, self.rank, self.ring, self.routes = target, rank, ring, routes
        self.last_first = tp_size * (pp_size - 1)  # world rank of the last stage's TP rank 0
        self.is_last = rank >= self.last_first
        self.lag = pp_size
        self.pending: deque = deque()  # (item, works, aux, final, lengths), oldest first
        self.sent = 0  # messages put into this rank's ring

    def deliver(self, item: int, seqs: list[torch.Tensor], out) -> None:
        """Batch `item` was forwarded (`out`: its TargetOutput on the last stage, else None)."""
        mine = self.routes[item][self.rank]
        lengths = [len(s) for s in seqs]
        if self.is_last:
            starts = [0]
            for n in out.lengths:
                starts.append(starts[-1] + n)
            if self.rank == self.last_first:
                for j in range(self.last_first):
                    positions = self.routes[item][j]
                    if positions:
                        tensors = [_rows(out.aux_hidden, starts, positions), _rows(out.final_hidden, starts, positions)]
                        self.pending.append((item, self.target.send_states(j, tensors, tag=item), None, None, None))
            if mine:
                self.ring.put(self.sent, _rows(out.aux_hidden, starts, mine), _rows(out.final_hidden, starts, mine),
                              [lengths[p] for p in mine])
                self.sent += 1
        elif mine:
            n = sum(lengths[p] for p in mine)
            aux = torch.empty(n, self.ring.num_aux * self.ring.hidden_size, dtype=self.ring.aux[0].dtype,
                              device=self.ring.aux[0].device)
            final = torch.empty(n, self.ring.hidden_size, dtype=aux.dtype, device=aux.device)
            works = self.target.recv_states(self.last_first, [aux, final], tag=item)
            self.pending.append((item, works, aux, final, [lengths[p] for p in mine]))
        self._complete(wait_beyond=self.lag)

    def finish(self) -> int:
        """Wait for every share still in flight; returns the messages this rank's ring got."""
        self._complete(wait_beyond=0)
        return self.sent

    def _complete(self, wait_beyond: int) -> None:
        """Complete the oldest transfers: those already done, and more until at most `wait_beyond`
        remain. Received shares enter the ring in batch order."""
        while self.pending:
            item, works, aux, final, lengths = self.pending[0]
            if len(self.pending) <= wait_beyond and not all(w.is_completed() for w in works):
                return
            for w in works:
                w.wait()
            self.pending.popleft()
            if aux is not None:
                self.ring.put(self.sent, aux, final, lengths)
                self.sent += 1
