"""Memory plan (specforge_k25/plan): Kimi-K2.5 numbers against hand arithmetic, the TTT activation
count against tensors autograd really saves, the hw profiles, refusals, and that every hw profile
composes with every target.

Assumed numbers (each used below, written out by hand):
- Kimi-K2.5 text backbone: 61 layers (1 dense + 60 MoE), hidden 7168, vocab 163840, 64 heads,
  MLA q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64, dense intermediate 18432,
  384 routed experts, weights 595e9 bytes (INT4 experts, on disk), bf16 KV cache.
- Kimi draft (conf/draft/kimi.yaml): H 7168, 56 heads / 8 KV heads, head_dim 128, I 18432, Vd 32000.
- GPUs: RTX PRO 6000 97887 MiB, B300 275040 MiB (nvidia-smi totals); CUDA context 0.75 GiB per
  process per GPU, SGLang runtime 2 GiB per TP rank + captured states (hw defaults).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specforge_k25.config import JobConfig
from specforge_k25.draft.objective import Teacher
from specforge_k25.draft.eagle3.loss import ttt_loss
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.plan import (KIMI_K25, GiB, MiB, PlanError, check_fits, draft_param_counts, facts_from_folder,
                                plan_memory, resolve_draft, trainable_params, saved_bytes)

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
KIMI_DRAFT = ["target=kimi_k25", "draft=kimi", "hw.trainer_layout=dedicated"]  # the co-located plan: test_colocated_memory.py


@pytest.fixture(autouse=True)
def _balance_check_default(monkeypatch):
    monkeypatch.delenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", raising=False)


def _compose(overrides):
    import specforge_k25.train.__main__  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def _kimi_draft_cfg() -> DraftConfig:
    return DraftConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=56, num_key_value_heads=8,
                       head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                       max_position_embeddings=262144)  # the draft follows the target's context (262144)


# ------------------------------------------------------------------------ target facts
def test_kimi_target_facts_hand_computed():
    f = KIMI_K25
    assert (f.num_layers, f.hidden_size, f.vocab_size, f.kv_lora_rank, f.qk_rope_head_dim) == (61, 7168, 163840, 512, 64)
    assert f.weight_bytes == 595_000_000_000
    # MLA: the latent (512) + rope key (64) per token per layer, bf16, on every TP rank
    assert f.kv_bytes_per_token(8) == 61 * (512 + 64) * 2 == 70_272
    assert f.kv_bytes_per_token(4) == 70_272
    # replicated on every rank: fused q_a/kv_a down-projection of 61 layers + router of 60 MoE layers, bf16
    replicated = 61 * (1536 + 512 + 64) * 7168 * 2 + 60 * 384 * 7168 * 2
    assert replicated == 2_177_236_992
    assert f.replicated_weight_bytes() == replicated
    assert f.weight_bytes_per_gpu(8) == math.ceil((595_000_000_000 - replicated) / 8) + replicated
    assert f.weight_bytes_per_gpu(4) == math.ceil((595_000_000_000 - replicated) / 4) + replicated
    assert round(f.weight_bytes_per_gpu(8) / GiB, 2) == 71.04


def test_facts_come_from_a_real_folder(tmp_path):
    text = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64,
            "num_key_value_heads": 64, "intermediate_size": 18432, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "q_lora_rank": 1536, "n_routed_experts": 384, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "max_position_embeddings": 262144, "model_type": "kimi_k2"}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "model_type": "kimi_k25", "text_config": text}))
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 234)
    facts = facts_from_folder(tmp_path, "kimi_k25")
    assert facts.weight_bytes == 1234  # the files on disk, not the default
    assert facts.num_moe_layers == 60 and facts.multimodal
    assert facts.kv_bytes_per_token(8) == 70_272
    assert facts.replicated_weight_bytes() == KIMI_K25.replicated_weight_bytes()
    # the plan reads the folder when target.path is set
    job = _compose(["+hw=b300x8", *KIMI_DRAFT, f"target.path={tmp_path}", "hw.target_weight_gb=595"])
    assert check_fits(job).facts.weight_bytes == 595_000_000_000  # hw.target_weight_gb overrides the files
    job = _compose(["+hw=b300x8", *KIMI_DRAFT, f"target.path={tmp_path}"])
    assert check_fits(job).facts.weight_bytes == 1234


# --------------------------------------------------------------------------------- draft
def test_kimi_draft_params_hand_computed():
    job = _compose(["+hw=rtxpro6000x8", *KIMI_DRAFT])
    cfg = resolve_draft(job.draft, KIMI_K25)
    assert cfg == _kimi_draft_cfg()
    H, I, Vd, V = 7168, 18432, 32000, 163840
    expected = {
        "fc": 3 * H * H,  # [H, 3Ht]
        "q_proj": 2 * H * 56 * 128,  # input cat(norm(e), norm(h)) = 2H
        "k_proj": 2 * H * 8 * 128,
        "v_proj": 2 * H * 8 * 128,
        "o_proj": 56 * 128 * H,
        "mlp (gate, up, down)": 3 * H * I,
        "norms (4 RMSNorm)": 4 * H,  # input_layernorm, hidden_norm, post_attention_layernorm, norm
        "lm_head": Vd * H,
        "embed_tokens (frozen)": V * H,
    }
    assert draft_param_counts(cfg) == expected
    assert trainable_params(cfg) == 963_407_872
    # the module itself agrees (built on the meta device: no memory)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    assert sum(p.numel() for p in draft.trainable_parameters()) == 963_407_872
    assert draft.embed_tokens.weight.numel() == V * H and not draft.embed_tokens.weight.requires_grad


# ---------------------------------------------------------------------- TTT activations
def _measured_saved_bytes(cfg: DraftConfig, B: int, T: int, K: int, bf16: bool, checkpoint: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for backward in ttt_loss, minus parameters,
    their autocast bf16 copies (counted apart in the plan), the aux input (part of the batch) and
    0-dim scalars."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.d2t.zero_()
    param_ptrs = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    param_shapes = {tuple(p.shape) for p in draft.parameters()}
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
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
            ttt_loss(draft, aux, ids, mask, torch.full((B,), T), teacher, K, checkpoint=checkpoint)
    return sum(storages.values())


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("B,T,K", [(2, 11, 3), (1, 13, 1), (3, 7, 4)])
def test_ttt_saved_bytes_match_what_autograd_saves(B, T, K, bf16, checkpoint):
    # dims chosen so no activation has a weight's shape (B*T not in {48, 56, 168, 60, 20, 88, 36})
    cfg = DraftConfig(hidden_size=48, intermediate_size=88, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                      vocab_size=100, draft_vocab_size=36, target_hidden_size=56)
    assert (saved_bytes(cfg, B, T, K, bf16, checkpoint)["total"]
            == _measured_saved_bytes(cfg, B, T, K, bf16, checkpoint))


def _kimi_saved_by_hand(B: int, T: int, K: int = 7) -> tuple[int, int]:
    """(per-token bytes of one token over K steps, per-row bytes of one of the B*(T+1) rows of the
    augmented SDPA calls of steps 1..K-1) for the Kimi draft, bf16 autocast (draft/eagle3/ttt_attention.py:
    no mask; step k >= 1's SDPA runs over T+1 rows at head dim W = 136 = 128 + 2 sink columns,
    rounded up to 8)."""
    H, I, hd, Vd, qw, nh, nkv, W = 7168, 18432, 128, 32000, 56 * 128, 56, 8, 136
    per_token = 6 * H  # bf16 cast of the fc input [T, 3Ht] (Ht = H)
    per_row = 0
    for k in range(K):
        per_token += (38 * H  # RMSNorm fp32 inputs / bf16 outputs, per-linear bf16 input casts
                      + 8 * I  # gate, silu, up, product (bf16)
                      + 4 * hd  # cos, sin
                      + 8 * Vd  # [B,T,Vd] fp32 log-probs + teacher probs
                      + 13)  # rsqrt of 3 grad-carrying norms (fp32) + counted mask
        if k == 0:  # one causal SDPA, GQA native
            per_token += (2 * qw  # q
                          + 2 * 2 * nkv * hd  # K/V of step 0 at 8 heads
                          + 2 * qw  # attention output (= o_proj input, a view of it)
                          + 4 * nh)  # the fused attention's fp32 logsumexp
        else:
            per_token += (2 * 4 * nh * k  # fp32 diagonal scores and their softmax [nh, k]
                          + 4 * nh  # their log-sum-exp
                          + 4 * nkv * k * hd  # the k diagonal values stacked, fp32
                          + 4 * qw  # U, fp32
                          + 4 * qw  # fp32 copy of q
                          + 4 * nkv * hd * k  # fp32 copies of the k diagonal keys
                          + 4 * nh  # fp32 copy of the sink's weight column
                          + 2 * qw)  # o_proj's input (a copy)
            per_row += (2 * 2 * nh * W  # q' and out' (bf16)
                        + 2 * 2 * nkv * W  # k', v' at 8 heads (bf16)
                        + 4 * nh)  # logsumexp (fp32)
    return per_token, per_row


def test_kimi_ttt_activation_bytes_hand_computed():
    B, T, K = 1, 4096, 7
    per_token, per_row = _kimi_saved_by_hand(B, T, K)
    got = saved_bytes(_kimi_draft_cfg(), B, T, K, bf16=True)
    assert got["per_token"] == per_token * B * T + per_row * B * (T + 1)
    assert got["attention_mask"] == 0
    assert round(got["total"] / GiB, 2) == 21.5  # the dense [T, (k+1)T]-mask attention kept 22.06 + 0.88 GiB of masks
    # checkpointed: the fc input cast, the hidden entering each step, the K/V (8 heads) of steps 0..5
    kept = saved_bytes(_kimi_draft_cfg(), B, T, K, bf16=True, checkpoint=True)
    assert kept["total"] == (6 * 7168 + 7 * 2 * 7168 + 6 * 2 * 2 * 8 * 128) * T
    assert round(kept["total"] / GiB, 2) == 0.64


def test_trainer_budget_hand_computed():
    job = _compose(["+hw=b300x8", *KIMI_DRAFT])
    plan = check_fits(job, KIMI_K25)
    gpu0 = plan.gpu(0)
    P, V, H, Vd, N, I = 963_407_872, 163840, 7168, 32000, 8192, 18432
    assert gpu0.get("draft weights fp32") == 4 * P
    assert gpu0.get("draft grads fp32") == 4 * P
    assert gpu0.get("AdamW m, v fp32") == 8 * P
    assert gpu0.get("frozen embedding [V, H] bf16") == 0  # looked up in host memory (train/host_embedding.py)
    assert any(f"frozen embedding [V, H] in host memory: {2 * V * H / GiB:.2f} GiB" in n for n in plan.notes)
    assert gpu0.get("target lm_head [V, Ht] bf16 (teacher)") == 2 * V * H
    # [1024, V] bf16 logits, their fp32 copy, logsumexp's fp32 exp; [V] fp32 x2
    assert gpu0.get("teacher chunk [chunk, V]: logits, fp32 copy, logsumexp") == (2 + 4 + 4) * 1024 * V + 8 * V
    assert gpu0.get("KV cache pool") == 8192 * 70_272
    # ring: 3 slots (train=cpu_default) x 8192 tokens x (3Ht aux + Ht final) x bf16
    assert gpu0.get("stream ring slots (aux + final)") == job.train.stream_slots * 8192 * 4 * H * 2
    batch = N * (12 * H + 8 + 1 + 4 * Vd + 4 + 8)  # aux fp32, ids, mask, teacher logits, lse, argmax
    per_token, per_row = _kimi_saved_by_hand(1, N)
    # the last step's (k = 6) backward: dq', dk', dv' of its SDPA at 56 heads over N+1 rows at W = 136 (bf16),
    # fp32 grads of q, U and its 6 diagonal keys and values (8 heads), the log-softmax's, the MLP's
    working = 3 * 2 * 56 * 136 * (N + 1) + (4 * (2 * 56 + 2 * 8 * 6) * 128 + 8 * Vd + 3 * 2 * I) * N
    assert gpu0.phases()["draft fwd+bwd"] == batch + 2 * P + per_token * N + per_row * (N + 1) + working
    assert gpu0.peak_phase() == "draft fwd+bwd"
    # tokens per optimizer step = batch x max_length x grad_accum x trainer ranks
    assert plan.tokens_per_step == 1 * 8192 * 1 * 2
    assert plan_memory(_compose(["+hw=b300x8", *KIMI_DRAFT, "train.grad_accum=4"]), KIMI_K25).tokens_per_step == 65536


def test_b300_mem_fraction_static_hand_computed():
    job = _compose(["+hw=b300x8", *KIMI_DRAFT])
    plan = check_fits(job, KIMI_K25)
    P, V, H = 963_407_872, 163840, 7168
    capacity, ctx = 275040 * MiB, int(0.75 * GiB)
    # on GPU 0 before SGLang loads: the trainer's context, fp32 draft, bf16 lm_head (the embedding
    # stays on the host), vocab maps, DDP gradient buckets (2 trainer ranks; assumed), the ring
    preloaded = (ctx + 4 * P + 2 * V * H + 8 * 32000 + V + 4 * P
                 + 16 * 2 * 4 * MiB  # the trainer's NCCL buffers: 16 channels x 2 ring connections x 4 MiB
                 + job.train.stream_slots * 8192 * 4 * H * 2)
    pre = capacity - ctx - preloaded  # minus SGLang's own context
    need = KIMI_K25.weight_bytes_per_gpu(4) + 8192 * 70_272 + 100 * MiB  # weights + KV + multimodal reservation
    assert plan.mem_fraction_min == pytest.approx(need / pre)
    # the static fraction rounds up the minimum plus hw.kv_pool_margin_gib (1 GiB)
    assert plan.mem_fraction_static == math.ceil((need + GiB) / pre * 100) / 100 == 0.56


# ---------------------------------------------------------------------------- profiles
@pytest.mark.parametrize("hw", ["rtxpro6000x8", "b300x8"])
def test_profile_mem_fraction_is_the_derived_one(hw):
    """The profile's static fraction is the plan's derived one, or one step up where the derived
    one, configured, sizes a KV pool that needs a little more (the fraction also sizes the pool it
    is derived from); the profile's run is accepted with it."""
    job = _compose([f"+hw={hw}", *KIMI_DRAFT, "train.optimizer_device=cpu"])
    plan = check_fits(job, KIMI_K25)
    assert job.hw.mem_fraction_static in (plan.mem_fraction_static, round(plan.mem_fraction_static + 0.01, 2))
    assert job.hw.max_total_tokens >= job.train.batch_size * job.data.max_length


def test_b300_fits_and_names_the_switch_then_the_length_that_fits():
    assert check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT]), KIMI_K25).fits
    long = ["data.max_length=18432", "hw.max_total_tokens=18432"]
    with pytest.raises(PlanError, match=r"fits with: train.activation_checkpointing=true \(same tokens per step\)"):
        check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, *long]), KIMI_K25)
    assert check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, *long, "train.activation_checkpointing=true"]), KIMI_K25)
    # a 24576-token KV pool also needs the static fraction the plan derives for it (with its margin)
    longer = ["data.max_length=24576", "hw.max_total_tokens=24576", "train.activation_checkpointing=true"]
    with pytest.raises(PlanError, match=r"set hw.mem_fraction_static=0.57"):
        check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, *longer]), KIMI_K25)
    assert check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, *longer, "hw.mem_fraction_static=0.57"]), KIMI_K25)
    # with both switches on, only a shorter length is left: the longest multiple of 256 that fits
    job = _compose(["+hw=b300x8", *KIMI_DRAFT, "data.max_length=131072", "hw.max_total_tokens=131072",
                    "train.activation_checkpointing=true", "train.optimizer_device=cpu"])
    with pytest.raises(PlanError) as err:
        check_fits(job, KIMI_K25)
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "GPU 0" in msg and "data.max_length=" in msg
    best = int(msg.split("data.max_length=")[-1].rstrip(")\n "))
    assert best % 256 == 0 and 16384 < best < 131072
    assert plan_memory(job, KIMI_K25, max_length=best).capacity_ok
    assert not plan_memory(job, KIMI_K25, max_length=best + 256).capacity_ok


def _resident_target_and_ring(job) -> int:
    ctx, H = int(0.75 * GiB), 7168
    weights = KIMI_K25.weight_bytes_per_gpu(8)
    marlin = 2048 * 8 * (H + 2048 // 8) * 2  # sm120: the INT4 experts' Marlin MoE caches for 2048 tokens
    # the activations of a 2048-token extend at TP8 (plan/engine.py): residual 2 x 7168 x 2 + MLA
    # attention at 8 heads (1536 + 8 x (192 + 256 + 192 + 128 + 128) + 576 + 7168) x 2, larger than the MoE's
    extend = 2048 * (2 * H * 2 + (1536 + 8 * (192 + 256 + 192 + 128 + 128) + 576 + H) * 2)
    return (ctx + weights + 4096 * 70_272 + 100 * MiB + 2 * GiB + 2048 * 4 * H * 2 + marlin + extend  # SGLang rank 0
            + job.train.stream_slots * 2048 * 4 * H * 2)  # the ring


def test_rtx_fits_with_checkpointing_and_adamw_on_the_host():
    job = _compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "train.optimizer_device=cpu"])
    assert job.train.activation_checkpointing and job.train.optimizer_device == "cpu"
    plan = check_fits(job, KIMI_K25)
    gpu0, gpu1 = plan.gpu(0), plan.gpu(1)
    assert gpu1.role == "target TP rank" and "trainer rank" in gpu0.role
    P, V, H, Vd, N = 963_407_872, 163840, 7168, 32000, 2048
    ctx = int(0.75 * GiB)
    # GPU 0 resident: SGLang rank 0 + ring + the trainer's context, fp32 weights + grads, bf16 lm_head
    assert gpu0.get("AdamW m, v fp32") == 0 and gpu0.get("AdamW foreach temporaries fp32") == 0
    assert gpu0.resident() == _resident_target_and_ring(job) + ctx + 8 * P + 2 * V * H + 8 * Vd + V
    # TTT phase: batch, bf16 weight copies, checkpointed inputs, the last step recomputed, backward working set
    (token7, row7), (token6, row6) = _kimi_saved_by_hand(1, N, 7), _kimi_saved_by_hand(1, N, 6)
    last_step = (token7 - token6) * N + (row7 - row6) * (N + 1)
    batch = N * (12 * H + 8 + 1 + 4 * Vd + 4 + 8)
    kept = (6 * H + 7 * 2 * H + 6 * 2 * 2 * 8 * 128) * N
    working = 3 * 2 * 56 * 136 * (N + 1) + (4 * (2 * 56 + 2 * 8 * 6) * 128 + 8 * Vd + 3 * 2 * 18432) * N
    assert gpu0.phases()["draft fwd+bwd"] == batch + 2 * P + kept + last_step + working
    assert round(gpu0.total() / GiB, 2) == 90.16 and gpu0.total() < gpu0.capacity
    assert any("pinned host memory" in n for n in plan.notes)
    # without the two switches it does not fit, and the refusal names them
    bare = ["train.activation_checkpointing=false", "train.optimizer_device=null"]
    with pytest.raises(PlanError, match=r"fits with: train.activation_checkpointing=true "
                                        r"train.optimizer_device=cpu \(same tokens per step\)"):
        check_fits(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, *bare]), KIMI_K25)
    with pytest.raises(PlanError, match=r"fits with: train.optimizer_device=cpu \("):
        check_fits(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "train.optimizer_device=null"]), KIMI_K25)
    # AdamW on GPU 1 instead: its master, gradient copies, m/v and foreach temporaries land there
    on1 = check_fits(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "train.optimizer_device=cuda:1"]), KIMI_K25)
    assert on1.gpu(1).role == "target TP rank + AdamW state"
    assert on1.gpu(1).total() - on1.gpu(2).total() == ctx + 20 * P
    # a GPU too small for TP rank 0 plus the trainer's resident state: no override helps
    with pytest.raises(PlanError, match="no single override fits"):
        check_fits(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "hw.gpu_memory_mib=81920"]), KIMI_K25)


def test_balance_check_is_turned_off_by_the_engine_not_refused():
    # 12 ring slots of 8192 tokens (5.25 GiB) + the trainer's 9.05 GiB on GPU 0: > 10% of a rank's free memory
    many_slots = ["train.stream_slots=12", "data.max_length=8192", "hw.max_total_tokens=8192"]
    plan = plan_memory(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, *many_slots]), KIMI_K25)
    assert not any("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK" in p for p in plan.problems)
    assert any("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0" in n for n in plan.notes)
    # the knob target_engine/sglang_engine.py sets is the one SGLang 0.5.23 reads at start-up, at call time
    from sglang.srt.environ import envs

    assert envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get() is True  # on by default
    import os

    os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
    try:
        assert envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get() is False
    finally:
        del os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"]


def test_overrides_named_in_refusals():
    with pytest.raises(PlanError, match=r"set hw.mem_fraction_static=0.56"):
        check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, "hw.mem_fraction_static=0.5"]), KIMI_K25)
    # a batch longer than the KV cap raises the pool to it (the plan counts it): 8448 still fits
    long = check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, "data.max_length=8448"]), KIMI_K25)
    assert long.kv_pool_tokens == 8448
    with pytest.raises(PlanError, match=r"train.batch_size=1 train.grad_accum=4"):
        check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, "train.batch_size=4", "hw.max_total_tokens=16384"]), KIMI_K25)
    with pytest.raises(PlanError, match="target_replicas"):
        check_fits(_compose(["+hw=b300x8", *KIMI_DRAFT, "hw.trainer_gpus=[0]"]), KIMI_K25)
    # the cpu profile has no GPU budget to check
    assert check_fits(_compose(["+hw=cpu", *KIMI_DRAFT]), KIMI_K25).fits


def test_every_hw_profile_composes_with_every_target():
    hws = sorted(p.stem for p in (ROOT / "conf" / "hw").glob("*.yaml"))
    targets = sorted(p.stem for p in (ROOT / "conf" / "target").glob("*.yaml"))
    assert {"cpu", "rtxpro6000x8", "b300x8"} <= set(hws) and "kimi_k25" in targets
    for hw in hws:
        for target in targets:
            job = _compose([f"+hw={hw}", f"target={target}", "hw.num_gpus=8", "train.lr=1e-4"])
            assert isinstance(job, JobConfig) and job.hw.name == hw and job.train.lr == 1e-4
            assert job.target.name == OmegaConf.load(ROOT / "conf" / "target" / f"{target}.yaml").name
    kimi = _compose(["+hw=rtxpro6000x8", "target=kimi_k25", "target.path=/models/Kimi-K2.5"])
    assert kimi.target.path == "/models/Kimi-K2.5" and kimi.target.trust_remote_code
    assert kimi.target.end_of_turn_token == "<|im_end|>" and kimi.target.builtin == "none"


@pytest.mark.slow
def test_cli_prints_the_plan_and_refuses():
    cmd = [sys.executable, "-m", "specforge_k25.plan", "+hw=b300x8", *KIMI_DRAFT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("per-GPU memory", "GPU 0,4", "GPU 1-3,5-7", "KV cache pool",
                 "mem_fraction_static: derived 0.56", "tokens per optimizer step: 16,384",
                 "activation checkpointing off", "fits."):
        assert text in out.stdout, text
    out = subprocess.run([*cmd, "data.max_length=18432", "hw.max_total_tokens=18432"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "fits with: train.activation_checkpointing=true" in out.stderr


def test_length_binding_names_the_gpu_that_overflows_and_what_grows_there():
    from specforge_k25.plan.fit import length_binding, longest_fitting_length
    job = _compose(["+hw=rtxpro6000x8", *KIMI_DRAFT])
    longest = longest_fitting_length(job, KIMI_K25)
    text = length_binding(job, KIMI_K25, longest)
    over = plan_memory(job, KIMI_K25, max_length=longest + 256)
    gpu = max(over.gpus, key=lambda g: g.total() - g.capacity)
    assert gpu.total() > gpu.capacity and text.startswith(f"at {longest + 256}: GPU {gpu.gpu} ")
    grows = text.split("growing with the length: ")[1].split("; ")
    assert grows and all(g.rsplit(" ", 2)[0] in {i.name for i in gpu.items} for g in grows)
    assert "target weights" not in text and "KV cache pool" not in text  # fixed: 16384-token pool, weights
    # a target whose context ends first
    short = KIMI_K25.__class__(**{**KIMI_K25.__dict__, "max_position_embeddings": 512})
    assert length_binding(job, short, longest_fitting_length(job, short)) == "the target's context (512) binds"


def test_prefill_chunk_bounds_the_marlin_scratch_to_one_chunk():
    job = _compose(["+hw=rtxpro6000x8", *KIMI_DRAFT])  # sm120: Marlin MoE, 2048-token target batch
    whole = plan_memory(job, KIMI_K25).gpus[0].get("SGLang Marlin MoE scratch (INT4 experts)")
    chunked = plan_memory(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "hw.target_prefill_chunk=512"]), KIMI_K25)
    H, N = 7168, 2048 // 8  # N: the expert width (2048) per TP rank
    assert whole == 2048 * 8 * (H + N) * 2
    assert chunked.gpus[0].get("SGLang Marlin MoE scratch (INT4 experts)") == 512 * 8 * (H + N) * 2
    longer = plan_memory(_compose(["+hw=rtxpro6000x8", *KIMI_DRAFT, "hw.target_prefill_chunk=4096"]), KIMI_K25)
    assert longer.gpus[0].get("SGLang Marlin MoE scratch (INT4 experts)") == whole  # a chunk above the batch: no change
