"""The pipeline (PP) layout's plan (specforge_k25/plan/pipeline.py; issue 23 item 1): SGLang's layer
split by hand, one made-up case's per-stage microseconds by hand, and what the plan predicts for
Kimi-K2.5 on rtxpro6000x8 (predicted; the runtime is tested in tests/target_engine/test_target_pp.py and tests/train).

Assumed numbers (written out below): Kimi-K2.5's shapes as tests/plan/test_throughput.py
(attention projections 101,122,048 per layer; dense MLP 3 x 7168 x 18432; an MoE layer 9 experts of
3 x 7168 x 2048 + a 384 x 7168 router); SGLang 0.5.23 `get_pp_indices`: num_layers // pp per stage,
the last num_layers % pp stages one more.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, PlanError, predict
from specforge_k25.plan.choose import predict_pipelines
from specforge_k25.plan.pipeline import (STAGE_TRANSFERS, first_stages_partition, layer_weight_bytes,
                                         owned_states, pp_layer_split, predict_pipeline, stage_flops_per_token)
from specforge_k25.plan.throughput import (TARGET_ALLREDUCE, TARGET_COMPUTE, TRAINER_COMPUTE, TRAINER_GRADS,
                                           TRAINER_OPTIMIZER, target_flops_per_token)

US = 1e-6


def _counts(split):
    return [b - a for a, b in split]


def test_sglang_default_layer_split_by_hand():
    # 61 = 8 x 7 + 5: the last five stages hold 8 layers
    assert _counts(pp_layer_split(61, 8)) == [7, 7, 7, 8, 8, 8, 8, 8]
    assert pp_layer_split(61, 8)[4] == (29, 37) and pp_layer_split(61, 8)[7] == (53, 61)
    assert _counts(pp_layer_split(30, 2)) == [15, 15]  # SmolLM2-135M
    assert _counts(pp_layer_split(61, 4)) == [15, 15, 15, 16]
    assert _counts(pp_layer_split(61, 8, [8, 8, 8, 8, 8, 7, 7, 7])) == [8, 8, 8, 8, 8, 7, 7, 7]
    assert first_stages_partition(61, 8) == [8, 8, 8, 8, 8, 7, 7, 7] and first_stages_partition(30, 2) is None
    # Kimi's default capture points [2, 30, 58]: stages 0, 4 and 7 (with the final state)
    assert owned_states(pp_layer_split(61, 8), [2, 30, 58]) == [["aux 2"], [], [], [], ["aux 30"], [], [],
                                                               ["aux 58", "final"]]


def test_kimi_stage_flops_and_weights_add_up():
    split = pp_layer_split(61, 8)
    flops = stage_flops_per_token(KIMI_K25, 2048, split)
    assert sum(flops) == pytest.approx(target_flops_per_token(KIMI_K25, 2048)["total"], rel=1e-12)
    w = layer_weight_bytes(KIMI_K25)
    assert 0 <= KIMI_K25.weight_bytes - (sum(w.layers) + w.embedding + w.lm_head) < 60  # the rest's rounding
    # dense bf16 parts: 61 x attention, 1 dense MLP, 60 x (shared expert + router), embedding and lm_head
    dense = 2 * (61 * 101_122_048 + 3 * 7168 * 18432 + 60 * (3 * 7168 * 2048 + 384 * 7168) + 2 * 163840 * 7168)
    assert w.experts_per_moe_layer == (595_000_000_000 - dense) // 60
    assert round(w.experts_per_moe_layer / 1e9, 2) == 9.53


def _made_up_job():
    return compose_job(["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.num_gpus=2", "hw.target_tp=2",
                        "hw.peak_tflops=100", "hw.target_efficiency=0.5", "hw.link_gbps=10", "hw.memory_gbps=8000",
                        "target.aux_layers=[1,3,4]", "data.max_length=1024"])


def test_made_up_two_stage_microseconds_by_hand():
    """Kimi's layer shapes cut to 5 layers (1 dense + 4 MoE, 10 GB of weights), 2 GPUs, PP2: stage 0
    holds layers 0-1 (aux 1), stage 1 layers 2-4 (aux 3, aux 4, final, lm_head)."""
    facts = replace(KIMI_K25, num_layers=5, num_moe_layers=4, weight_bytes=10_000_000_000)
    job = _made_up_job()
    p = predict_pipeline(job, facts, pp=2, tp=1, memory=False)
    assert p.split == [(0, 2), (2, 5)] and p.states == [["aux 1"], ["aux 3", "aux 4", "final"]]
    attn = 2 * 64 * (192 + 128) * 1025 / 2  # causal attention of one layer at T 1024
    dense = 2 * (101_122_048 + 3 * 7168 * 18432) + attn
    moe = 2 * (101_122_048 + 9 * 3 * 7168 * 2048 + 384 * 7168) + attn
    lm_head = 2 * 163840 * 7168 / 1024
    rate = 100e12 * 0.5
    g0, g1 = p.throughput.gpu(0), p.throughput.gpu(1)
    assert g0.parts[TARGET_COMPUTE] == pytest.approx((dense + moe) / rate, rel=1e-12)
    assert g1.parts[TARGET_COMPUTE] == pytest.approx((3 * moe + lm_head) / rate, rel=1e-12)
    assert (round(g0.parts[TARGET_COMPUTE] / US, 2), round(g1.parts[TARGET_COMPUTE] / US, 2)) == (40.75, 61.33)
    # stage 0 sends the proxy (2 x 7168 x 2 B) and aux 1 to the half of the tokens trained on GPU 1; it
    # receives aux 3, aux 4 and the final state of its own half: max(35,840, 21,504) B at 10 GB/s
    assert g0.parts[STAGE_TRANSFERS] == pytest.approx((28672 + 14336 / 2) / 10e9, rel=1e-12)
    # stage 1 receives the proxy and aux 1 of its half, sends 3 states to GPU 0's half: max(35,840, 21,504)
    assert g1.parts[STAGE_TRANSFERS] == pytest.approx((28672 + 14336 / 2) / 10e9, rel=1e-12)
    assert g0.parts[TARGET_ALLREDUCE] == g1.parts[TARGET_ALLREDUCE] == 0.0
    # the trainer share is the co-located TP2 layout's: half the trainer per token on each GPU
    coloc = predict(job, facts, "colocated").gpu(0)
    for part in (TRAINER_COMPUTE, TRAINER_OPTIMIZER, TRAINER_GRADS):
        assert g0.parts[part] == pytest.approx(coloc.parts[part], rel=1e-12)
    assert p.bottleneck_stage == 1
    assert p.throughput.tokens_per_s == pytest.approx(1 / g1.busy, rel=1e-12)
    # start/drain: one micro-batch (1024 tokens) of stage 1's target work, once per run
    assert p.fill_s == pytest.approx(1024 * (g1.parts[TARGET_COMPUTE] + g1.parts[STAGE_TRANSFERS]), rel=1e-12)


def test_kimi_rtx_pipeline_beats_colocated_tp():
    job = compose_job(["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi"])
    plans = predict_pipelines(job, KIMI_K25)
    best = next(p for p in plans if p.fits)
    assert (best.pp, best.tp, best.replicas, best.partition) == (8, 1, 1, None)
    # the 8-layer stages set the rate; stage 4 (layers 29-36) also sends aux 30 besides the proxy
    assert best.bottleneck_stage == 4
    g = best.throughput.gpu(4)
    assert max(g.parts, key=g.parts.get) == TARGET_COMPUTE
    assert round(g.parts[TARGET_COMPUTE] / US, 1) == 47.3 and g.parts[TARGET_ALLREDUCE] == 0.0
    colocated = predict(job, KIMI_K25, "colocated")
    assert best.throughput.tokens_per_s > 2 * colocated.tokens_per_s
    assert best.throughput.of_compute_bound > 0.8 > 0.4 > colocated.of_compute_bound
    # PP2 and PP4 replicas are faster on paper but do not fit a 96 GiB GPU; the last stage (lm_head) is the fullest
    assert not any(p.fits for p in plans if p.pp < 8 and p.tp == 1)
    assert max(best.memory, key=lambda x: x.total()) is best.memory[7]


def test_a_pipeline_run_is_checked_against_the_per_stage_plan():
    """hw.target_pp > 1 on GPU: the run is refused unless every stage GPU fits (pipeline_memory)
    and mem_fraction_static covers the fullest stage; a dedicated trainer is not planned."""
    from specforge_k25.config import compose_job
    from specforge_k25.plan import KIMI_K25, with_hw_overrides
    from specforge_k25.plan.pipeline import check_pipeline_fits, pipeline_memory

    base = ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.target_pp=8", "hw.target_tp=1"]
    job = compose_job(base + ["hw.mem_fraction_static=0.9"])
    facts = with_hw_overrides(job.hw, KIMI_K25)
    check_pipeline_fits(job, facts)  # 2048 fits (stage 7: 94.74 of 95.59 GiB)
    frac = pipeline_memory(job, facts, 8, 1)[2]
    low = compose_job(base + ["hw.mem_fraction_static=0.8"])
    with pytest.raises(PlanError, match=f"set hw.mem_fraction_static={math.ceil(frac * 100) / 100}"):
        check_pipeline_fits(low, facts)
    long = compose_job(base + ["hw.mem_fraction_static=0.9", "data.max_length=8192"])
    with pytest.raises(PlanError, match=r"stage \d \(GPU \d\) needs .*longest data.max_length that fits is 3072"):
        check_pipeline_fits(long, facts)
    with pytest.raises(PlanError, match="hw.trainer_layout=colocated"):
        check_pipeline_fits(compose_job(base + ["hw.trainer_layout=dedicated"]), facts)
