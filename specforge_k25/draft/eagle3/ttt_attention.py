"""TTT attention without the dense [T, (k+1)T] mask (issue 22, item 1).

At TTT step k query t sees step 0's keys at positions <= t (causal) and, for each step j in 1..k,
the key of position t only (docs/EAGLE3.md §3). Written as one softmax over all of these:

    out_t = (sum_{i<=t} e^{s_ti} v_i + sum_j e^{d_tj} u_tj) / (sum_{i<=t} e^{s_ti} + sum_j e^{d_tj})

with s_ti = scale q_t.k_i (step 0) and d_tj = scale q_t.k^(j)_t, u_tj = v^(j)_t (the k diagonal
terms, O(kT) per head). The causal part is one SDPA call with is_causal=True and no mask, so CPU
and GPU pick their flash / memory-efficient kernels; the k diagonal terms enter that same call as
one extra "sink" key per query whose score is their log-sum-exp D_t = logsumexp_j d_tj:

    q'_t = [q_t, D_t/scale]   k'_i = [k_i, 0]   v'_i = [v_i, 0]   (step-0 keys)
    sink key [0, 1], sink value [0, 1]

so the kernel's own online softmax merges the two parts exactly, in log space:
out'_t = [Z_c/Z O_c, e^D/Z] with Z = Z_c + e^D, and out_t = out'_t[:dv] + out'_t[dv] * U_t,
U_t = sum_j softmax_j(d_tj) u_tj. Everything is ordinary differentiable torch, so autograd
gives the exact gradients through SDPA's own backward.

Why not take the causal call's log-sum-exp and merge by hand: in torch 2.13 the aten SDPA ops
that return it (`_scaled_dot_product_flash_attention_for_cpu`, the CUDA flash / efficient ops)
return it without a gradient (the merge needs d lse / d(q, k)), and flex_attention has no
backward on CPU (and in eager mode it materialises the [T, T] scores). The sink needs neither.

The sink has to be visible to every query while the step-0 keys stay causal: one leading dummy
query row (zeros, output dropped) shifts is_causal's top-left diagonal by one, so query t+1 of
the padded call sees keys 0..t+1 = the sink and step-0 keys 0..t. No [T, (k+1)T] or [T, T+1]
tensor is ever built; extra memory is O((k+1) T nh hd).

D_t/scale rides in q's dtype; for bf16/fp16 it is split into two columns hi + lo (the sink key is
[1, 1] there), so the kernel's fp32 accumulation sees D_t to fp32 precision, not bf16's 8 bits.
The feature dims are padded with zeros to a multiple of 8 (GPU flash kernels want that; zeros
change no score). GQA: the sink key and value are the same for every query head, so k'/v' keep
nkv heads and SDPA broadcasts them (enable_gqa) where a fused kernel can (`native_gqa`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# the augmented head dim is rounded up to this (zero columns; exact)
_DIM_MULTIPLE = 8


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16, float64 stays float64 (same rule as draft/layers.py::at_least_fp32)."""
    return torch.promote_types(dtype, torch.float32)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Exact TTT attention of one unroll step k = len(keys) - 1.

    q [B, nh, T, dq]; keys[j] [B, nkv, T, dq], values[j] [B, nkv, T, dv] for steps j = 0..k
    (step 0 first); nh a multiple of nkv (GQA: query head h reads kv head h // (nh/nkv), as
    repeat_interleave). Returns [B, nh, T, dv] in q's dtype.
    """
    B, nh, T, dq = q.shape
    nkv, dv = keys[0].shape[1], values[0].shape[-1]
    if len(keys) == 1:  # step 0: plain causal attention
        if dq == dv:
            return _causal_sdpa(q, keys[0], values[0], scale)
        # MLA (dq = dn+dr > dv): SDPA's CPU flash kernel wants one head dim for q, k, v, else it
        # falls back to the math path and its [T, T] scores; zero columns cost less than that
        W = _round_up(max(dq, dv))
        return _causal_sdpa(_pad_cols(q, W), _pad_cols(keys[0], W), _pad_cols(values[0], W), scale)[..., :dv]

    g = nh // nkv
    acc = _acc_dtype(q.dtype)
    qg = q.to(acc).unflatten(1, (nkv, g))  # [B, nkv, g, T, dq]
    # d [B, nkv, g, T, k]: scale q_t . k^(j)_t, each an O(T) per-position dot product. Elementwise
    # products and sums, not einsum/bmm: O(kT) work either way, and torch's flop counter then sees
    # only the SDPA call (the plan's FLOP count, draft/eagle3/plan.py, is checked against it)
    d = torch.stack([(qg * kj.to(acc)[:, :, None]).sum(-1) for kj in keys[1:]], -1) * scale
    lse_d = torch.logsumexp(d, -1)  # [B, nkv, g, T]
    w = torch.softmax(d, -1)  # [B, nkv, g, T, k]
    vs = torch.stack([vj.to(acc) for vj in values[1:]], -2)  # [B, nkv, T, k, dv]
    u = (w[..., None] * vs[:, :, None]).sum(-2).flatten(1, 2)  # [B, nh, T, dv]

    # the sink's score column(s) of q': D/scale, as hi (+ lo when q's dtype is coarser than fp32)
    c = (lse_d / scale).flatten(1, 2)[..., None]  # [B, nh, T, 1]
    hi = c.to(q.dtype)
    cols = [hi, (c - hi.to(acc)).to(q.dtype)] if torch.finfo(q.dtype).bits < 32 else [hi]
    n = len(cols)
    W = _round_up(max(dq + n, dv + 1))  # one head dim for q', k', v' (flash kernels want that)

    # leading dummy row (zeros) then the T real rows: [B, *, T+1, W]
    q_aug = F.pad(_pad_cols(torch.cat([q, *cols], -1), W), (0, 0, 1, 0))
    sink_k = q.new_zeros(W)
    sink_k[dq:dq + n] = 1.0
    k_aug = torch.cat([sink_k.expand(B, nkv, 1, W), _pad_cols(keys[0], W)], 2)
    sink_v = q.new_zeros(W)
    sink_v[dv] = 1.0
    v_aug = torch.cat([sink_v.expand(B, nkv, 1, W), _pad_cols(values[0], W)], 2)
    out = _causal_sdpa(q_aug, k_aug, v_aug, scale)
    out = out[:, :, 1:]  # [B, nh, T, W], the dummy row dropped
    # out[..., :dv] = Z_c/Z O_c, out[..., dv] = e^D/Z: add the diagonal steps' share. The weight
    # column is taken alone before the cast, so backward keeps [B, nh, T, 1] of it, not all W columns
    share = out[..., dv:dv + 1].to(acc)
    return (out[..., :dv].to(acc) + share * u).to(q.dtype)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """is_causal SDPA, q [B, nh, L, W], k/v [B, nkv, L, W]: GQA natively where a fused kernel takes
    it, else k/v repeated to nh heads (what the dense path always did)."""
    nh, nkv = q.shape[1], k.shape[1]
    if nh != nkv and not native_gqa(q):
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=nh != k.shape[1])


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA's fused kernels take nkv < nh heads (enable_gqa) for this q [B, nh, L, W]. In
    torch 2.13: the CPU flash kernel does (every dtype); on CUDA only the flash kernel does (fp16 /
    bf16, head dim <= 256), and with enable_gqa in any other case SDPA falls back to its math path,
    which builds the [L, L] scores this module exists to avoid."""
    if q.device.type == "cpu":
        return True
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _round_up(n: int) -> int:
    return -(-n // _DIM_MULTIPLE) * _DIM_MULTIPLE


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns on the right of the last dim (no copy when already that wide)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def ttt_attention_dense_reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                                  scale: float) -> torch.Tensor:
    """The former implementation, kept as the tests' and benchmark's reference: one SDPA call over
    all steps' keys side by side [B, nh, (k+1)T, dq] with the dense bool mask [causal | eye | ... | eye]
    [T, (k+1)T]. O((k+1) T^2) memory and compute."""
    T = q.shape[2]
    groups = q.shape[1] // keys[0].shape[1]
    K = torch.cat(keys, 2).repeat_interleave(groups, dim=1)  # [B, nh, (k+1)T, dq]
    V = torch.cat(values, 2).repeat_interleave(groups, dim=1)
    eye = torch.eye(T, dtype=torch.bool, device=q.device)
    mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=q.device).tril()] + [eye] * (len(keys) - 1), -1)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scale)
