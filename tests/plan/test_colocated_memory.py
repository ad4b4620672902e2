"""Memory plan of the co-located layout (hw.trainer_layout=colocated): every GPU holds
a TP rank, its own trainer rank with 1/N of the draft's trainable state and AdamW (FSDP2), its own
ring and its share of the batch. One GPU of each profile written out by hand; what fits at which
max_length; refusals name the switch that fits.

Assumed numbers (each written out below): Kimi-K2.5 facts and the Kimi draft as in
test_memory_plan.py (963,407,872 trainable parameters, V 163840, H 7168, Vd 32000; MLA KV 70,272 B
per token; bf16 frozen lm_head; the frozen embedding in host memory); CUDA context 0.75 GiB per process per GPU; SGLang
runtime 2 GiB + the captured states of its batch + the activations of one extend (SGLang's chunk:
8192 tokens on the RTX PRO 6000, 16384 on the B300; `EXTEND_PER_TOKEN`); 3 ring slots; on the RTX PRO 6000
(sm120) the Marlin MoE scratch of Kimi's INT4 experts, one chunk x top-8 x (7168 + 2048 / TP) x 2 B
(plan/kernels.py; the B300 runs FlashInfer's MxInt4 MoE, its intermediates in the extend's MoE part);
each trainer rank's NCCL buffers, 16 channels x 2 x 4 MiB.
"""
from __future__ import annotations

import math

import pytest

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, GiB, MiB, PlanError, check_fits, longest_fitting_length, plan_memory

KIMI_DRAFT = ["target=kimi_k25", "draft=kimi"]
P, V, H, VD = 963_407_872, 163840, 7168, 32000
CTX = int(0.75 * GiB)
COLOC = "hw.trainer_layout=colocated"
CHUNK = {8: 8192, 4: 16384}  # SGLang's chunked_prefill_size: RTX PRO 6000 (TP8), B300 (TP4)
# one extend's activations per token on a TP rank, bf16 (plan/engine.py): the residual stream
# 2 x 7168 x 2 = 28,672 + the larger of MLA attention at h = 64 / TP heads,
# (1536 + 192h + 576 + 256h + 192h + 128h + 128h + 7168) x 2 (TP8: 32,896; TP4: 47,232), and the MoE,
# router 384 x 4 + top-8 ids/weights 8 x 8 + output 7168 x 2 + shared expert 3 x 2048/TP x 2, with the
# trtllm experts' 8 x 3 x 2048/TP x 2 on the B300 (TP8 Marlin: 17,472; TP4: 43,584)
EXTEND_PER_TOKEN = {8: 28_672 + 32_896, 4: 28_672 + 47_232}
NCCL = 16 * 2 * 4 * MiB


def _job(hw: str, *extra: str):
    return compose_job([f"+hw={hw}", *KIMI_DRAFT, *extra])


def _resident_by_hand(tp: int, batch_tokens: int, rank_tokens: int, marlin: bool) -> int:
    """One GPU of the co-located layout before any activation: the SGLang TP rank (context, weights,
    a KV pool of the whole target batch, multimodal reservation, runtime + the batch's captured
    states, `marlin`: the Marlin MoE caches of the batch), this rank's ring, and its trainer rank
    (context, fp32 weights / grads / m+v shards of 1/8, bf16 frozen lm_head, vocab maps; the frozen
    embedding stays on the host)."""
    shard = math.ceil(P / 8)
    extend = min(batch_tokens, CHUNK[tp])
    target = (CTX + KIMI_K25.weight_bytes_per_gpu(tp) + batch_tokens * 70_272 + 100 * MiB + 2 * GiB
              + batch_tokens * 4 * H * 2 + extend * EXTEND_PER_TOKEN[tp]
              + (extend * 8 * (H + 2048 // tp) * 2 if marlin else 0))
    ring = 3 * rank_tokens * 4 * H * 2
    trainer = CTX + (4 + 4 + 8) * shard + 2 * V * H + 8 * VD + V + NCCL
    return target + ring + trainer


def test_rtx_colocated_gpu_hand_computed():
    job = _job("rtxpro6000x8", COLOC, "hw.max_total_tokens=16384")
    plan = check_fits(job, KIMI_K25)
    gpu3 = plan.gpu(3)
    assert [g.gpu for g in plan.gpus] == list(range(8))
    assert gpu3.role == "target TP rank + stream ring + trainer rank"
    assert all(g.total() == gpu3.total() for g in plan.gpus)  # every GPU alike: no TP memory imbalance
    assert not any("INBALANCE" in n for n in plan.notes)
    # the target batch holds one 2048-token sequence for each of the 8 trainer ranks
    assert gpu3.get("KV cache pool") == 16384 * 70_272
    assert gpu3.resident() == _resident_by_hand(8, 16384, 2048, marlin=True)
    assert gpu3.get("SGLang Marlin MoE scratch (INT4 experts)") == 973_078_528  # one chunk: 8192 x 8 x (7168 + 256) x 2
    assert gpu3.get("AdamW m, v fp32 (shard 1/8)") == 8 * math.ceil(P / 8)
    assert gpu3.get("AdamW m, v fp32") == 0 and gpu3.get("DP gradient buckets fp32 (DDP, assumed)") == 0
    # TTT phase: the dedicated trainer's (checked by hand in test_memory_plan.py) with FSDP2's
    # all-gathered bf16 params (2P) and unsharded fp32 grads (4P) in place of the autocast copies (2P)
    dedicated = plan_memory(_job("rtxpro6000x8", "hw.trainer_layout=dedicated"), KIMI_K25).gpu(0)
    assert gpu3.phases()["draft fwd+bwd"] == dedicated.phases()["draft fwd+bwd"] - 2 * P + 2 * P + 4 * P
    assert gpu3.peak_phase() == "draft fwd+bwd"
    assert round(gpu3.total() / GiB, 2) == 91.09 and gpu3.headroom() > 0
    assert plan.tokens_per_step == 2048 * 8
    assert any("hw.trainer_layout=colocated" in n and "1/8" in n for n in plan.notes)
    assert not any("pinned host memory" in n for n in plan.notes)  # AdamW on the GPUs: the profile's default


def test_b300_colocated_gpu_hand_computed():
    job = _job("b300x8", COLOC, "hw.max_total_tokens=32768")
    plan = check_fits(job, KIMI_K25)
    gpu5 = plan.gpu(5)
    assert gpu5.resident() == _resident_by_hand(4, 4 * 8192, 8192, marlin=False)  # a TP4 replica: 4 x 8192
    dedicated = plan_memory(_job("b300x8", "hw.trainer_layout=dedicated"), KIMI_K25).gpu(0)
    assert gpu5.phases()["draft fwd+bwd"] == dedicated.phases()["draft fwd+bwd"] + 4 * P
    assert round(gpu5.total() / GiB, 2) == 208.09
    assert plan.tokens_per_step == 8192 * 8  # 8 trainer ranks over the two replicas


def test_what_fits_at_which_length():
    """Longest data.max_length (multiples of 256) each profile fits co-located; the KV pool follows."""
    cases = [("rtxpro6000x8", True, 3584), ("rtxpro6000x8", False, 1280),
             ("b300x8", False, 17152), ("b300x8", True, 50688)]
    for hw, checkpoint, longest in cases:
        job = _job(hw, COLOC, f"train.activation_checkpointing={str(checkpoint).lower()}")
        assert longest_fitting_length(job, KIMI_K25) == longest, (hw, checkpoint)
        assert plan_memory(job, KIMI_K25, max_length=longest).capacity_ok
        assert not plan_memory(job, KIMI_K25, max_length=longest + 256).capacity_ok
    # dedicated, for comparison: the profiles' own settings
    assert longest_fitting_length(_job("rtxpro6000x8", "hw.trainer_layout=dedicated", "train.optimizer_device=cpu"),
                                  KIMI_K25) == 4608


def test_context_parallel_splits_the_trainer_and_the_target_batch():
    """hw.context_parallel=8 on the RTX node, batch 1 x 16384: the 8 ranks share one sequence, so
    the target batch (KV pool, captured states, Marlin scratch) is one sequence, and each rank's
    ring and trainer hold its window of 16384 / 8 = 2048 positions + the 7 its teacher reads past
    it: the trainer's TTT phase is a 2055-token co-located rank's."""
    job = _job("rtxpro6000x8", COLOC, "hw.context_parallel=8", "data.max_length=16384")
    plan = check_fits(job, KIMI_K25)
    gpu = plan.gpu(5)
    assert gpu.get("KV cache pool") == 16384 * 70_272
    # + the context-parallel group's all-to-all buffers: 2 channels x 2 x 7 peers x 4 MiB
    assert gpu.resident() == _resident_by_hand(8, 16384, 2055, marlin=True) + 2 * 2 * 7 * 4 * MiB
    whole = plan_memory(_job("rtxpro6000x8", COLOC, "data.max_length=2055"), KIMI_K25).gpu(5)
    assert gpu.phases()["draft fwd+bwd"] == whole.phases()["draft fwd+bwd"]
    assert plan.tokens_per_step == 16384
    assert any("each computing on 2055 of its 16384 positions" in n for n in plan.notes)
    # the goals at batch 1: >= 16k on the RTX node, >= 64k on the B300 node (TP4 replicas: C <= 4)
    assert longest_fitting_length(_job("rtxpro6000x8", COLOC, "hw.context_parallel=8"), KIMI_K25) == 29184
    assert longest_fitting_length(_job("b300x8", COLOC, "hw.context_parallel=4"), KIMI_K25) == 69376
    assert longest_fitting_length(_job("rtxpro6000x8", COLOC), KIMI_K25) == 3584  # without: whole sequences
    with pytest.raises(PlanError, match="does not divide the 4 co-located trainer ranks"):
        check_fits(_job("b300x8", COLOC, "hw.context_parallel=8"), KIMI_K25)
    with pytest.raises(PlanError, match="hw.context_parallel=2 splits a sequence over co-located"):
        check_fits(_job("rtxpro6000x8", "hw.trainer_layout=dedicated", "hw.context_parallel=2"), KIMI_K25)


def test_refusals_name_the_switch_that_fits():
    # the profile's 4096-token KV cap is raised to the target batch: 8 sequences of 2048 (it fits)
    plan = check_fits(_job("rtxpro6000x8", COLOC), KIMI_K25)
    assert plan.kv_pool_tokens == 16384 and plan.gpu(3).get("KV cache pool") == 16384 * 70_272
    # without activation checkpointing it needs more than a GPU; the switch is named, host AdamW is not
    with pytest.raises(PlanError, match=r"fits with: train.activation_checkpointing=true \(same tokens per step\)"
                       ) as err:
        check_fits(_job("rtxpro6000x8", COLOC, "hw.max_total_tokens=16384", "train.activation_checkpointing=false"),
                   KIMI_K25)
    assert "optimizer_device" not in str(err.value)
    # too long even with checkpointing: the longest length that fits (its KV pool counted: the pool is
    # hw.max_total_tokens or the target batch, the larger; a 40960-token cap leaves 3328)
    with pytest.raises(PlanError, match=r"lower data.max_length to 3584 \(data.max_length=3584\)"):
        check_fits(_job("rtxpro6000x8", COLOC, "data.max_length=6144", "hw.max_total_tokens=16384"), KIMI_K25)
    with pytest.raises(PlanError, match=r"lower data.max_length to 3328 \(data.max_length=3328\)"):
        check_fits(_job("rtxpro6000x8", COLOC, "data.max_length=6144", "hw.max_total_tokens=40960"), KIMI_K25)
    # a GPU too small for a TP rank and a trainer rank's resident state: the dedicated layout is named
    with pytest.raises(PlanError, match="hw.trainer_layout=dedicated"):
        check_fits(_job("rtxpro6000x8", COLOC, "hw.max_total_tokens=16384", "hw.gpu_memory_mib=78000"), KIMI_K25)
    # a layout that is neither is refused by name (plan/budget.py node_layout, which every user reads)
    with pytest.raises(PlanError, match="hw.trainer_layout='shared': expected one of dedicated, colocated"):
        plan_memory(_job("rtxpro6000x8", "hw.trainer_layout=shared"), KIMI_K25)
