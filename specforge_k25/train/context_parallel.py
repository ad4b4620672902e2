"""Context parallelism: one sequence split over the C trainer ranks of a group (hw.context_parallel),
each holding C's share of its positions, so a rank's activations are those of T/C tokens.

Rank c of the group holds positions [c L, (c+1) L) of every sequence of the batch (padded to C L).
Everything a draft computes per position (fc, the decoder layer's norms, projections and MLP, the
logits and the loss) runs on those L positions unchanged. Attention is the one place positions
meet: Ulysses-style, q/k/v switch from "all heads, my positions" to "my heads, all positions" with
one all-to-all each, the unchanged single-rank attention runs on C's share of the heads over the
whole sequence, and its output switches back with one more. Those all-to-alls are autograd
functions (backward is the inverse exchange), so gradients reach the rank that computed each
input and the draft's gradients, summed over ranks (FSDP2's reduce-scatter), equal one rank's.

An MLA head caches one latent per position shared by all heads: `gather_positions` collects it
along the sequence (backward: each rank gets the gradient of its own positions, summed).

The draft models take a `SeqShard` as their `seq` argument and call its methods (draft/ stays free
of torch.distributed); the trainer builds it per batch (train/learner.py).

An exchange that fails (gloo and NCCL raise plain RuntimeErrors when a rank of the group died or
hung) raises RankFailed naming it and the group, in forward and in backward alike: the run then
ends as every data-parallel failure does (train/__main__.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .distributed import RankFailed


@dataclass(frozen=True)
class SeqShard:
    """Where this rank's positions sit in the batch's sequences, and the ranks sharing them."""

    group: Any  # torch.distributed ProcessGroup of the C ranks (None: the default group)
    rank: int  # this rank's place in the group: which block of positions it holds
    size: int  # C
    length: int  # L: positions per rank; the padded sequences are C * L long

    @property
    def start(self) -> int:
        return self.rank * self.length

    @property
    def padded_length(self) -> int:
        return self.size * self.length

    def check_heads(self, heads: int, what: str) -> None:
        if heads % self.size:
            raise ValueError(f"hw.context_parallel={self.size}: the draft's {heads} {what} do not split over "
                             f"{self.size} ranks (Ulysses attention gives each rank heads / {self.size})")

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h, L, d] (all heads, this rank's positions) -> [B, h/C, C L, d] (this rank's heads
        c h/C .. (c+1) h/C - 1, every position in order)."""
        return _ToHeads.apply(x, self)

    def to_positions(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`: [B, h/C, C L, d] -> [B, h, L, d]."""
        return _ToPositions.apply(y, self)

    def gather_positions(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [B, C L, ...]: every rank's positions, in order."""
        return _GatherPositions.apply(x, self)

    def head_slice(self, heads: int) -> slice:
        """The heads this rank attends with after `to_heads`."""
        n = heads // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


def shard_of(lengths: list[int], group: Any, rank: int, size: int) -> SeqShard:
    """The shard of rank `rank` of `size` for a batch of sequences of `lengths` (at least one position each)."""
    return SeqShard(group, rank, size, max(1, -(-max(lengths) // size)))


@contextmanager
def _named(what: str, shard: SeqShard):
    """A failure of the collective inside as RankFailed naming `what` and the group's trainer ranks."""
    try:
        yield
    except RuntimeError as err:
        where = f"context-parallel rank {shard.rank} of {shard.size}"
        try:  # the group's trainer ranks, when the process group can still say (it is local state)
            group = shard.group if shard.group is not None else dist.group.WORLD
            peers = dist.get_process_group_ranks(group)
            where = f"trainer rank {dist.get_rank()} ({where}; the group: trainer ranks {peers})"
        except Exception:  # only the message's detail
            pass
        raise RankFailed(f"{where}: {what} failed (another rank of the group died or hung): {err}") from None


def _exchange(x: torch.Tensor, shard: SeqShard) -> torch.Tensor:
    """all_to_all over dim 0 (C equal blocks): block j goes to rank j, block i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with _named("the attention's all-to-all (heads <-> positions)", shard):
        dist.all_to_all_single(out, x, group=shard.group)
    return out


def _to_heads(x: torch.Tensor, shard: SeqShard) -> torch.Tensor:
    B, h, L, d = x.shape
    C = shard.size
    blocks = x.reshape(B, C, h // C, L, d).transpose(0, 1)  # [C(heads), B, h/C, L, d]
    got = _exchange(blocks, shard)  # [C(positions), B, h/C, L, d]
    return got.permute(1, 2, 0, 3, 4).reshape(B, h // C, C * L, d)


def _to_positions(y: torch.Tensor, shard: SeqShard) -> torch.Tensor:
    B, hc, T, d = y.shape
    C = shard.size
    blocks = y.reshape(B, hc, C, T // C, d).permute(2, 0, 1, 3, 4)  # [C(positions), B, h/C, L, d]
    got = _exchange(blocks, shard)  # [C(heads), B, h/C, L, d]
    return got.transpose(0, 1).reshape(B, C * hc, T // C, d)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _to_heads(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_positions(grad, ctx.shard), None


class _ToPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, shard):
        ctx.shard = shard
        return _to_positions(y, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.shard), None


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        with _named("the all-gather of the MLA latents along the sequence", shard):
            dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        C = ctx.shard.size
        blocks = grad.unflatten(1, (C, grad.shape[1] // C)).transpose(0, 1)  # [C(positions), B, L, ...]
        return _exchange(blocks, ctx.shard).sum(0), None
