"""DFlash training objective: random anchors, one block per anchor, all blocks of a sequence in
one forward, CE against the sequence's own tokens, weighted by position in the block.

For a sequence x[0..n-1] and an anchor a, the block is what the server drafts after committing
x[0..a-1] with x[a] the last accepted token (draft/dflash/model.py): context = the target states
of positions 0..a-1, block = [x[a], MASK x (B-1)] at positions a..a+B-1, and block position j
(1..B-1) is taught x[a+j]. It counts iff a+j <= n-1 and loss_mask[a+j].

Anchors: a in [1, n-2] (at least one context token and one label) with loss_mask[a+1] (the
first drafted token is supervised); up to `num_anchors` of them per sequence, drawn without
replacement by `sample_anchors` from a torch.Generator the caller owns (its state is what a
resume restores), sorted. A batch pads every sequence to the same anchor count A with invalid
anchors (no labels; they see only their own block, so no attention row is empty).

All A blocks of a sequence run as Q = A*B block tokens in one forward; each sees the context keys
at positions < its anchor (`prefix` = the anchor; 0 for an invalid one) and the B tokens of its
own block (both directions). The model computes that attention in bounded tiles
(draft/dflash/block_attention.py): no [Q, T+Q] mask is built.

Loss: CE_j = mean over counted positions of block position j of the token loss
    l = (1 - d) * -log q(x[a+j])  +  d * sum_v -p(v) log q(v)
(q over the full target vocab, through the target's lm_head; p the target's own distribution for
position a+j, its lm_head on its final state at a+j-1; d = draft.distill, 0 by default: no p is
computed), logits in chunks of `logits_chunk` rows, each chunk recomputed in backward (only its
hidden rows stay saved); with the lm_head's rows split over co-located ranks (a VocabShard
attached) the ranks compute the same l together (train/vocab_parallel.py).
total = sum_j w_j CE_j / sum_j w_j with w_j = exp(-(j-1)/gamma), or the weights given (draft.loss_weights): a position-weighted mean, equal to the weighted mean over all
counted tokens when every position counts as many tokens. Distillation teaches the whole
distribution where the sequence shows one token of it: for greedy regenerated data the label is
the target's argmax, so d = 0 teaches that argmax only.

Counters (draft/objective.py LossResult, index k = block position k+1, so train/metrics.py's acc_k is
the k+1-th drafted token): counted = scored = the positions in CE_j; correct = argmax q == the
label; alpha_sum = sum of q(label) (Σ_v min(p, q) with p the label's one-hot: the sequence's
token stands for the target's choice, which it is for regenerated data); ploss = the mean token
loss l (the hard CE when d = 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..objective import LossResult
from ..layers import at_least_fp32


@dataclass
class BlockInputs:
    block_ids: torch.Tensor  # [B, Q] int64, Q = A*Bk: [x[a], MASK, ...] per anchor
    block_positions: torch.Tensor  # [B, Q] a + j
    labels: torch.Tensor  # [B, Q] x[a+j] (clamped index where out of range)
    counted: torch.Tensor  # [B, Q] bool: enters the loss (j >= 1, in range, loss_mask, valid anchor)
    offset: torch.Tensor  # [Q] j, the position in the block
    prefix: torch.Tensor  # [B, A] int64: block i sees context positions < prefix[:, i] (its anchor; 0 if invalid)


def anchor_candidates(loss_mask: torch.Tensor, length: int) -> torch.Tensor:
    """loss_mask [T] of one sequence of `length` tokens -> the anchors it allows (module doc)."""
    a = torch.arange(1, max(length - 1, 1), device=loss_mask.device)
    return a[loss_mask[a + 1]] if a.numel() else a


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> anchors [B, A] int64 (sorted per sequence, 0 where padded), valid [B, A] bool, with
    A = min(num_anchors, the most candidates any sequence has), at least 1. Draws one randperm
    per sequence from `generator` (CPU generators: one for the batch, or one per sequence, whose
    picks, min(its candidates, num_anchors) of them, then depend on nothing else in the batch;
    the result moves to loss_mask's device)."""
    cands = [anchor_candidates(loss_mask[b].cpu(), int(n)) for b, n in enumerate(lengths.tolist())]
    A = max(1, min(num_anchors, max(c.numel() for c in cands)))
    anchors = torch.zeros(len(cands), A, dtype=torch.int64)
    valid = torch.zeros(len(cands), A, dtype=torch.bool)
    for b, c in enumerate(cands):
        g = generator[b] if isinstance(generator, (list, tuple)) else generator
        pick = c[torch.randperm(c.numel(), generator=g)[:A]].sort().values
        anchors[b, :pick.numel()] = pick
        valid[b, :pick.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def window_anchors(anchors: torch.Tensor, valid: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Context parallelism: `valid` [B, A] kept only for the anchors in this rank's window
    [start, start + length): the anchors are drawn over the whole sequences alike on every rank of
    the group (the same seeds), and each block runs on the rank that holds its anchor's
    position, so every block runs exactly once and the summed loss is one rank's on whole sequences."""
    return valid & (anchors >= start) & (anchors < start + length)


def block_inputs(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, block_size: int, mask_token_id: int) -> BlockInputs:
    B, T = input_ids.shape
    A, Bk, dev = anchors.shape[1], block_size, input_ids.device
    j = torch.arange(Bk, device=dev)
    pos = anchors[:, :, None] + j  # [B, A, Bk]
    idx = pos.clamp(max=T - 1).reshape(B, -1)
    block_ids = torch.full((B, A, Bk), mask_token_id, dtype=torch.int64, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    labels = input_ids.gather(1, idx)  # [B, Q]
    counted = (valid[:, :, None] & (j >= 1) & (pos <= lengths[:, None, None] - 1)).reshape(B, -1)
    counted &= loss_mask.gather(1, idx)
    prefix = torch.where(valid, anchors, 0)  # context positions 0..a-1; an invalid anchor sees only its block
    return BlockInputs(block_ids.reshape(B, -1), pos.reshape(B, -1), labels, counted, j.repeat(A), prefix)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[Bk-1] w_j = exp(-(j-1)/gamma) for block positions j = 1..Bk-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float64, device=device) / gamma)


def loss_positions(loss_mask, lengths, anchors, valid, block_size: int) -> torch.Tensor:
    """[Bk-1] int64: counted positions per block position 1..Bk-1 (known before the draft runs)."""
    zeros = torch.zeros_like(loss_mask, dtype=torch.int64)
    inp = block_inputs(zeros, loss_mask, lengths, anchors, valid, block_size, 0)
    k = inp.offset.expand_as(inp.counted)[inp.counted] - 1
    return torch.bincount(k, minlength=block_size - 1)[:block_size - 1]


def dflash_loss(model, aux_hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                normalizer: torch.Tensor | None = None, checkpoint: bool = False, *,
                weights: list | torch.Tensor | None = None, distill: float = 0.0,
                final_hidden: torch.Tensor | None = None, seq=None) -> LossResult:
    """aux_hidden [B, T, K*Ht], input_ids / loss_mask [B, T] right-padded, lengths [B], anchors /
    valid [B, A] (sample_anchors) -> LossResult over block positions 1..Bk-1.

    normalizer [Bk-1]: divide position j's summed CE by normalizer[j-1] (the count summed over
    data-parallel ranks, `loss_positions`) instead of this batch's own count.
    checkpoint: recompute each draft layer in backward.
    weights [Bk-1]: the positions' weights (null: exp(-(j-1)/cfg.loss_gamma)).
    distill: the soft-CE share d (module doc); > 0 needs final_hidden [B, T, Ht], the target's
    final states (after its norm), from which the teacher's logits are computed chunk by chunk.
    seq (context parallelism, train/context_parallel.py SeqShard): aux_hidden (and final_hidden) hold
    this rank's window of the positions from seq.start on, input_ids / loss_mask the whole padded
    sequences; the anchors outside the window are invalid here (`window_anchors`: another rank
    runs their blocks)."""
    cfg = model.cfg
    Bk, dev = cfg.block_size, input_ids.device
    B, T = input_ids.shape
    inp = block_inputs(input_ids, loss_mask, lengths, anchors, valid, Bk, cfg.mask_token_id)
    start = seq.start if seq is not None else 0  # the first position aux_hidden holds
    ctx_positions = (start + torch.arange(aux_hidden.shape[1], device=dev)).expand(B, -1)
    hidden = model(aux_hidden, ctx_positions, inp.block_ids, inp.block_positions, checkpoint=checkpoint,
                   prefix=inp.prefix, seq=seq)
    rows = inp.counted.nonzero(as_tuple=True)
    h = hidden[rows]  # [N, H] the counted block tokens only
    labels = inp.labels[rows]  # [N]
    k = inp.offset[rows[1]] - 1  # [N] block position - 1
    if distill > 0:
        if final_hidden is None:
            raise ValueError("draft.distill > 0 needs the target's final hidden states (DraftBatch.final_hidden)")
        # the target's distribution for x[a+j] comes from its final state at a+j-1 (>= a >= 1)
        teacher_rows = final_hidden[rows[0], inp.block_positions[rows] - 1 - start]  # [N, Ht]
    else:
        teacher_rows = h.new_zeros(h.shape[0], 0)

    def chunk_stats(h_chunk, labels_chunk, teacher_chunk):
        logits = model.logits(h_chunk)
        logits = logits.to(at_least_fp32(logits.dtype))  # [c, V]
        logq = F.log_softmax(logits, -1)
        ce = -logq.gather(1, labels_chunk[:, None])[:, 0]
        if distill > 0:
            with torch.no_grad():  # the target's logits, as it computes them (its lm_head's dtype)
                p = torch.softmax(model.logits(teacher_chunk).to(logq.dtype), -1)
            ce = (1 - distill) * ce + distill * -(p * logq).sum(-1)
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels_chunk).to(torch.int64)
        return ce, correct

    shard = getattr(model, "vocab_shard", None)
    if shard is not None:  # the head's rows split over the ranks: they score their tokens together
        ce, correct = shard.token_losses(h, labels, teacher_rows, distill, cfg.logits_chunk)
    else:
        ces, corrects = [], []
        for s in range(0, h.shape[0], cfg.logits_chunk):
            args = (h[s:s + cfg.logits_chunk], labels[s:s + cfg.logits_chunk], teacher_rows[s:s + cfg.logits_chunk])
            if torch.is_grad_enabled():
                ce, correct = torch.utils.checkpoint.checkpoint(chunk_stats, *args, use_reentrant=False)
            else:
                ce, correct = chunk_stats(*args)
            ces.append(ce)
            corrects.append(correct)
        ce = torch.cat(ces) if ces else hidden.new_zeros(0, dtype=at_least_fp32(hidden.dtype))
        correct = torch.cat(corrects) if corrects else torch.zeros(0, dtype=torch.int64, device=dev)

    P = Bk - 1
    ce_sum = torch.zeros(P, dtype=ce.dtype, device=dev).index_add(0, k, ce)  # differentiable
    counted = torch.bincount(k, minlength=P)[:P]
    with torch.no_grad():
        correct_sum = torch.bincount(k, weights=correct.double(), minlength=P)[:P].to(torch.int64)
        alpha_sum = torch.zeros(P, dtype=torch.float32, device=dev).index_add(0, k, torch.exp(-ce.detach()).float())
    w = (position_weights(Bk, cfg.loss_gamma, dev) if weights is None
         else torch.as_tensor(weights, dtype=torch.float64, device=dev)).to(ce.dtype)
    if w.shape != (P,):
        raise ValueError(f"{w.numel()} position weights for block positions 1..{P}: give {P}")
    denom = (normalizer if normalizer is not None else counted).clamp(min=1).to(ce.dtype)
    loss = (w * ce_sum / denom).sum() / w.sum()
    if h.shape[0] == 0:
        loss = loss + 0 * hidden.sum()  # keep the graph (a rank without counted positions still backpropagates)
    return LossResult(loss, ce_sum.detach() / counted.clamp(min=1), counted, correct_sum, counted.clone(), alpha_sum)

