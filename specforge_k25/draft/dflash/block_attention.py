"""DFlash anchor-block attention without a dense mask (issue 22, item 1, for DFlash).

Training runs the A blocks of a sequence as Q = A*Bk query rows in one forward (draft/dflash/loss.py).
Row r of block i (anchor a_i) sees the context keys 0..prefix_i - 1 (prefix_i = a_i: the target
states before its anchor; 0 for a padded, invalid anchor) and the Bk keys of its own block, both
directions. The former code wrote this as a boolean mask [B, Q, T+Q] handed to SDPA: O(Q (T+Q))
memory per layer (the mask and SDPA's additive copy of it), every query scored against all T+Q
keys, and K/V repeated to nh heads. Here the same softmax is computed exactly, tile by tile:

    tiles of G consecutive anchors (R = G*Bk rows; anchors are sorted, so a tile's prefixes are
    close together), per tile
      in-block part: scores [.., G, Bk, Bk] of each block against its own Bk keys (no mask)
      context part:  keys 0..P-1 with P = the tile's largest prefix, in chunks of C keys; a score
                     tile [B, nh, R, C] masked by key < prefix (a [B, R, C] comparison)
    merged by an online log-sum-exp (running max m, sum l, weighted values o, as flash attention):
      out_r = o_r / l_r, lse_r = m_r + log l_r.

Forward keeps q, the unrepeated K/V (nkv heads), the output and lse [B, nh, Q] (fp32) for backward;
backward recomputes every tile's probabilities from lse, p = exp(s - lse), and accumulates
    dV += p^T dO,  dS = p (dO V^T - rowsum(dO o out)) * scale,  dQ += dS K,  dK += dS^T Q
(the flash-attention backward). No tensor ever exceeds one tile [B, nh, R, C] besides the
linear ones (q, K, V, their grads); peak extra memory is a few tiles, set by `tile_rows` (R,
rounded down to whole blocks) and `tile_keys` (C), not by Q*(T+Q).

GQA: query head h reads kv head h // (nh/nkv) (repeat_interleave's order). A tile's queries are
laid out [B, nkv, nh/nkv * R, hd], so one matmul per kv head scores all its query heads, and
p^T dO / dS^T Q sum over the group for free; K/V are never repeated.

Precision: scores, softmax and accumulation in at least fp32 (float64 stays float64); each tile
casts its bf16/fp16 slices up, as SDPA's fused kernels accumulate in fp32. Under autocast the
inputs are first cast to the autocast dtype (what autocast did for SDPA), so backward keeps them at
that width.

Tile order follows the anchors; any order is exact (a tile's P is its largest prefix), sorted
anchors only make it cheap: the context part costs ~ sum_tiles R * P ~ Q*T/2 scores, against
Q*(T+Q) for the dense mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Tiling:
    """How `block_attention` cuts the rows and keys: tiles of `anchors_per_tile` blocks, context keys
    in chunks of `tile_keys`, and per tile the context keys it reads (`bounds`, its largest prefix)."""
    block_size: int
    anchors_per_tile: int
    tile_keys: int
    bounds: tuple[int, ...]


def make_tiling(prefix: torch.Tensor, block_size: int, tile_rows: int, tile_keys: int) -> Tiling:
    """prefix [B, A] int64 -> the Tiling (one host read of A / G numbers; the model computes it once
    per forward and every layer, and a checkpointed layer's recompute, reuses it)."""
    if tile_rows < 1 or tile_keys < 1:
        raise ValueError(f"attention tiles must be positive, got rows {tile_rows}, keys {tile_keys}")
    B, A = prefix.shape
    G = max(1, min(A, tile_rows // block_size))
    padded = F.pad(prefix, (0, (-A) % G))  # [B, ceil(A/G)*G]: zeros read no keys
    bounds = padded.view(B, -1, G).amax(-1).amax(0)  # [A/G] the most context keys a tile's block sees
    return Tiling(block_size, G, tile_keys, tuple(int(b) for b in bounds.tolist()))


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, prefix: torch.Tensor, scale: float, tiling: Tiling) -> torch.Tensor:
    """Exact anchor-block attention.

    q [B, nh, Q, hd] block queries (Q = A*Bk, block i = rows i*Bk..(i+1)*Bk-1); k_ctx [B, nkv, T, hd],
    v_ctx [B, nkv, T, dv] the context keys/values; k_blk [B, nkv, Q, hd], v_blk [B, nkv, Q, dv] the
    block tokens' own; prefix [B, A] int64: block i sees context keys 0..prefix[:, i]-1 (and its own
    Bk keys). Returns [B, nh, Q, dv] (a transposed view of a [B, Q, nh, dv] tensor: o_proj's
    input reshape is free)."""
    if torch.is_autocast_enabled(q.device.type):  # SDPA's inputs were cast by autocast: keep that
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k_ctx, v_ctx, k_blk, v_blk = (t.to(dtype) for t in (q, k_ctx, v_ctx, k_blk, v_blk))
    B, nh, Q, _ = q.shape
    if Q != prefix.shape[1] * tiling.block_size or nh % k_ctx.shape[1]:
        raise ValueError(f"block attention: {Q} rows for {prefix.shape[1]} blocks of {tiling.block_size}, "
                         f"{nh} heads over {k_ctx.shape[1]} kv heads")
    return _BlockAttention.apply(q, k_ctx, v_ctx, k_blk, v_blk, prefix, scale, tiling).transpose(1, 2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tiles(tiling: Tiling, A: int):
    """(tile index, first anchor, end anchor, first row, end row)."""
    G, Bk = tiling.anchors_per_tile, tiling.block_size
    for i, a0 in enumerate(range(0, A, G)):
        a1 = min(A, a0 + G)
        yield i, a0, a1, a0 * Bk, a1 * Bk


def _rows(x: torch.Tensor, r0: int, r1: int, nkv: int, acc) -> torch.Tensor:
    """x [B, nh, Q, d] -> rows r0..r1-1 as [B, nkv, g, R, d] in acc (g = nh / nkv query heads per kv head)."""
    B, nh, _, d = x.shape
    return x[:, :, r0:r1].to(acc).reshape(B, nkv, nh // nkv, r1 - r0, d).contiguous()


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, prefix, scale, tiling):
        B, nh, Q, hd = q.shape
        nkv, T, dv = k_ctx.shape[1], k_ctx.shape[2], v_ctx.shape[-1]
        g, Bk, acc = nh // nkv, tiling.block_size, _acc(q.dtype)
        out = q.new_empty(B, Q, nh, dv)
        lse = torch.empty(B, nh, Q, dtype=acc, device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            for i, a0, a1, r0, r1 in _tiles(tiling, prefix.shape[1]):
                n, R = a1 - a0, r1 - r0
                qt = _rows(q, r0, r1, nkv, acc)  # [B, nkv, g, R, hd]
                # in-block part first: every row has Bk keys there, so m is finite from the start
                kb = k_blk[:, :, r0:r1].to(acc).reshape(B, nkv, 1, n, Bk, hd)
                vb = v_blk[:, :, r0:r1].to(acc).reshape(B, nkv, 1, n, Bk, dv)
                s = qt.view(B, nkv, g, n, Bk, hd) @ kb.transpose(-1, -2) * scale  # [B, nkv, g, n, Bk, Bk]
                m = s.amax(-1)
                p = torch.exp(s - m[..., None])
                l = p.sum(-1).reshape(B, nkv, g, R)
                o = (p @ vb).reshape(B, nkv, g, R, dv)
                m = m.reshape(B, nkv, g, R)
                pre = prefix[:, a0:a1].repeat_interleave(Bk, 1)[:, None, None, :, None]  # [B, 1, 1, R, 1]
                q2 = qt.view(B, nkv, g * R, hd)
                for k0, k1 in _chunks(min(tiling.bounds[i], T), tiling.tile_keys):
                    s = _context_scores(q2, k_ctx[:, :, k0:k1].to(acc), k0, pre, scale)  # [B, nkv, g, R, c]
                    m_new = torch.maximum(m, s.amax(-1))
                    p = s.sub_(m_new[..., None]).exp_()  # in place: one tile; hidden keys exp(-inf) = 0
                    alpha = torch.exp(m - m_new)
                    l = l * alpha + p.sum(-1)
                    pv = p.view(B, nkv, g * R, k1 - k0) @ v_ctx[:, :, k0:k1].to(acc)
                    o = o * alpha[..., None] + pv.view(B, nkv, g, R, dv)
                    m = m_new
                out[:, r0:r1] = (o / l[..., None]).reshape(B, nh, R, dv).transpose(1, 2)
                lse[:, :, r0:r1] = (m + torch.log(l)).reshape(B, nh, R)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, prefix, out, lse)
        ctx.scale, ctx.tiling = scale, tiling
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k_ctx, v_ctx, k_blk, v_blk, prefix, out, lse = ctx.saved_tensors
        scale, tiling = ctx.scale, ctx.tiling
        B, nh, Q, hd = q.shape
        nkv, T, dv = k_ctx.shape[1], k_ctx.shape[2], v_ctx.shape[-1]
        g, Bk, acc = nh // nkv, tiling.block_size, _acc(q.dtype)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk_blk = torch.empty_like(k_blk, memory_format=torch.contiguous_format)
        dv_blk = torch.empty_like(v_blk, memory_format=torch.contiguous_format)
        # context grads sum over every tile that reads a key: accumulate in acc, cast once
        dk_ctx = torch.zeros(B, nkv, T, hd, dtype=acc, device=q.device)
        dv_ctx = torch.zeros(B, nkv, T, dv, dtype=acc, device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            for i, a0, a1, r0, r1 in _tiles(tiling, prefix.shape[1]):
                n, R = a1 - a0, r1 - r0
                qt = _rows(q, r0, r1, nkv, acc)  # [B, nkv, g, R, hd]
                do = grad_out[:, r0:r1].to(acc).transpose(1, 2).reshape(B, nkv, g, R, dv).contiguous()
                ot = out[:, r0:r1].to(acc).transpose(1, 2).reshape(B, nkv, g, R, dv)
                D = (do * ot).sum(-1)  # [B, nkv, g, R] = sum_k p_k dp_k, the softmax backward's row term
                L = lse[:, :, r0:r1].reshape(B, nkv, g, R)
                # in-block part
                kb = k_blk[:, :, r0:r1].to(acc).reshape(B, nkv, 1, n, Bk, hd)
                vb = v_blk[:, :, r0:r1].to(acc).reshape(B, nkv, 1, n, Bk, dv)
                qb, dob = qt.view(B, nkv, g, n, Bk, hd), do.view(B, nkv, g, n, Bk, dv)
                p = torch.exp(qb @ kb.transpose(-1, -2) * scale - L.view(B, nkv, g, n, Bk, 1))  # [B, nkv, g, n, Bk, Bk]
                dv_blk[:, :, r0:r1] = (p.transpose(-1, -2) @ dob).sum(2).reshape(B, nkv, R, dv)
                ds = p * (dob @ vb.transpose(-1, -2) - D.view(B, nkv, g, n, Bk, 1)) * scale
                dk_blk[:, :, r0:r1] = (ds.transpose(-1, -2) @ qb).sum(2).reshape(B, nkv, R, hd)
                dqt = (ds @ kb).reshape(B, nkv, g * R, hd)
                # context part
                pre = prefix[:, a0:a1].repeat_interleave(Bk, 1)[:, None, None, :, None]
                q2, do2 = qt.view(B, nkv, g * R, hd), do.view(B, nkv, g * R, dv)
                for k0, k1 in _chunks(min(tiling.bounds[i], T), tiling.tile_keys):
                    c = k1 - k0
                    kc, vc = k_ctx[:, :, k0:k1].to(acc), v_ctx[:, :, k0:k1].to(acc)
                    # in place throughout: at most two [B, nh, R, c] tiles (p, then dp -> dS) live at once
                    p = _context_scores(q2, kc, k0, pre, scale).sub_(L[..., None]).exp_()  # [B, nkv, g, R, c]
                    dv_ctx[:, :, k0:k1] += p.view(B, nkv, g * R, c).transpose(-1, -2) @ do2  # sums over g heads, R rows
                    dp = (do2 @ vc.transpose(-1, -2)).view(B, nkv, g, R, c)
                    ds = dp.sub_(D[..., None]).mul_(p).mul_(scale).view(B, nkv, g * R, c)
                    del p
                    dqt += ds @ kc
                    dk_ctx[:, :, k0:k1] += ds.transpose(-1, -2) @ q2
                dq[:, :, r0:r1] = dqt.view(B, nh, R, hd)
        return dq, dk_ctx.to(k_ctx.dtype), dv_ctx.to(v_ctx.dtype), dk_blk, dv_blk, None, None, None


def _chunks(n: int, size: int):
    return ((k0, min(n, k0 + size)) for k0 in range(0, n, size))


def _context_scores(q2: torch.Tensor, kc: torch.Tensor, k0: int, pre: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores of a tile's rows q2 [B, nkv, g*R, hd] against the context keys kc [B, nkv, c, hd] at
    k0..k0+c-1 -> [B, nkv, g, R, c], -inf where the key is at or past the row's prefix (pre [B, 1, 1, R, 1])."""
    B, nkv, _, _ = q2.shape
    R, c = pre.shape[3], kc.shape[2]
    s = (q2 @ kc.transpose(-1, -2)).view(B, nkv, -1, R, c).mul_(scale)
    hidden = torch.arange(k0, k0 + c, device=q2.device) >= pre  # [B, 1, 1, R, c]
    return s.masked_fill_(hidden, float("-inf"))


def dense_reference(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, prefix: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """The former implementation, kept for the tests and the benchmark only (training never calls
    it): K/V repeated to nh heads, the boolean mask [B, Q, T+Q] (context key < prefix | own block),
    one SDPA call. O(Q (T+Q)) memory."""
    B, nh, Q, _ = q.shape
    T, groups = k_ctx.shape[2], nh // k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(groups, dim=1)  # [B, nh, T+Q, hd]
    values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(groups, dim=1)
    owner = torch.arange(Q, device=q.device) // block_size  # [Q] each row's block
    ctx_visible = torch.arange(T, device=q.device) < prefix[:, owner, None]  # [B, Q, T]
    own_block = (owner[:, None] == owner[None, :]).expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx_visible, own_block], -1)  # [B, Q, T+Q]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=scale)
