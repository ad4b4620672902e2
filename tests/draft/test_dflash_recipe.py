"""DFlash's recipe options (draft.loss_weights, draft.distill) against losses computed by hand."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from specforge_k25.draft.dflash import loss as dl
from specforge_k25.draft.dflash.config import DFlashSpec
from specforge_k25.draft.dflash.method import check_objective
from specforge_k25.draft.method import DraftBatch
from specforge_k25.draft.registry import get_method

LN3 = math.log(3.0)


class LogitsAreHidden(torch.nn.Module):
    """A stand-in draft over a 2-token vocab whose block outputs are fixed logits and whose lm_head
    is the identity: the target's logits at a position are its `final_hidden` row itself."""

    def __init__(self, block_logits: torch.Tensor):
        super().__init__()
        self.cfg = SimpleNamespace(block_size=3, mask_token_id=1, logits_chunk=1, loss_gamma=4.0)
        self.h = torch.nn.Parameter(block_logits)

    def forward(self, aux, ctx_positions, block_ids, block_positions, checkpoint=False, prefix=None, seq=None):
        return self.h

    def logits(self, hidden):
        return hidden


def hand_case():
    """x = [0, 1, 0, 1], one block of 3 at anchor 1: position 1 is taught x[2] = 0, position 2 x[3] = 1.
    Draft logits: position 1 [ln 3, 0] (q = 3/4, 1/4), position 2 [0, 0] (q = 1/2, 1/2).
    Target logits (its state before the taught token): at 1 [0, 0] (p = 1/2, 1/2), at 2 [ln 3, 0]
    (p = 3/4, 1/4); at 0 and 3, which no position reads, far-off values (a shifted read shows)."""
    block = torch.tensor([[[9.0, -9.0], [LN3, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    final = torch.tensor([[[50.0, -50.0], [0.0, 0.0], [LN3, 0.0], [-50.0, 50.0]]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 0, 1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    return LogitsAreHidden(block), ids, mask, torch.tensor([4]), torch.tensor([[1]]), torch.tensor([[True]]), final


def _loss(**kw):
    model, ids, mask, lengths, anchors, valid, final = hand_case()
    return dl.dflash_loss(model, torch.zeros(1, 4, 0, dtype=torch.float64), ids, mask, lengths, anchors, valid,
                          final_hidden=final, **kw)


def test_hard_labels_with_given_position_weights():
    # CE_1 = -ln 3/4, CE_2 = ln 2; weights 3 : 1
    out = _loss(weights=[3.0, 1.0])
    assert out.loss.item() == pytest.approx((3 * -math.log(0.75) + math.log(2)) / 4, rel=1e-12)
    assert out.ploss.tolist() == pytest.approx([-math.log(0.75), math.log(2)], rel=1e-12)
    assert out.correct.tolist() == [1, 0]  # argmax [ln 3, 0] = 0 = x[2]; [0, 0] -> 0 != x[3]


def test_default_rule_is_the_gamma_decay():
    w2 = math.exp(-1 / 4.0)  # loss_gamma 4: w_1 = 1, w_2 = e^(-1/4)
    out = _loss()
    assert out.loss.item() == pytest.approx((-math.log(0.75) + w2 * math.log(2)) / (1 + w2), rel=1e-12)


def test_distillation_mixed_with_the_hard_labels():
    # d = 1/2: l_1 = 1/2 (-ln 3/4) + 1/2 (-(1/2 ln 3/4 + 1/2 ln 1/4)); l_2 = 1/2 ln 2 + 1/2 ln 2 (q uniform)
    l1 = 0.5 * -math.log(0.75) + 0.5 * -(0.5 * math.log(0.75) + 0.5 * math.log(0.25))
    l2 = math.log(2)
    out = _loss(weights=[3.0, 1.0], distill=0.5)
    assert out.loss.item() == pytest.approx((3 * l1 + l2) / 4, rel=1e-12)
    assert out.ploss.tolist() == pytest.approx([l1, l2], rel=1e-12)
    # distillation alone (position 2 weighed 0): the soft CE only, its gradient at position 1 q - p = (1/4, -1/4)
    model, ids, mask, lengths, anchors, valid, final = hand_case()
    only = dl.dflash_loss(model, torch.zeros(1, 4, 0, dtype=torch.float64), ids, mask, lengths, anchors, valid,
                          final_hidden=final, weights=[1.0, 0.0], distill=1.0)
    assert only.loss.item() == pytest.approx(-(0.5 * math.log(0.75) + 0.5 * math.log(0.25)), rel=1e-12)
    only.loss.backward()
    assert model.h.grad[0, 1].tolist() == pytest.approx([0.25, -0.25], rel=1e-12)


def test_distillation_needs_the_final_states_and_weights_their_count():
    model, ids, mask, lengths, anchors, valid, _ = hand_case()
    aux = torch.zeros(1, 4, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match="final hidden"):
        dl.dflash_loss(model, aux, ids, mask, lengths, anchors, valid, distill=0.5)
    with pytest.raises(ValueError, match="3 position weights for block positions 1..2"):
        dl.dflash_loss(model, aux, ids, mask, lengths, anchors, valid, weights=[1.0, 1.0, 1.0])


def test_the_method_passes_the_spec_and_final_states_through():
    model, ids, mask, lengths, anchors, valid, final = hand_case()
    batch = DraftBatch(ids, mask, lengths, torch.zeros(1, 4, 0, dtype=torch.float64), None, draws=(anchors, valid),
                       final_hidden=final)
    method = get_method("dflash")
    assert method.needs_final_hidden and not method.needs_teacher
    spec = DFlashSpec(block_size=3, loss_weights=[3.0, 1.0], distill=0.5)
    out = method.loss(model, batch, spec, depth=2)
    assert out.loss.item() == pytest.approx(_loss(weights=[3.0, 1.0], distill=0.5).loss.item(), rel=1e-12)
    assert method.objective_fingerprint(spec) == {"loss_weights": [3.0, 1.0], "distill": 0.5}
    assert method.objective_fingerprint(DFlashSpec()) == {}  # unset: as checkpoints before the options


@pytest.mark.parametrize("change,message", [
    ({"distill": 1.5}, "between 0 and 1"), ({"loss_weights": [1.0, 1.0]}, "give block_size - 1 = 7 weights"),
    ({"loss_weights": [1, 1, 1, 1, 1, 1, 0]}, "weights > 0")])
def test_objective_fields_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        check_objective(dataclasses.replace(DFlashSpec(), **change))
    check_objective(DFlashSpec(loss_weights=[4, 1, 1, 1, 1, 1, 1], distill=1.0))
