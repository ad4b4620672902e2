"""The DFlash plan arithmetic (specforge_k25/draft/dflash/plan.py): the bytes the block loss keeps
for backward against what autograd really saves (saved-tensor hooks, plus what per-layer
checkpointing holds as inputs; fp32 and bf16 autocast), one layer as the plan's step, and the
step's FLOPs against torch's flop counter (the block attention's tiled matmuls included), and the
attention's score count by hand.

Tiny shapes where no 2-D activation has a weight's shape ([B*T, .] and [B*Q, .] rows avoid 16, 20,
32, 44, 60, 70), anchors at the plan's `planned_anchors` (spread over 1..T-block, so that every
block position counts, as the plan assumes).
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
# tiles: one block x 3 keys (several tiles and chunks), the default (one tile), two blocks x 5 keys
CASES = [(dataclasses.replace(CFG, attention_tile_rows=4, attention_tile_keys=3), 2, 11),
         (dataclasses.replace(CFG, num_hidden_layers=3, block_size=5), 1, 13),
         (dataclasses.replace(CFG, num_hidden_layers=1, attention_tile_rows=8, attention_tile_keys=5), 3, 9)]


def _case(cfg: DFlashConfig, B: int, T: int):
    torch.manual_seed(0)
    model = DFlashDraft(cfg)
    model.attach_lm_head(torch.randn(cfg.vocab_size, cfg.hidden_size))
    A = plan.anchors_per_sequence(cfg, T)
    assert A + cfg.block_size <= T + 1  # every block position of every anchor counts
    inputs = (torch.randn(B, T, cfg.num_aux_hidden_states * cfg.target_hidden_size),
              torch.randint(0, cfg.vocab_size - 1, (B, T)), torch.ones(B, T, dtype=torch.bool), torch.full((B,), T),
              torch.tensor(plan.planned_anchors(cfg, T)).expand(B, -1).contiguous(), torch.ones(B, A, dtype=torch.bool))
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
                if isinstance(t, torch.Tensor):  # not the attention's Tiling (host ints)
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
    assert (plan.saved_bytes(cfg, B, T, 0, bf16, checkpoint)["total"]
            == _measured_saved_bytes(cfg, B, T, bf16, checkpoint, monkeypatch))


def test_a_step_is_one_layer(monkeypatch, one_torch_thread):
    """step_bytes(k) is what a layer adds (k = 0: the first, whose input needs no grad; the plan
    counts a later one as the step recomputed under checkpointing)."""
    cfg, B, T = CFG, 2, 11
    for bf16 in (False, True):
        one, two, three = (_measured_saved_bytes(dataclasses.replace(cfg, num_hidden_layers=n), B, T, bf16, False,
                                                 monkeypatch) for n in (1, 2, 3))
        assert sum(plan.step_bytes(cfg, B, T, 1, bf16)) == three - two == two - one
        assert sum(plan.step_bytes(cfg, B, T, 0, bf16)) < three - two


@pytest.mark.parametrize("case,bf16,checkpoint", [(0, False, False), (1, True, True), (2, False, True)])
def test_draft_step_flops_match_torch_flop_counter(case, bf16, checkpoint, one_torch_thread):
    """Forward, backward and what backward recomputes (the logits chunks; with checkpointing the
    layers but their last matmul), counted by torch, equal the analytic count. The block
    attention's matmuls are the step's only batched ones (aten.bmm; the linears are aten.mm):
    forward (twice with checkpointing) + backward = its analytic count."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, B, T = CASES[case]
    model, inputs = _case(cfg, B, T)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            res = dl.dflash_loss(model, *inputs, checkpoint=checkpoint)
        res.loss.backward()
    flops = plan.draft_step_flops(cfg, B, T, 0, checkpoint=checkpoint)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.bmm"] == flops["attention_fwd"] * (2 if checkpoint else 1) + flops["attention_bwd"], counts
    assert counter.get_total_flops() == flops["total"], counts
    assert flops["teacher"] == 0


def test_attention_scores_by_hand():
    """CASES[0] (T 11, block 4, 3 anchors at 1, 4, 7; tiles of one block, keys in chunks of 3):
    each block scores its own 4 keys and the context before its anchor, 4 rows x (1 + 4 + 7) ->
    3*4*4 + 4*12 = 96 pairs per head (the dense mask scored 12 x (11 + 12) = 276). Tiles of two
    blocks (CASES[2]: T 9, anchors 1, 3, 5): the first tile reads up to its last anchor 3 for both
    blocks, 8*3 + 4*5 + 3*16 = 92."""
    assert plan.planned_anchors(CASES[0][0], 11) == [1, 4, 7]
    assert plan.attention_tile(CASES[0][0], 11) == (4, 3)
    assert plan.attention_scores(CASES[0][0], 11) == 96
    assert plan.planned_anchors(CASES[2][0], 9) == [1, 3, 5]
    assert plan.attention_tile(CASES[2][0], 9) == (8, 5)
    assert plan.attention_scores(CASES[2][0], 9) == 92
    assert plan.draft_step_flops(CASES[0][0], 2, 11)["attention_fwd"] == 2 * 2 * 4 * 4 * 96 * 8


def test_kimi_sized_draft_by_hand():
    """z-lab's Kimi-K2.5 shape (6 layers, H 7168) at T 4096: 512 anchors of 8, the logits of the
    3584 counted rows per sequence over the full vocab, no teacher. The planned anchors
    1 + i*4087//511 put the last of each tile of 64 at 504, 1016, ..., 4088 (step 512), so the
    block attention scores 4096*8 + 512*(504 + ... + 4088) = 4096*2304 pairs per head, against
    Q*(T+Q) = 4096*8192 for the dense mask; nothing quadratic is kept."""
    cfg = DFlashConfig(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=56,
                       num_key_value_heads=8, head_dim=128, vocab_size=163840, target_hidden_size=7168,
                       num_aux_hidden_states=6, block_size=8, num_anchors=512)
    T, Q, P = 4096, 4096, 3584
    assert plan.attention_tile(cfg, T) == (512, 1024)
    assert plan.attention_scores(cfg, T) == Q * 8 + 512 * sum(range(504, 4089, 512)) == Q * 2304
    f = plan.draft_step_flops(cfg, 1, T)
    assert f["attention_fwd"] == 6 * 4 * 56 * Q * 2304 * 128
    assert f["draft_recompute"] == 2 * P * 7168 * 163840
    kept = plan.saved_bytes(cfg, 1, T, 7, bf16=True, checkpoint=True)
    plain = plan.saved_bytes(cfg, 1, T, 7, True)
    assert kept["attention_mask"] == plain["attention_mask"] == 0 and kept["total"] < plain["total"] / 5
    # a layer keeps K/V at the 8 kv heads, 2 x 2 x 8 x 128 = 4 KiB per key in bf16 (the dense path
    # kept them repeated to 56 heads, 28 KiB, and a [Q, T+Q] additive mask)
    one, two = (plan.step_bytes(dataclasses.replace(cfg, num_hidden_layers=n), 1, T, 1, True)[0] for n in (1, 2))
    assert one == two
    # the backward's score tiles: 2 fp32 [56, 512, 1024] + a bool [512, 1024] (~224.5 MiB), bounded by
    # the tile whatever T is
    tiles = 2 * 4 * 56 * 512 * 1024 + 512 * 1024
    grow = plan.backward_working_bytes(cfg, 1, 2 * T, 7, True) - plan.backward_working_bytes(cfg, 1, T, 7, True)
    assert tiles == 235405312 and grow < 1e9  # linear terms only (the fp32 K/V grads, 2x T more keys)
