"""The DFlash block attention (draft/dflash/block_attention.py) against the dense-mask attention it
replaced (`dense_reference`: K/V repeated to nh heads, the bool mask [B, Q, T+Q], one SDPA call).

A hand-checked case (q = 0: every visible key weighs the same, so each row is the mean of the
values it sees); outputs and gradients of q, the context K/V and the block K/V in float64 (1e-12)
and fp32 (1e-6 of the float64 truth), with GQA / MHA / MQA, invalid anchors (prefix 0), sequences
of different lengths in one batch (different prefixes per row, one row unsorted) and tilings from
one block x one key to everything in one tile; bf16 and autocast; no tensor beyond the tile grows
as Q*T; the whole DFlash loss and its parameter gradients equal with either attention; the model's
dense-mask path (eval's replay) equals its prefix path.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specforge_k25.draft.dflash.model as dflash_model
from specforge_k25.draft.dflash import loss as dl
from specforge_k25.draft.dflash.block_attention import block_attention, dense_reference, make_tiling

# (nh, nkv): GQA 6/2, MHA 3/3, MQA 4/1
HEADS = {"gqa_6_2": (6, 2), "mha_3_3": (3, 3), "mqa_4_1": (4, 1)}
# (tile_rows, tile_keys): one block x one key, one block x 3 keys, 2 blocks x 5 keys (rows 11 ->
# 2 blocks of 4), everything in one tile
TILINGS = {"1x1": (4, 1), "1x3": (4, 3), "2x5": (11, 5), "all": (10 ** 6, 10 ** 6)}
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
Bk, T, HD = 4, 13, 8
# batch of 2: row 0 (13 tokens) has anchors 1, 3, 4, 9, 11; row 1 (8 tokens) 2, 5 and three invalid
# (prefix 0: its block sees only itself); row 1's valid ones are given out of order (6, 2): any order is exact
PREFIX = torch.tensor([[1, 3, 4, 9, 11], [6, 2, 0, 0, 0]])


def _inputs(nh, nkv, prefix=PREFIX, t=T, seed=0, dtype=torch.float64):
    """q [B, nh, Q, hd], k/v_ctx [B, nkv, T, hd], k/v_blk [B, nkv, Q, hd], upstream grad [B, nh, Q, hd]."""
    g = torch.Generator().manual_seed(seed)
    B, Q = prefix.shape[0], prefix.shape[1] * Bk
    shapes = [(B, nh, Q, HD), (B, nkv, t, HD), (B, nkv, t, HD), (B, nkv, Q, HD), (B, nkv, Q, HD)]
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    return leaves, torch.randn(B, nh, Q, HD, generator=g, dtype=torch.float64).to(dtype)


def _run(fn, leaves, grad_out):
    """fn(q, k_ctx, v_ctx, k_blk, v_blk) and the grads of <out, grad_out> for the five inputs."""
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def _new(prefix, tile_rows, tile_keys, scale=HD ** -0.5):
    tiling = make_tiling(prefix, Bk, tile_rows, tile_keys)
    return lambda *x: block_attention(*x, prefix, scale, tiling)


def _dense(prefix, scale=HD ** -0.5):
    return lambda *x: dense_reference(*x, prefix, scale, Bk)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


NAMES = ["out", "q", "k_ctx", "v_ctx", "k_blk", "v_blk"]


def test_by_hand_q_zero_averages_the_visible_values():
    """q = 0: every score is 0, so row r's output is the mean of the values it sees. One head, hd 1,
    T 5, blocks of 2: block 0 (prefix 2) sees ctx 0, 1 and its own 100, 101 -> 50.5; block 1
    (invalid, prefix 0) only 102, 103 -> 102.5; block 2 (prefix 5) ctx 0..4 and 104, 105 ->
    (10 + 209) / 7. The gradient of the outputs' sum reaching context value k is the sum over the
    rows that see it of 1/(number of keys they see): v_ctx[0] -> 2/4 + 2/7, v_ctx[4] -> 2/7."""
    prefix = torch.tensor([[2, 0, 5]])
    q = torch.zeros(1, 1, 6, 1, dtype=torch.float64, requires_grad=True)
    k_ctx, k_blk = torch.randn(1, 1, 5, 1, dtype=torch.float64), torch.randn(1, 1, 6, 1, dtype=torch.float64)
    v_ctx = torch.arange(5, dtype=torch.float64).view(1, 1, 5, 1).requires_grad_()
    v_blk = (100 + torch.arange(6, dtype=torch.float64)).view(1, 1, 6, 1).requires_grad_()
    for rows, keys in ((2, 1), (2, 2), (6, 5)):
        out = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, prefix, 1.0, make_tiling(prefix, 2, rows, keys))
        want = torch.tensor([50.5, 50.5, 102.5, 102.5, 219 / 7, 219 / 7], dtype=torch.float64)
        assert torch.allclose(out.flatten(), want, rtol=0, atol=1e-13), out.flatten()
        g_ctx, g_blk = torch.autograd.grad(out.sum(), [v_ctx, v_blk])
        want_ctx = torch.tensor([2 / 4 + 2 / 7] * 2 + [2 / 7] * 3, dtype=torch.float64)
        want_blk = torch.tensor([2 / 4] * 2 + [2 / 2] * 2 + [2 / 7] * 2, dtype=torch.float64)
        assert torch.allclose(g_ctx.flatten(), want_ctx, rtol=0, atol=1e-13)
        assert torch.allclose(g_blk.flatten(), want_blk, rtol=0, atol=1e-13)


def test_tiling_by_hand():
    """Tiles of 2 blocks (rows 8 or 11 -> 2 blocks of 4): row 0's anchors (1, 3 | 4, 9 | 11) and row
    1's (6, 2 | 0, 0 | 0): a tile reads up to its largest prefix over the batch."""
    t = make_tiling(PREFIX, Bk, 11, 5)
    assert (t.anchors_per_tile, t.tile_keys, t.bounds) == (2, 5, (6, 9, 11))
    assert make_tiling(PREFIX, Bk, 3, 5).anchors_per_tile == 1  # at least one block per tile
    assert make_tiling(PREFIX, Bk, 10 ** 6, 5).bounds == (11,)
    with pytest.raises(ValueError, match="positive"):
        make_tiling(PREFIX, Bk, 4, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("tiling", TILINGS)
def test_equals_the_dense_mask_attention_outputs_and_grads(tiling, heads, dtype):
    leaves, grad_out = _inputs(*HEADS[heads])
    got = _run(_new(PREFIX, *TILINGS[tiling]), [x.to(dtype) for x in leaves], grad_out.to(dtype))
    # fp32 is held to the float64 dense result (the truth), as tests/draft/test_ttt_attention.py does
    want = _run(_dense(PREFIX), leaves, grad_out)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert b.abs().max() > 0, name
        assert _rel(a, b) < TOL[dtype], (name, _rel(a, b))
    # the keys no block sees (row 1: context past its largest prefix 6) get no gradient
    assert got[2][1, :, 6:].abs().max() == 0 and got[3][1, :, 6:].abs().max() == 0


def test_bf16_is_as_close_to_float64_as_the_dense_attention_is():
    """bf16 inputs (scores and softmax in fp32 per tile, as SDPA's fused kernels): the error against
    the float64 truth stays at the dense bf16 one's level."""
    leaves, grad_out = _inputs(*HEADS["gqa_6_2"], seed=1)
    leaves[0] = leaves[0] * 3  # scores of several units
    truth = _run(_dense(PREFIX), leaves, grad_out)
    low = [x.bfloat16() for x in leaves]
    new = _run(_new(PREFIX, 4, 3), low, grad_out)
    dense = _run(_dense(PREFIX), low, grad_out)
    for name, a, b, t in zip(NAMES, new, dense, truth):
        assert a.dtype == torch.bfloat16
        assert _rel(a, t) < 2 * _rel(b, t) + 2e-3, (name, _rel(a, t), _rel(b, t))


def test_autocast_casts_the_inputs_as_it_did_for_sdpa():
    """Under bf16 autocast fp32 inputs run (and are kept for backward) in bf16; output bf16, grads
    back in the inputs' fp32."""
    leaves, grad_out = _inputs(*HEADS["gqa_6_2"], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(_new(PREFIX, 4, 3), leaves, grad_out)
    truth = _run(_dense(PREFIX), [x.double() for x in leaves], grad_out.double())
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    for name, a, t in zip(NAMES, got, truth):
        assert _rel(a, t) < 3e-2, (name, _rel(a, t))


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward run inside the mode)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_nothing_grows_as_q_times_t():
    """T and the anchor count doubled together (Q ~ T, as at a fixed anchor density): the largest
    tensor any op returns in forward + backward at most doubles for the block attention (the
    linear q/K/V and their grads; a score tile [B, nh, R, C] is fixed), while the dense one's
    [B, Q, T+Q] mask quadruples. One block x 16 keys per tile."""
    nh, nkv = HEADS["gqa_6_2"]
    largest = {}
    for name, A, t in (("new", 4, 32), ("new", 8, 64), ("dense", 8, 64)):
        prefix = torch.arange(1, A + 1)[None] * (t // A) - 1  # [1, A] evenly spread anchors
        leaves, grad_out = _inputs(nh, nkv, prefix=prefix, t=t)
        fn = _new(prefix, Bk, 16) if name == "new" else _dense(prefix)
        with _LargestOutput() as mode:
            _run(fn, leaves, grad_out)
        largest[name, t] = mode.numel
    Q = 8 * Bk
    assert largest["new", 64] <= 2 * largest["new", 32], largest
    assert largest["new", 64] <= nh * Q * HD < Q * (64 + Q) <= largest["dense", 64], largest


def _loss_and_grads(model, case):
    res = dl.dflash_loss(model, *case[1:])
    params = model.trainable_parameters()
    return res.loss.detach(), torch.autograd.grad(res.loss, params)


def test_dflash_loss_and_grads_equal_with_the_dense_attention(monkeypatch):
    """The whole DFlash loss (tests/draft/test_dflash.py's case: lengths 13 and 10, loss-masked
    positions, GQA 4/2, anchors sampled per sequence) with tiles of one block x 3 keys, against
    the model with the dense attention swapped in: loss and every parameter gradient equal in
    float64 to 1e-12."""
    import dataclasses

    from test_dflash import CFG, make_case

    cfg = dataclasses.replace(CFG, attention_tile_rows=CFG.block_size, attention_tile_keys=3)
    case = make_case(cfg)
    new = _loss_and_grads(case[0], case)
    monkeypatch.setattr(dflash_model, "block_attention",
                        lambda q, kc, vc, kb, vb, prefix, scale, tiling: dense_reference(q, kc, vc, kb, vb, prefix,
                                                                                           scale, tiling.block_size))
    dense = _loss_and_grads(case[0], case)
    assert _rel(new[0], dense[0]) < 1e-12
    for a, b in zip(new[1], dense[1]):
        assert b.abs().max() > 0 and _rel(a, b) < 1e-12


def test_the_model_takes_the_block_size_from_the_call():
    """The model's blocks are Q / A tokens long (eval replays at served block sizes other than the
    trained one): a block size the call does not split into is refused, not mis-tiled."""
    from test_dflash import CFG, make_case

    model, aux, input_ids, loss_mask, lengths, anchors, valid = make_case(CFG)
    inp = dl.block_inputs(input_ids, loss_mask, lengths, anchors, valid, CFG.block_size, CFG.mask_token_id)
    B, T = input_ids.shape
    ctx_positions = torch.arange(T).expand(B, T)
    with pytest.raises(ValueError, match="do not split"):
        model(aux, ctx_positions, inp.block_ids[:, :-1], inp.block_positions[:, :-1], prefix=inp.prefix)
