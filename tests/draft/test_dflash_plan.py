"""The DFlash plan arithmetic (specforge_k25/draft/dflash/plan.py): the bytes the block loss keeps
for backward against what autograd really saves (saved-tensor hooks, plus what per-layer
checkpointing holds as inputs; fp32 and bf16 autocast), one layer as the plan's step, and the
step's FLOPs against torch's flop counter (its fused-attention formulas for the CPU kernel).

Tiny shapes where no 2-D activation has a weight's shape ([B*T, .] and [B*Q, .] rows avoid 16, 20,
32, 44, 60, 70), anchors 1..A with A <= T - block so that every block position counts, as the
plan assumes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import specforge_k25.draft.dflash.model as dflash_model
from specforge_k25.draft.dflash import loss as dl
from specforge_k25.draft.dflash import plan
from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft

CFG = DFlashConfig(hidden_size=20, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=70, target_hidden_size=20, num_aux_hidden_states=3,
                   block_size=4, mask_token_id=69, num_anchors=3, loss_gamma=4.0, logits_chunk=7)
CASES = [(CFG, 2, 11), (dataclasses.replace(CFG, num_hidden_layers=3, block_size=5), 1, 13),
         (dataclasses.replace(CFG, num_hidden_layers=1), 3, 9)]


def _case(cfg: DFlashConfig, B: int, T: int):
    torch.manual_seed(0)
    model = DFlashDraft(cfg)
    model.attach_lm_head(torch.randn(cfg.vocab_size, cfg.hidden_size))
    A = plan.anchors_per_sequence(cfg, T)
    assert A + cfg.block_size <= T + 1  # every block position of every anchor counts
    inputs = (torch.randn(B, T, cfg.num_aux_hidden_states * cfg.target_hidden_size),
              torch.randint(0, cfg.vocab_size - 1, (B, T)), torch.ones(B, T, dtype=torch.bool), torch.full((B,), T),
              torch.arange(1, A + 1).expand(B, -1).contiguous(), torch.ones(B, A, dtype=torch.bool))
    return model, inputs


def _measured_saved_bytes(cfg: DFlashConfig, B: int, T: int, bf16: bool, checkpoint: bool, monkeypatch) -> int:
    """Bytes of the distinct storages the forward keeps for backward: what autograd saves, plus the
    inputs a per-layer checkpoint holds (its RoPE tables are not saved tensors), minus parameters,
    the lm_head, their autocast casts, the aux input (the batch's) and 0-dim scalars."""
    model, inputs = _case(cfg, B, T)
    aux = inputs[0]
    weights = [*model.parameters(), model.lm_head_weight]
    skip = {t.untyped_storage().data_ptr() for t in (*weights, aux)}
    shapes = {s for w in weights for s in (tuple(w.shape), tuple(w.t().shape))}
    storages: dict[int, int] = {}

    def pack(t):
        weight_cast = t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
        if t.dim() > 0 and t.untyped_storage().data_ptr() not in skip and not weight_cast:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    checkpoint_fn = torch.utils.checkpoint.checkpoint

    def held_inputs(fn, *args, **kwargs):
        for arg in args:
            for t in arg if isinstance(arg, tuple) else (arg,):
                pack(t)
        return checkpoint_fn(fn, *args, **kwargs)

    monkeypatch.setattr(dflash_model.torch.utils.checkpoint, "checkpoint", held_inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            res = dl.dflash_loss(model, *inputs, checkpoint=checkpoint)
    monkeypatch.undo()
    assert int(res.counted.sum()) == B * plan.anchors_per_sequence(cfg, T) * (cfg.block_size - 1)
    return sum(storages.values())


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_saved_bytes_match_what_autograd_keeps(case, bf16, checkpoint, monkeypatch, one_torch_thread):
    cfg, B, T = CASES[case]
    assert (plan.ttt_saved_bytes(cfg, B, T, 0, bf16, checkpoint)["total"]
            == _measured_saved_bytes(cfg, B, T, bf16, checkpoint, monkeypatch))


def test_a_step_is_one_layer(monkeypatch, one_torch_thread):
    """ttt_step_bytes(k) is what a layer adds (k = 0: the first, whose input needs no grad; the plan
    counts a later one as the step recomputed under checkpointing)."""
    cfg, B, T = CFG, 2, 11
    for bf16 in (False, True):
        one, two, three = (_measured_saved_bytes(dataclasses.replace(cfg, num_hidden_layers=n), B, T, bf16, False,
                                                 monkeypatch) for n in (1, 2, 3))
        assert sum(plan.ttt_step_bytes(cfg, B, T, 1, bf16)) == three - two == two - one
        assert sum(plan.ttt_step_bytes(cfg, B, T, 0, bf16)) < three - two


def _cpu_sdpa_flop_formulas() -> dict:
    """torch's flop counter has no formula for the CPU flash-attention kernel: count it with
    torch's own fused-attention formulas, as on a GPU."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kw: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *args, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v)}


@pytest.mark.parametrize("case,bf16,checkpoint", [(0, False, False), (1, True, True), (2, False, True)])
def test_draft_step_flops_match_torch_flop_counter(case, bf16, checkpoint, one_torch_thread):
    """Forward, backward and what backward recomputes (the logits chunks; with checkpointing the
    layers but their last matmul), counted by torch, equal the analytic count."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, B, T = CASES[case]
    model, inputs = _case(cfg, B, T)
    with FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flop_formulas()) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            res = dl.dflash_loss(model, *inputs, checkpoint=checkpoint)
        res.loss.backward()
    flops = plan.draft_step_flops(cfg, B, T, 0, checkpoint=checkpoint)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    sdpa = sum(n for op, n in counts.items() if "scaled_dot_product" in op)
    assert sdpa == flops["attention_fwd"] * (2 if checkpoint else 1) + flops["attention_bwd"], counts
    assert counter.get_total_flops() == flops["total"], counts
    assert flops["teacher"] == 0


def test_kimi_sized_draft_by_hand():
    """z-lab's Kimi-K2.5 shape (6 layers, H 7168) at T 4096: 512 anchors of 8, the logits of the
    3584 counted rows per sequence over the full vocab, no teacher."""
    cfg = DFlashConfig(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=56,
                       num_key_value_heads=8, head_dim=128, vocab_size=163840, target_hidden_size=7168,
                       num_aux_hidden_states=6, block_size=8, num_anchors=512)
    T, Q, P = 4096, 4096, 3584
    f = plan.draft_step_flops(cfg, 1, T)
    assert f["attention_fwd"] == 6 * 4 * 56 * Q * (T + Q) * 128
    assert f["draft_recompute"] == 2 * P * 7168 * 163840
    kept = plan.ttt_saved_bytes(cfg, 1, T, 7, bf16=True, checkpoint=True)
    assert kept["attention_mask"] == Q * (T + Q) and kept["total"] < plan.ttt_saved_bytes(cfg, 1, T, 7, True)["total"] / 5
    assert plan.ttt_saved_bytes(cfg, 1, T, 7, True)["attention_mask"] == 6 * 2 * Q * (T + Q)
