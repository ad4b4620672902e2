"""What every method's objective shares: the target's distribution where a loss reads it
(`Teacher`, computed in chunks from the final hidden states), the per-position counters a loss
returns (`LossResult`: index k is EAGLE-3's TTT step k, DFlash's block position k+1; train/metrics.py
sums them) and the simulated acceptance length they give."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .vocab import draft_to_target, target_to_draft


@dataclass
class Teacher:
    """The target's next-token distribution at every position, restricted to what the loss needs.

    draft_logits:    [B, T, Vd] fp32  target logits at the draft-vocab columns
    logsumexp:       [B, T]     fp32  logsumexp over the full target vocab
    argmax_draft_id: [B, T]     int64 target argmax as a draft id, -1 if not a draft token
    """

    draft_logits: torch.Tensor
    logsumexp: torch.Tensor
    argmax_draft_id: torch.Tensor


@torch.no_grad()
def compute_teacher(final_hidden: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor, chunk: int = 1024) -> Teacher:
    """final_hidden [B, T, Ht], lm_head [V, Ht] -> Teacher, never holding more than [chunk, V] logits.

    The logits are computed in lm_head's dtype (bf16 for a bf16 target: what the serving engine
    computes, fp32 accumulation) and kept in fp32."""
    B, T, _ = final_hidden.shape
    V = lm_head.shape[0]
    draft_ids = draft_to_target(d2t)
    t2d_index = target_to_draft(d2t, V)
    flat = final_hidden.reshape(B * T, -1)
    draft_logits = torch.empty(B * T, d2t.numel(), dtype=torch.float32, device=flat.device)
    lse = torch.empty(B * T, dtype=torch.float32, device=flat.device)
    argmax = torch.empty(B * T, dtype=torch.int64, device=flat.device)
    for start in range(0, B * T, chunk):
        logits = (flat[start:start + chunk].to(lm_head.dtype) @ lm_head.T).float()  # [c, V]
        lse[start:start + chunk] = torch.logsumexp(logits, -1)
        argmax[start:start + chunk] = logits.argmax(-1)
        draft_logits[start:start + chunk] = logits[:, draft_ids]
    return Teacher(draft_logits.view(B, T, -1), lse.view(B, T), t2d_index[argmax].view(B, T))


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """out[:, t] = x[:, t+n], `fill` past the end. x [B, T, ...]."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar, Σ_k decay^k ploss_k
    ploss: torch.Tensor  # [K] per-step mean soft-CE over counted positions (detached)
    counted: torch.Tensor  # [K] positions in the loss
    correct: torch.Tensor  # [K] positions where the draft argmax equals the target argmax
    scored: torch.Tensor  # [K] positions in acc_k's denominator
    alpha_sum: torch.Tensor  # [K] Σ over scored positions of Σ_v min(p_target(v), q(v))


def simulated_acceptance_length(acc: list[float] | torch.Tensor) -> float:
    """τ_sim = 1 + Σ_k Π_{j<=k} acc_j (1 = the bonus token, as in SGLang's accept length)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= float(a)
        tau += run
    return tau
