"""One micro-batch of draft training or evaluation, from packed target hidden states."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft.loss import Teacher, TTTResult, compute_teacher, ttt_loss
from ..draft.model import Eagle3Draft


@dataclass
class DraftBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B]
    aux_hidden: torch.Tensor  # [B, T, 3Ht] fp32
    teacher: Teacher

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def pad_packed(packed: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """packed [sum(lengths), D] -> [B, max(lengths), D] zero-padded on the right."""
    out = packed.new_zeros(len(lengths), max(lengths), packed.shape[-1])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = packed[start:start + n]
        start += n
    return out


class DraftTrainer:
    """Owns the draft, the frozen target lm_head, the optimizer and the schedule."""

    def __init__(self, draft: Eagle3Draft, lm_head: torch.Tensor, optimizer, scheduler, *, ttt_length: int,
                 loss_decay: float, grad_accum: int, grad_clip: float, teacher_chunk: int, autocast_bf16: bool):
        self.draft, self.lm_head, self.optimizer, self.scheduler = draft, lm_head, optimizer, scheduler
        self.ttt_length, self.loss_decay, self.grad_accum = ttt_length, loss_decay, grad_accum
        self.grad_clip, self.teacher_chunk = grad_clip, teacher_chunk
        self.device = lm_head.device
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast_bf16)

    def make_batch(self, samples, lengths: list[int], aux_packed: torch.Tensor, final_packed: torch.Tensor) -> DraftBatch:
        """samples: the `Sample`s of the batch, in stream order; the packed tensors may be views
        into shared memory: everything kept is copied, so the slot can be released afterwards."""
        dev = self.device
        pad = torch.nn.utils.rnn.pad_sequence
        input_ids = pad([s.input_ids for s in samples], batch_first=True, padding_value=0).to(dev)
        loss_mask = pad([s.loss_mask for s in samples], batch_first=True, padding_value=False).to(dev)
        aux = pad_packed(aux_packed, lengths).to(dev, torch.float32)
        final = pad_packed(final_packed, lengths).to(dev, torch.float32)
        teacher = compute_teacher(final, self.lm_head, self.draft.d2t, self.teacher_chunk)
        return DraftBatch(input_ids, loss_mask, torch.tensor(lengths, device=dev), aux, teacher)

    def _loss(self, batch: DraftBatch) -> TTTResult:
        with self.autocast():
            return ttt_loss(self.draft, batch.aux_hidden, batch.input_ids, batch.loss_mask, batch.lengths,
                            batch.teacher, self.ttt_length, self.loss_decay)

    def train_micro(self, batch: DraftBatch) -> TTTResult:
        res = self._loss(batch)
        (res.loss / self.grad_accum).backward()
        return res

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.trainable_parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(grad_norm)

    @torch.no_grad()
    def evaluate(self, batch: DraftBatch) -> TTTResult:
        return self._loss(batch)
