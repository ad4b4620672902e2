"""The exact TTT attention (draft/eagle3/ttt_attention.py) against the dense-mask attention it replaced
(`ttt_attention_dense_reference`: one SDPA call over [causal | eye | ... | eye], [T, (k+1)T]).

Outputs and gradients for q and every step's k and v at k = 0..3, with GQA (9/3 heads, SmolLM2's
grouping), MLA-like head dims (dq > dv, nkv = nh) and dv > dq; right-padded batches (the trainer
pads on the right and has no key-padding mask: causal attention never lets a real position see a
pad); no [T, T]-sized tensor in forward or backward; the full draft's TTT loss and gradients equal
with either attention, for the EAGLE-3 and the MLA head.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specforge_k25.draft.eagle3_mla.model as mla_model
import specforge_k25.draft.eagle3.model as draft_model
from specforge_k25.draft.objective import compute_teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.eagle3.ttt_attention import ttt_attention, ttt_attention_dense_reference
from mla_ttt_reference import tiny_mla_setup
from ttt_reference import _tiny_setup

# (nh, nkv, dq, dv): GQA at SmolLM2's grouping, MLA-like (dq = dn+dr > dv, one kv head per head),
# dv > dq with MQA
SHAPES = {"gqa_9_3": (9, 3, 16, 16), "mla_like": (4, 4, 24, 16), "mqa_dv_gt_dq": (2, 1, 12, 20)}
# max error relative to the largest entry of the float64 dense reference
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _inputs(nh, nkv, dq, dv, k, B=2, T=7, seed=0):
    """q [B, nh, T, dq], keys/values of steps 0..k, and an upstream gradient, in float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T, dq, generator=g, dtype=torch.float64)
    keys = [torch.randn(B, nkv, T, dq, generator=g, dtype=torch.float64) for _ in range(k + 1)]
    values = [torch.randn(B, nkv, T, dv, generator=g, dtype=torch.float64) for _ in range(k + 1)]
    grad_out = torch.randn(B, nh, T, dv, generator=g, dtype=torch.float64)
    return [q, *keys, *values], grad_out


def _run(fn, leaves, grad_out, k, scale):
    """fn's output and the gradients of <out, grad_out> for q, keys 0..k, values 0..k."""
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = fn(leaves[0], leaves[1:k + 2], leaves[k + 2:], scale)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_equals_the_dense_mask_attention_outputs_and_grads(k, shape, dtype):
    nh, nkv, dq, dv = SHAPES[shape]
    leaves, grad_out = _inputs(nh, nkv, dq, dv, k)
    scale = dq ** -0.5
    got = _run(ttt_attention, [x.to(dtype) for x in leaves], grad_out.to(dtype), k, scale)
    # fp32 is held to the float64 dense result (the truth), not to the dense fp32 one: two fp32
    # results can sit on either side of it
    want = _run(ttt_attention_dense_reference, leaves, grad_out, k, scale)
    names = ["out", "q"] + [f"k{j}" for j in range(k + 1)] + [f"v{j}" for j in range(k + 1)]
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert b.abs().max() > 0, name  # every input gets a gradient: every step is visible
        assert _rel(a, b) < TOL[dtype], (name, _rel(a, b))


@pytest.mark.parametrize("k", [0, 2])
def test_gqa_where_the_kernel_lacks_it_repeats_kv(k, monkeypatch):
    """The branch CUDA takes in fp32 (no fused kernel takes enable_gqa there): k/v repeated to nh
    heads, same result."""
    import specforge_k25.draft.eagle3.ttt_attention as tta

    monkeypatch.setattr(tta, "native_gqa", lambda q: False)
    nh, nkv, dq, dv = SHAPES["gqa_9_3"]
    leaves, grad_out = _inputs(nh, nkv, dq, dv, k)
    for a, b in zip(_run(tta.ttt_attention, leaves, grad_out, k, dq ** -0.5),
                    _run(ttt_attention_dense_reference, leaves, grad_out, k, dq ** -0.5)):
        assert _rel(a, b) < 1e-12


def test_bf16_is_as_close_to_float64_as_the_dense_attention_is():
    """bf16 (what GPUs train in): the sink's score D_t/scale is split hi + lo so it loses nothing
    to bf16; the new attention's error against the float64 truth stays at the dense one's level."""
    k, (nh, nkv, dq, dv) = 3, SHAPES["gqa_9_3"]
    leaves, grad_out = _inputs(nh, nkv, dq, dv, k, T=33, seed=1)
    leaves[0] = leaves[0] * 3  # scores of several units: D_t / scale far from a bf16 grid point
    truth = _run(ttt_attention_dense_reference, leaves, grad_out, k, dq ** -0.5)
    low = [x.bfloat16() for x in leaves]
    new = _run(ttt_attention, low, grad_out, k, dq ** -0.5)
    dense = _run(ttt_attention_dense_reference, low, grad_out, k, dq ** -0.5)
    for a, b, t in zip(new, dense, truth):
        assert _rel(a, t) < 2 * _rel(b, t) + 2e-3


def test_right_padding_does_not_reach_the_real_positions():
    """Row 1 is 4 real positions + 3 pads (random, as the trainer's pads are arbitrary): its real
    positions equal the row run alone at T = 4, outputs and gradients."""
    k, (nh, nkv, dq, dv), n = 2, SHAPES["gqa_9_3"], 4
    leaves, grad_out = _inputs(nh, nkv, dq, dv, k, B=2, T=7)
    grad_out[1, :, n:] = 0  # the loss never reads a pad position
    full = _run(ttt_attention, leaves, grad_out, k, dq ** -0.5)
    alone = _run(ttt_attention, [x[1:2, :, :n] for x in leaves], grad_out[1:2, :, :n], k, dq ** -0.5)
    for a, b in zip(full, alone):
        assert _rel(a[1:2, :, :n], b) < 1e-12
    for g in full[1:]:
        assert g[1, :, n:].abs().max() == 0  # nothing flows into the pads' q, k, v


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


@pytest.mark.parametrize("shape", ["gqa_9_3", "mla_like"])
def test_nothing_grows_as_t_squared(shape):
    """The largest tensor any op returns in forward + backward: from T = 64 to 128 it doubles for
    the new attention (no mask, no math-path [T, T] scores: SDPA's CPU flash kernel runs, MLA's
    dq != dv included); the dense one's [T, (k+1)T] mask shows (the check sees such a tensor)."""
    k, (nh, nkv, dq, dv) = 3, SHAPES[shape]
    largest = {}
    for fn, T in ((ttt_attention, 64), (ttt_attention, 128), (ttt_attention_dense_reference, 128)):
        leaves, grad_out = _inputs(nh, nkv, dq, dv, k, B=1, T=T)
        with _LargestOutput() as mode:
            _run(fn, leaves, grad_out, k, dq ** -0.5)
        largest[fn, T] = mode.numel
    assert largest[ttt_attention, 128] <= 2.1 * largest[ttt_attention, 64], largest
    assert largest[ttt_attention, 128] < (k + 1) * 128 * 128 <= largest[ttt_attention_dense_reference, 128]


def _with_attention(module, fn):
    """Context: `module.ttt_attention` replaced by fn (the heads look the name up at call time)."""
    class _Swap:
        def __enter__(self):
            self.saved = module.ttt_attention
            module.ttt_attention = fn

        def __exit__(self, *exc):
            module.ttt_attention = self.saved
    return _Swap()


def _loss_and_grads(draft, batch, teacher, K):
    res = ttt_loss(draft, *batch, teacher, ttt_length=K)
    params = draft.trainable_parameters()
    return res.loss.detach(), torch.autograd.grad(res.loss, params)


@pytest.mark.parametrize("head", ["eagle3", "eagle3_mla"])
def test_draft_loss_and_grads_equal_with_the_dense_attention(head):
    """ttt_loss over a tiny right-padded batch (lengths 9 and 6), K = 4: loss and parameter
    gradients with the new attention equal those with the dense mask, float64 to 1e-12. In fp32
    the whole draft's own rounding is ~1e-6 of the float64 result with either attention: the loss
    is held to 1e-6 of it, each gradient to twice the dense fp32 one's error + 1e-6 (exactness is
    the float64 check; the attention alone meets fp32 1e-6 in the test above)."""
    K = 4
    setup, module = (_tiny_setup, draft_model) if head == "eagle3" else (tiny_mla_setup, mla_model)
    cfg, draft, d2t, input_ids, loss_mask, lengths, aux, final, lm_head_full = setup(2)
    runs = {}
    for dtype in (torch.float64, torch.float32):
        d = copy.deepcopy(draft).to(dtype)
        teacher = compute_teacher(final.to(dtype), lm_head_full.to(dtype), d2t)
        batch = (aux.to(dtype), input_ids, loss_mask, lengths)
        runs[dtype, "new"] = _loss_and_grads(d, batch, teacher, K)
        with _with_attention(module, ttt_attention_dense_reference):
            runs[dtype, "dense"] = _loss_and_grads(d, batch, teacher, K)
    truth_loss, truth_grads = runs[torch.float64, "dense"]
    loss, grads = runs[torch.float64, "new"]
    assert _rel(loss, truth_loss) < 1e-12
    for g, tg in zip(grads, truth_grads):
        assert tg.abs().max() > 0
        assert _rel(g, tg) < 1e-12
    (loss32, grads32), (_, dense32) = runs[torch.float32, "new"], runs[torch.float32, "dense"]
    assert _rel(loss32, truth_loss) < 1e-6
    for g, dg, tg in zip(grads32, dense32, truth_grads):
        assert _rel(g, tg) < 2 * _rel(dg, tg) + 1e-6  # both ~1e-6..3e-6: the fp32 draft's own rounding
