"""A bounded ring of preallocated shared tensors between one producer and one consumer.

Each slot holds one target batch: aux [max_tokens, K*Ht] (K aux states, one per capture point; K = 0
is an aux of width 0) and final [max_tokens, Ht]. The producer takes a free slot (blocking when all
are in use: that is the backpressure), writes, and announces it on `ready`; the consumer reads and
hands the slot back on `free`. Only slot numbers and small metadata cross these channels (pipes,
stream/channel.py: no named semaphores to leave behind when a run is killed); the tensors themselves
are created once and shared when the producer process starts: POSIX shared memory (tmpfs, never a disk) on CPU,
CUDA IPC handles when `device` is a GPU (torch.multiprocessing does both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .channel import Channel


@dataclass
class SlotMessage:
    """What travels on the ready queue (no tensors)."""

    slot: int
    item: int  # index into the producer's list of batches
    lengths: list[int] = field(default_factory=list)
    checksum: float = 0.0  # slot_checksum of what the producer wrote: a consumer can check what it copied
    prompt_lengths: list[int] | None = None  # regeneration: each sequence's prompt; the rest is the target's answer


@dataclass(frozen=True)
class SeqWindow:
    """Context parallelism (hw.context_parallel): the positions of each sequence a co-located TP
    rank writes for its trainer rank, `rank` of a group of `size` sharing the same sequences. The
    padded sequences split into `size` windows of L = ceil(longest / size) positions; rank c's is
    [c L, (c+1) L) plus the `halo` positions after it (what its teacher's shifts read). A slot then
    holds each sequence's window rows only, `lengths` their counts (0 past a sequence's end)."""

    rank: int
    size: int
    halo: int

    def spans(self, lengths: list[int]) -> list[tuple[int, int]]:
        """(first, end) rows of each sequence of a batch of `lengths`."""
        window = max(1, -(-max(lengths) // self.size))
        start = self.rank * window
        return [(min(start, n), min(n, start + window + self.halo)) for n in lengths]


@dataclass
class EndOfStream:
    produced: int
    startup_write_bytes: int  # bytes the target process wrote before its first batch (/proc/self/io): compile caches, temp probes
    streaming_write_bytes: int  # ... from its first batch to its last (hidden states would show up here)


@dataclass
class ProducerFailed:
    where: str
    error: str
    rank: int = 0  # the TP rank that failed (0: the process that fills the ring)


class SlotRing:
    def __init__(self, ctx, num_slots: int, max_tokens: int, hidden_size: int, dtype: torch.dtype, device: str = "cpu",
                 *, num_aux: int):
        """num_aux: K, the aux states per token (TargetSpec.num_aux): no default, so that a ring is never
        sized for another K than its target captures. num_aux = 0 (no capture point): aux [max_tokens, 0]."""
        self.aux = [_aux_slot(max_tokens, num_aux * hidden_size, dtype, device) for _ in range(num_slots)]
        self.final = [torch.empty(max_tokens, hidden_size, dtype=dtype, device=device) for _ in range(num_slots)]
        # token ids of each slot's sequences: the trainer's only source for answers the target generated
        self.ids = [torch.empty(max_tokens, dtype=torch.int64).share_memory_() for _ in range(num_slots)]
        if device == "cpu":
            for t in self.aux + self.final:
                t.share_memory_()
        self.max_tokens, self.num_aux, self.hidden_size = max_tokens, num_aux, hidden_size
        self.free, self.ready = Channel(ctx), Channel(ctx)  # producer and consumer: one each
        self.sent = torch.zeros(1, dtype=torch.int64).share_memory_()  # batches announced (the producer counts)
        self.taken = 0  # ... and received (the consumer's own count)
        for slot in range(num_slots):
            self.free.put(slot)

    @property
    def num_slots(self) -> int:
        return len(self.aux)

    # producer side -----------------------------------------------------------------------
    def put(self, item: int, aux: torch.Tensor, final: torch.Tensor, lengths: list[int],
            ids: torch.Tensor | None = None, prompt_lengths: list[int] | None = None) -> None:
        """ids [N] int64 (CPU): the sequences' tokens, sent when the trainer does not know them
        (regenerated answers) with each sequence's prompt length."""
        n = aux.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"batch of {n} tokens exceeds stream slot size {self.max_tokens}")
        if aux.shape[-1] != self.num_aux * self.hidden_size or final.shape[-1] != self.hidden_size:
            # before taking a slot: copy_ would fail while holding it, naming no K (or broadcast a width-1 source)
            raise ValueError(f"aux [{n}, {aux.shape[-1]}] / final [{n}, {final.shape[-1]}] for a ring of "
                             f"{self.num_aux} aux states x {self.hidden_size}")
        slot = self.free.get()  # blocks while the trainer holds every slot
        self.aux[slot][:n].copy_(aux)
        self.final[slot][:n].copy_(final)
        if ids is not None:
            self.ids[slot][:n].copy_(ids)
        checksum = slot_checksum(self.aux[slot][:n], self.final[slot][:n])  # on CUDA: waits for the copies
        self.sent += 1
        self.ready.put(SlotMessage(slot, item, lengths, checksum, prompt_lengths))

    # consumer side -----------------------------------------------------------------------
    def get(self, timeout: float):
        """Next message: SlotMessage | EndOfStream | ProducerFailed; raises queue.Empty on timeout."""
        msg = self.ready.get(timeout=timeout)
        self.taken += isinstance(msg, SlotMessage)
        return msg

    def view(self, msg: SlotMessage) -> tuple[torch.Tensor, torch.Tensor]:
        n = sum(msg.lengths)
        return self.aux[msg.slot][:n], self.final[msg.slot][:n]

    def view_ids(self, msg: SlotMessage) -> torch.Tensor:
        return self.ids[msg.slot][:sum(msg.lengths)]

    def release(self, msg: SlotMessage) -> None:
        self.free.put(msg.slot)

    def depth(self) -> int:
        """Batches produced and not yet taken by the trainer."""
        return int(self.sent.item()) - self.taken

    def close(self) -> None:
        """The trainer's side, once the target processes are gone: close the channels' pipes
        (idempotent: TargetStream.close may run twice on a failure path)."""
        for channel in (self.free, self.ready):
            if channel is not None:
                channel.close()
        self.free = self.ready = None


def _aux_slot(max_tokens: int, width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One slot's aux tensor [max_tokens, width]. Width 0 (no capture point) is a view of a one-column
    tensor, so that it has storage to share: torch shares an empty CPU storage as a special case, but a
    CUDA IPC handle of an empty allocation is not something to rely on; the column costs max_tokens
    elements per slot and is never read."""
    if width == 0:
        return torch.empty(max_tokens, 1, dtype=dtype, device=device)[:, :0]
    return torch.empty(max_tokens, width, dtype=dtype, device=device)


def slot_checksum(aux: torch.Tensor, final: torch.Tensor) -> float:
    """float64 sum of a batch's aux [N, K*Ht] and final [N, Ht] states: the producer records it for
    the slot it filled; a consumer that recomputes it on its own copy proves the copy saw the batch
    the producer wrote, not a later one (the stream stress tests and the GPU check do)."""
    return float(aux.sum(dtype=torch.float64) + final.sum(dtype=torch.float64))

