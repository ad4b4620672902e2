"""The target's frozen lm_head split over the vocabulary between the ranks of a process group (the
co-located trainer ranks), for a method that scores its tokens over the full target vocabulary
(DFlash). Each rank holds rows [start, start + Vs) of the [V, Ht] head, 1/W of it, instead of the
whole head on every rank (2.19 GiB in bf16 for Kimi-K2.5).

The draft's model holds the shard (its `attach_lm_head`) and its loss calls `token_losses`, which
gives each rank, for its own N rows, the per-token loss and whether the argmax over
the whole vocab is the label, as one rank holding the whole head computes them:

    ce = (1 - d) * (lse(z) - z[label])  +  d * (lse(z) * sum(p) - sum_v p(v) z(v))
    z = h @ W.T (the logits, in fp32 or wider), p = softmax(t @ W.T) (the target's distribution
    from its final state t, only when d = draft.distill > 0)

In chunks of `chunk` rows per rank (the same number of chunks on every rank: the most any rank
has, short ranks padded): all ranks all-gather their chunk's rows of h (and t) [W*c, H], each
computes its slice of the logits [W*c, Vs] (the working set of one replicated chunk [c, V]), and
all-reduces over the W*c rows give the max, the sum of exponentials, the label's logit and
sum_v p z. The argmax is the first rank's whose slice holds the global max (ranks are in vocab
order, each slice's argmax its first maximum: torch.argmax's tie rule over the whole vocab).
Backward recomputes each chunk's slice, forms dce/dz on it (q - (1-d) onehot - d p, with q's
log-sum-exp saved from forward), multiplies by the slice of W and reduce-scatters d h, summed over
the slices, to the rows' owners. One autograd node runs every chunk, in the same order on every
rank, so all ranks call the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..draft.layers import at_least_fp32


@dataclass
class VocabShard:
    weight: torch.Tensor  # [Vs, Ht] rows start .. start + Vs of the target's lm_head (Vs may be 0)
    start: int
    vocab_size: int  # V, the whole head's rows
    world: int
    rank: int
    group: Any = None  # the process group (None: the default one)

    @classmethod
    def of(cls, lm_head: torch.Tensor, world: int, rank: int, group=None, device=None) -> "VocabShard":
        """Rank `rank`'s rows of `lm_head` [V, Ht]: ceil(V / world) rows each, the last ranks fewer;
        copied to `device` (default: the head's), so only they reach it."""
        V = lm_head.shape[0]
        per = -(-V // world)
        start = min(rank * per, V)
        rows = lm_head.narrow(0, start, min(per, V - start)).detach()  # narrow: what a fake-device trace can run
        rows = rows.clone() if device is None or torch.device(device) == rows.device else rows.to(device)
        return cls(rows, start, V, world, rank, group)

    def token_losses(self, h: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, distill: float,
                     chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a model holding this shard calls (draft/dflash/loss.py): `token_losses`."""
        return token_losses(h, labels, teacher, distill, self, chunk)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def full(self) -> torch.Tensor | None:
        """The whole head [V, Ht] on rank 0 of the group, None on the others (a collective; for
        the export, which rank 0 writes)."""
        per = -(-self.vocab_size // self.world)
        rows = self.weight.new_zeros(per, self.weight.shape[1])
        rows[:self.weight.shape[0]] = self.weight
        parts = [torch.empty_like(rows) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(rows, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        return torch.cat(parts)[:self.vocab_size] if self.rank == 0 else None


def token_losses(h: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, distill: float,
                 shard: VocabShard, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, H] this rank's rows (differentiable), labels [N], teacher [N, Ht] the target's final
    states for them (distill > 0) -> (ce [N] in h's fp32-or-wider dtype, correct [N] int64).
    Every rank of the shard's group calls it together (module doc)."""
    if distill > 0 and teacher is None:
        raise ValueError("distillation needs the teacher rows")
    t = teacher if distill > 0 else h.new_zeros(h.shape[0], 0)
    return _VocabParallelCE.apply(h, t, labels, shard, float(distill), int(chunk))


def _chunk_sizes(n_local: int, shard: VocabShard, chunk: int, device) -> list[int]:
    n_max = torch.tensor([n_local], dtype=torch.int64, device=device)
    dist.all_reduce(n_max, op=dist.ReduceOp.MAX, group=shard.group)
    n_max = int(n_max.item())
    return [min(chunk, n_max - s) for s in range(0, n_max, chunk)]


def _gather_rows(x: torch.Tensor, s: int, size: int, shard: VocabShard) -> torch.Tensor:
    """Rows s .. s+size of x [N, ...] from every rank, zero-padded past N -> [W*size, ...]."""
    part = x.new_zeros(size, *x.shape[1:])
    mine = x[s:s + size]
    part[:mine.shape[0]] = mine
    out = x.new_empty(shard.world * size, *x.shape[1:])
    dist.all_gather_into_tensor(out, part.contiguous(), group=shard.group)
    return out


def _all_reduce(x: torch.Tensor, shard: VocabShard, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=shard.group)
    return x


def _slice_logits(rows: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [R, Ht] -> this rank's logits [R, Vs] computed in the head's dtype (as the replicated
    path's `model.logits`), then widened to `dtype`."""
    return torch.nn.functional.linear(rows.to(w.dtype), w).to(dtype)


def _lse(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The log-sum-exp over the whole vocab of rows whose slice on this rank is z [R, Vs]."""
    m = z.max(-1).values if z.shape[1] else z.new_full(z.shape[:1], float("-inf"))
    m = _all_reduce(m.clone(), shard, dist.ReduceOp.MAX)
    s = _all_reduce(torch.exp(z - m[:, None]).sum(-1), shard)
    return m + torch.log(s)


def _label_logit(z: torch.Tensor, labels: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    local = labels - shard.start
    here = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, max(z.shape[1] - 1, 0))[:, None])[:, 0] if z.shape[1] else z.new_zeros(len(labels))
    return _all_reduce(torch.where(here, picked, torch.zeros_like(picked)), shard)


def _argmax(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The whole vocab's argmax of rows sliced as z [R, Vs] (torch.argmax's first-maximum rule)."""
    R = z.shape[0]
    if z.shape[1]:
        m, i = z.max(-1)
    else:
        m, i = z.new_full((R,), float("-inf")), torch.zeros(R, dtype=torch.int64, device=z.device)
    ms = z.new_empty(shard.world * R)
    idx = torch.empty(shard.world * R, dtype=torch.int64, device=z.device)
    dist.all_gather_into_tensor(ms, m.contiguous(), group=shard.group)
    dist.all_gather_into_tensor(idx, (i + shard.start).contiguous(), group=shard.group)
    ms, idx = ms.view(shard.world, R), idx.view(shard.world, R)
    first = (ms == ms.max(0).values).to(torch.int64).argmax(0)  # the first rank holding the maximum
    return idx.gather(0, first[None])[0]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, teacher, labels, shard: VocabShard, distill: float, chunk: int):
        dtype = at_least_fp32(h.dtype)
        w, W, r = shard.weight, shard.world, shard.rank
        sizes = _chunk_sizes(h.shape[0], shard, chunk, h.device)
        ce = torch.zeros(h.shape[0], dtype=dtype, device=h.device)
        correct = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
        saved = []  # per chunk: the gathered rows' lse of q, sum p (distill), labels
        s = 0
        for size in sizes:
            n_mine = max(0, min(size, h.shape[0] - s))
            mine = slice(r * size, r * size + n_mine)
            hg, lab = _gather_rows(h.detach(), s, size, shard), _gather_rows(labels, s, size, shard)
            z = _slice_logits(hg, w, dtype)  # [W*size, Vs]
            lse = _lse(z, shard)
            loss = lse - _label_logit(z, lab, shard)
            tlse = psum = None
            if distill > 0:
                zt = _slice_logits(_gather_rows(teacher, s, size, shard), w, dtype)
                tlse = _lse(zt, shard)
                p = torch.exp(zt - tlse[:, None])
                psum = _all_reduce(p.sum(-1), shard)
                pz = _all_reduce((p * z).sum(-1), shard)
                loss = (1 - distill) * loss + distill * (lse * psum - pz)
            ce[s:s + n_mine] = loss[mine]
            correct[s:s + n_mine] = (_argmax(z, shard) == lab).to(torch.int64)[mine]
            saved.append((lse, tlse, psum, lab))
            s += size
        ctx.shard, ctx.distill, ctx.sizes, ctx.chunks = shard, distill, sizes, saved
        ctx.autocast = (h.device.type, torch.is_autocast_enabled(h.device.type),
                        torch.get_autocast_dtype(h.device.type))
        ctx.save_for_backward(h, teacher)
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, g_ce, _g_correct):
        h, teacher = ctx.saved_tensors
        shard, d = ctx.shard, ctx.distill
        w, r = shard.weight, shard.rank
        dtype = at_least_fp32(h.dtype)
        g_ce = (g_ce if g_ce is not None else torch.zeros(h.shape[0], device=h.device)).to(dtype)
        dh = torch.zeros(h.shape, dtype=dtype, device=h.device)
        device_type, enabled, ac_dtype = ctx.autocast
        s = 0
        with torch.autocast(device_type, dtype=ac_dtype, enabled=enabled):  # the forward's logits, recomputed
            for size, (lse, tlse, psum, lab) in zip(ctx.sizes, ctx.chunks):
                n_mine = max(0, min(size, h.shape[0] - s))
                hg = _gather_rows(h.detach(), s, size, shard)
                g = _gather_rows(g_ce, s, size, shard)  # [W*size] every row's upstream grad
                z = _slice_logits(hg, w, dtype)
                dz = torch.exp(z - lse[:, None])  # q on this slice
                if d > 0:
                    zt = _slice_logits(_gather_rows(teacher, s, size, shard), w, dtype)
                    dz = dz * ((1 - d) + d * psum[:, None]) - d * torch.exp(zt - tlse[:, None])
                local = lab - shard.start
                here = ((local >= 0) & (local < z.shape[1])).nonzero(as_tuple=True)[0]
                dz[here, local[here]] -= (1 - d)
                dz = dz * g[:, None]
                part = torch.nn.functional.linear(dz.to(w.dtype), w.t()).to(dtype)  # [W*size, Ht] summed below
                mine = part.new_empty(size, part.shape[1])
                dist.reduce_scatter_tensor(mine, part.contiguous(), group=shard.group)
                dh[s:s + n_mine] = mine[:n_mine]
                s += size
        return dh.to(h.dtype), None, None, None, None, None
