"""The MLA head's plan arithmetic (specforge_k25/draft/eagle3_mla/plan.py): the bytes each TTT step
saves against the tensors autograd really saves (saved-tensor hooks; fp32 and bf16 autocast, with
and without activation checkpointing), the step's FLOPs against torch's flop counter, parameter
counts against the module, and one FLOP count by hand with a value head dim of its own.

Tiny shapes, dv = dn + dr and dv != dn + dr (draft/eagle3/ttt_attention.py then pads step 0's q, k, v to
one head dim, so torch's CPU runs its fused SDPA kernel either way: what the plan counts), and no
activation has a weight's shape.
"""
from __future__ import annotations

import pytest
import torch

from specforge_k25.draft.eagle3_mla import plan
from specforge_k25.draft.eagle3_mla.model import Eagle3MLADraft, MLADraftConfig
from specforge_k25.draft.objective import Teacher, compute_teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.method import trainable_count


def _cfg(**overrides) -> MLADraftConfig:
    # weights: fc [48, 112], q_a [40, 96], q_b [96, 40], kv_a [26, 96], kv_b [156, 20], o [48, 96],
    # gate/up [88, 48], down [48, 88], lm_head [36, 48]: B*T*(k+1) below avoids 36, 40, 48, 88, 96, 100, 156
    fields = dict(hidden_size=48, intermediate_size=88, num_attention_heads=6, q_lora_rank=40, kv_lora_rank=20,
                  qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=16, vocab_size=100, draft_vocab_size=36,
                  target_hidden_size=56, num_aux_hidden_states=2)
    return MLADraftConfig(**{**fields, **overrides})


def _inputs(cfg: MLADraftConfig, B: int, T: int):
    aux = torch.randn(B, T, cfg.num_aux_hidden_states * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    return aux, ids, mask, torch.full((B,), T)


def _measured_saved_bytes(cfg: MLADraftConfig, B: int, T: int, K: int, bf16: bool, checkpoint: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in ttt_loss, minus parameters,
    their autocast bf16 copies (counted apart in the plan), the aux input (part of the batch) and
    0-dim scalars: tests/plan/test_memory_plan.py's measure, on the MLA head."""
    torch.manual_seed(0)
    draft = Eagle3MLADraft(cfg)
    param_ptrs = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    param_shapes = {tuple(p.shape) for p in draft.parameters()}
    aux, ids, mask, lengths = _inputs(cfg, B, T)
    teacher = Teacher(torch.randn(B, T, cfg.draft_vocab_size), torch.randn(B, T),
                      torch.randint(0, cfg.draft_vocab_size, (B, T)))
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        is_weight_cast = t.dtype == torch.bfloat16 and t.dim() == 2 and (
            tuple(t.shape) in param_shapes or tuple(t.t().shape) in param_shapes)
        if t.dim() > 0 and ptr not in param_ptrs and ptr != aux.untyped_storage().data_ptr() and not is_weight_cast:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ttt_loss(draft, aux, ids, mask, lengths, teacher, K, checkpoint=checkpoint)
    return sum(storages.values())


@pytest.mark.parametrize("dv", [16, 12])  # 12: kv_b [132, 20], o [48, 72]
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("B,T,K", [(2, 11, 3), (3, 7, 2)])
def test_ttt_saved_bytes_match_what_autograd_saves(B, T, K, bf16, checkpoint, dv, one_torch_thread):
    cfg = _cfg(v_head_dim=dv)
    assert (plan.saved_bytes(cfg, B, T, K, bf16, checkpoint)["total"]
            == _measured_saved_bytes(cfg, B, T, K, bf16, checkpoint))


def test_one_step_is_the_difference_of_two_unrolls(one_torch_thread):
    """step_bytes(k) is what step k adds (the plan counts the last step as the one recomputed
    under checkpointing)."""
    cfg, B, T = _cfg(), 1, 13
    for bf16 in (False, True):
        step, mask = plan.step_bytes(cfg, B, T, 2, bf16)
        assert step + mask == (_measured_saved_bytes(cfg, B, T, 3, bf16, False)
                               - _measured_saved_bytes(cfg, B, T, 2, bf16, False))


def test_param_counts_match_the_module():
    cfg = _cfg(num_aux_hidden_states=3)
    with torch.device("meta"):
        draft = Eagle3MLADraft(cfg)
    counts = plan.param_counts(cfg)
    assert trainable_count(counts) == sum(p.numel() for p in draft.trainable_parameters())
    assert counts["embed_tokens (frozen)"] == draft.embed_tokens.weight.numel()
    assert sum(counts.values()) == sum(p.numel() for p in draft.parameters())


def _cpu_sdpa_flop_formulas() -> dict:
    """torch's flop counter has no formula for the CPU flash-attention kernel (it would count 0):
    count it with torch's own fused-attention formulas, as on a GPU."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


@pytest.mark.parametrize("bf16,checkpoint,dv", [(False, False, 16), (True, True, 16), (True, False, 12)])
def test_draft_step_flops_match_torch_flop_counter(bf16, checkpoint, dv, one_torch_thread):
    """The teacher, the TTT forward and backward (and the recomputed forward with checkpointing)
    of one micro-batch, counted by torch, equal the analytic count."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, B, T, K = _cfg(v_head_dim=dv), 2, 9, 3
    torch.manual_seed(0)
    draft = Eagle3MLADraft(cfg)
    aux, ids, mask, lengths = _inputs(cfg, B, T)
    final = torch.randn(B, T, cfg.target_hidden_size)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    with FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flop_formulas()) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            teacher = compute_teacher(final, lm_head, draft.d2t, chunk=8)
            result = ttt_loss(draft, aux, ids, mask, lengths, teacher, K, checkpoint=checkpoint)
        result.loss.backward()
    flops = plan.draft_step_flops(cfg, B, T, K, checkpoint=checkpoint, bf16=bf16)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    sdpa = sum(n for op, n in counts.items() if "scaled_dot_product" in op)
    assert sdpa == flops["attention_fwd"] * (2 if checkpoint else 1) + flops["attention_bwd"], counts
    assert counter.get_total_flops() == flops["total"], counts
    assert (flops["draft_recompute"] > 0) is checkpoint


def test_step_flops_by_hand_with_a_value_head_dim_of_its_own():
    """Toy shapes, dv != dn + dr: step k's kv_b runs over (k+1)T latents; step 0's SDPA runs over T
    keys at W0 = 8 (dn+dr = 4 and dv = 3 padded to one dim, rounded up to 8), step 1's over T+1
    rows at W = 8 (4 + 2 sink columns under bf16, rounded up to 8)."""
    cfg = MLADraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, q_lora_rank=4, kv_lora_rank=3,
                         qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, vocab_size=32, draft_vocab_size=16,
                         target_hidden_size=8, num_aux_hidden_states=4)
    B, T, K = 2, 3, 2
    N = B * T
    f = plan.draft_step_flops(cfg, B, T, K)
    assert plan.sdpa_widths(cfg, bf16=True) == (8, 8)
    # QK^T and PV, 2 heads: step 0 T x T at 8 dims, step 1 (T+1) x (T+1) at 8 dims
    assert f["attention_fwd"] == 2 * (2 * B * 2 * T * T * 8) + 2 * (2 * B * 2 * (T + 1) * (T + 1) * 8) == 3200
    # backward: QK^T again, dP, dV, dQ, dK: 5 matmuls of the same size
    assert f["attention_bwd"] == 5 * 3200 // 2 == 8000
    per_step = 2 * N * (2 * 8 * 4 + 4 * 2 * 4 + 2 * 8 * (3 + 2) + 2 * 3 * 8 + 3 * 8 * 16 + 8 * 16)
    kv_b = 2 * N * 3 * 2 * (2 + 3) * (1 + 2)  # T rows at step 0, 2T at step 1
    fc = 2 * N * 4 * 8 * 8
    assert f["draft_fwd"] == fc + K * per_step + kv_b + f["attention_fwd"]
    assert f["draft_bwd"] == fc + 2 * (K * per_step + kv_b) + f["attention_bwd"]
    assert f["teacher"] == 2 * N * 32 * 8 and f["draft_recompute"] == 0
    c = plan.draft_step_flops(cfg, B, T, K, checkpoint=True)
    assert c["draft_recompute"] == K * per_step + kv_b + f["attention_fwd"]
    assert c["total"] == f["total"] + c["draft_recompute"]


def test_checkpointing_keeps_the_latent_cache_not_the_expanded_keys():
    """At Kimi's MLA sizes (64 heads, kv_lora 512, rope 64) a checkpointed step keeps the hidden and
    the latent + rope key (fp32 latent: 4*512 + 2*64 bytes per token) instead of per-head K/V."""
    cfg = MLADraftConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168)
    T, K = 4096, 7
    kept = plan.saved_bytes(cfg, 1, T, K, bf16=True, checkpoint=True)
    assert kept["total"] == (6 * 7168 + 7 * 2 * 7168 + 6 * (4 * 512 + 2 * 64)) * T
    full = plan.saved_bytes(cfg, 1, T, K, bf16=True)
    assert full["attention_mask"] == 0  # draft/eagle3/ttt_attention.py builds no mask
    assert full["total"] > 10 * kept["total"]
