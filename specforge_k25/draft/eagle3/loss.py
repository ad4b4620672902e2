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

import torch
import torch.nn.functional as F

from ..layers import at_least_fp32
from ..objective import Teacher, LossResult, shift


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
    scored = _window(in_range & shift(loss_mask, k + 2, False), seq, L)
    target_draft_id = shift(teacher.argmax_draft_id, k + 1, -1)[:, :L]  # the teacher starts at the window
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
) -> LossResult:
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
        step_ids = _window(shift(input_ids, k + 1, 0), seq, T)  # x[t+k+1]
        positions = (pos + k).expand(B, T)
        scored, target_draft_id, counted = _step_masks(k, loss_mask, lengths, teacher, seq)
        z = shift(teacher.draft_logits, k + 1, 0.0)[:, :T]  # [B, T, Vd]
        lse = shift(teacher.logsumexp, k + 1, 0.0)[:, :T]  # [B, T]

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
    return LossResult(loss, *(torch.stack(stats[n]) for n in ("ploss", "counted", "correct", "scored", "alpha_sum")))
