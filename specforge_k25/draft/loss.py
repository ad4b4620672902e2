"""Training-time-test (TTT) objective of EAGLE-3 (docs/EAGLE3.md §3) and its metrics.

Indices for one sequence x[0..T-1]: at step k, position t, the draft reads token x[t+k+1],
predicts x[t+k+2], and is taught by the target's logits z[t+k+1]. A position counts toward
the loss iff t+k+2 <= T-1, loss_mask[t+k+2] and argmax z[t+k+1] is a draft token; toward
acc_k iff the first two hold (a target argmax outside the draft vocab is a miss).

Context parallelism (train/context_parallel.py: `seq`, its start and length L): a rank holding positions [s, s+L) of the
sequences gets the ids and loss mask of the whole (padded) sequences, its own L positions of the
aux states and the teacher of positions [s, s+L+K) (the K later ones the shifts read); every mask
and shift is the single-rank one, cut to its window, so the ranks' counts and summed losses add up
to one rank's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import at_least_fp32
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


def _shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """out[:, t] = x[:, t+n], `fill` past the end. x [B, T, ...]."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, Σ_k decay^k ploss_k
    ploss: torch.Tensor  # [K] per-step mean soft-CE over counted positions (detached)
    counted: torch.Tensor  # [K] positions in the loss
    correct: torch.Tensor  # [K] positions where the draft argmax equals the target argmax
    scored: torch.Tensor  # [K] positions in acc_k's denominator
    alpha_sum: torch.Tensor  # [K] Σ over scored positions of Σ_v min(p_target(v), q(v))


def _window(x: torch.Tensor, seq, length: int) -> torch.Tensor:
    """x [B, T, ...] -> this rank's positions [B, length, ...] (from its start with `seq`)."""
    start = seq.start if seq is not None else 0
    return x[:, start:start + length]


def _step_masks(k: int, loss_mask: torch.Tensor, lengths: torch.Tensor, teacher: Teacher, seq=None):
    """TTT step k -> (scored, target draft id, counted), each [B, L] over this rank's positions
    (all T without `seq`): which positions enter acc_k and which the loss (see the module doc)."""
    L = seq.length if seq is not None else loss_mask.shape[1]
    pos = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    in_range = (pos[None] + k + 2) <= (lengths[:, None] - 1)  # [B, T]
    scored = _window(in_range & _shift(loss_mask, k + 2, False), seq, L)
    target_draft_id = _shift(teacher.argmax_draft_id, k + 1, -1)[:, :L]  # the teacher starts at the window
    return scored, target_draft_id, scored & (target_draft_id >= 0)


def loss_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, teacher: Teacher, ttt_length: int,
                   seq=None) -> torch.Tensor:
    """[K] int64: positions each TTT step counts in the loss (ttt_loss's `counted`), this rank's
    window's with `seq`. They depend on the data and the teacher only, so they are known before
    the draft runs."""
    return torch.stack([_step_masks(k, loss_mask, lengths, teacher, seq)[2].sum() for k in range(ttt_length)])


def ttt_loss(
    draft,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    teacher: Teacher,
    ttt_length: int = 7,
    decay: float = 0.8,
    normalizer: torch.Tensor | None = None,
    checkpoint: bool = False,
    seq=None,
) -> TTTResult:
    """aux_hidden [B, T, 3Ht], input_ids/loss_mask [B, T] (right-padded), lengths [B].

    seq: context parallelism: aux_hidden [B, L, 3Ht] and the teacher are this rank's window
    (module doc), input_ids/loss_mask the whole padded sequences [B, C L]; the draft's attention
    exchanges with the other ranks of `seq.group`, which run the same call on their windows.

    normalizer [K]: divide step k's summed soft-CE by normalizer[k] instead of this batch's own
    count of loss positions. Data-parallel ranks pass the count summed over all ranks
    (`loss_positions`), so their losses (and gradients) add up to the loss of the global batch.
    `ploss` and the counters stay this batch's own.

    checkpoint: recompute each TTT step (draft layer, logits, log-softmax, soft-CE) in backward
    instead of keeping its activations; only the steps' inputs and K/V stay saved. Same loss and
    gradients, about one more forward of compute.
    """
    B, T = aux_hidden.shape[:2]  # this rank's positions (all of them without `seq`)
    pos = torch.arange(T, device=input_ids.device) + (seq.start if seq is not None else 0)
    hidden = draft.project(aux_hidden)  # [B, T, H]
    past: list = []  # (K_j, V_j) of the steps so far
    loss = hidden.new_zeros((), dtype=at_least_fp32(hidden.dtype))
    stats = {name: [] for name in ("ploss", "counted", "correct", "scored", "alpha_sum")}
    for k in range(ttt_length):
        step_ids = _window(_shift(input_ids, k + 1, 0), seq, T)  # x[t+k+1]
        positions = (pos + k).expand(B, T)
        scored, target_draft_id, counted = _step_masks(k, loss_mask, lengths, teacher, seq)
        z = _shift(teacher.draft_logits, k + 1, 0.0)[:, :T]  # [B, T, Vd]
        lse = _shift(teacher.logsumexp, k + 1, 0.0)[:, :T]  # [B, T]

        # default arguments bind this step's tensors: backward re-runs the function after the loop
        def one_step(hidden, *past_flat, step_ids=step_ids, positions=positions, z=z, lse=lse, counted=counted,
                     scored=scored, target_draft_id=target_draft_id):
            hidden, kv = draft.step(step_ids, hidden, positions, list(zip(past_flat[::2], past_flat[1::2])), seq)
            logits = draft.logits(hidden)
            logq = F.log_softmax(logits.to(at_least_fp32(logits.dtype)), -1)  # [B, T, Vd]
            p_hat = torch.softmax(z, -1)  # teacher renormalised over the draft vocab
            ce_sum = (-(p_hat * logq).sum(-1) * counted).sum()
            with torch.no_grad():
                p_target = torch.exp(z - lse[..., None])  # target mass on draft tokens
                alpha_sum = (torch.minimum(p_target, logq.exp()).sum(-1) * scored).sum()
                correct = ((logq.argmax(-1) == target_draft_id) & scored & (target_draft_id >= 0)).sum()
            return hidden, *kv, ce_sum, correct, alpha_sum

        past_flat = [t for kv in past for t in kv]
        if checkpoint and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(one_step, hidden, *past_flat, use_reentrant=False)
        else:
            out = one_step(hidden, *past_flat)
        hidden, k_new, v_new, ce_sum, correct, alpha_sum = out
        past.append((k_new, v_new))
        n_counted = counted.sum()
        ploss = ce_sum / n_counted.clamp(min=1)
        loss = loss + decay**k * (ploss if normalizer is None else ce_sum / normalizer[k].clamp(min=1))
        stats["ploss"].append(ploss.detach())
        stats["counted"].append(n_counted)
        stats["correct"].append(correct)
        stats["scored"].append(scored.sum())
        stats["alpha_sum"].append(alpha_sum)
    return TTTResult(loss, *(torch.stack(stats[n]) for n in ("ploss", "counted", "correct", "scored", "alpha_sum")))


def simulated_acceptance_length(acc: list[float] | torch.Tensor) -> float:
    """τ_sim = 1 + Σ_k Π_{j<=k} acc_j (1 = the bonus token, as in SGLang's accept length)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= float(a)
        tau += run
    return tau
