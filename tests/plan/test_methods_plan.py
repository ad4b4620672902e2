"""The plan asks the draft method (the draft group's) for the draft's part: parameters, TTT activations,
FLOPs and the captured states it reads; `compare_methods` and the CLI's table put every method in
the run's place.

Assumed numbers (written out by hand below): Kimi-K2.5 target (H 7168, V 163840, MLA q_lora 1536,
kv_lora 512, nope/rope/v 128/64/128), conf/draft/kimi.yaml (56 heads, I 18432, Vd 32000).
"""
from __future__ import annotations

import pytest

from specforge_k25.config import compose_job
from specforge_k25.draft.registry import get_method
from specforge_k25.plan import (KIMI_K25, PlanError, compare_methods, draft_param_counts, draft_step_flops, plan_memory,
                                predict_layouts, trainable_params, saved_bytes)

KIMI = ["target=kimi_k25", "draft=kimi"]
MLA = "eagle3_mla"
KIMI_OF = {"eagle3": "draft=kimi", MLA: "draft=kimi_mla"}  # each method at Kimi's sizes (conf/draft/)
H, V, Vd, I = 7168, 163840, 32000, 18432
MLA_P = (3 * H * H  # fc over 3 captured states
         + 2 * H * 1536 + 1536  # q_a_proj (input 2H) + q_a_layernorm
         + 1536 * 56 * (128 + 64)  # q_b_proj
         + 2 * H * (512 + 64) + 512  # kv_a_proj_with_mqa + kv_a_layernorm
         + 512 * 56 * (128 + 128)  # kv_b_proj
         + 56 * 128 * H  # o_proj
         + 3 * H * I + 4 * H + Vd * H)  # MLP, 4 norms, lm_head


def _job(hw: str, *extra: str, method: str = "eagle3"):
    return compose_job([f"+hw={hw}", "target=kimi_k25", KIMI_OF[method], *extra])


def test_the_plan_asks_the_method_draft_method_names():
    assert MLA_P == 885_422_080
    job = _job("b300x8", "hw.trainer_layout=dedicated", method=MLA)
    plan = plan_memory(job, KIMI_K25)
    method = get_method(MLA)
    assert plan.method is method and plan.draft.kv_lora_rank == 512
    assert trainable_params(plan.draft) == trainable_params(plan.draft, method) == MLA_P
    assert draft_param_counts(plan.draft)["kv_b_proj"] == 512 * 56 * 256
    gpu0 = plan.gpu(0)
    assert gpu0.get("draft weights fp32") == 4 * MLA_P
    saved = method.plan.saved_bytes(plan.draft, 1, 8192, 7, True)
    assert gpu0.get("TTT saved: per-token tensors (K steps)") == saved["per_token"] == saved_bytes(
        plan.draft, 1, 8192, 7, True)["per_token"]
    assert gpu0.get("TTT backward working set (estimate)") == method.plan.backward_working_bytes(
        plan.draft, 1, 8192, 7, True)
    assert draft_step_flops(plan.draft, 1, 8192, 7) == method.plan.draft_step_flops(plan.draft, 1, 8192, 7)
    # the other method's numbers differ: nothing of it leaks in
    eagle = plan_memory(_job("b300x8", "hw.trainer_layout=dedicated"), KIMI_K25)
    assert eagle.method is not method and eagle.gpu(0).get("draft weights fp32") == 4 * 963_407_872


def test_capture_points_size_the_batch_the_ring_and_fc():
    points = "target.aux_layers=[2,15,30,45,58]"
    job = _job("b300x8", points, "hw.trainer_layout=dedicated", method=MLA)
    plan = plan_memory(job, KIMI_K25)
    N = 8192
    assert plan.draft.num_aux_hidden_states == 5
    assert draft_param_counts(plan.draft)["fc"] == 5 * H * H
    gpu0 = plan.gpu(0)
    batch = N * (4 * 5 * H + 8 + 1 + 4 * Vd + 4 + 8)  # aux fp32 [N, 5Ht], ids, mask, teacher logits, lse, argmax
    assert gpu0.get("batch: aux fp32 [B,T,5Ht] + teacher [B,T,Vd] fp32") == 3 * batch  # teacher, TTT, optimizer
    assert gpu0.get("stream ring slots (aux + final)") == job.train.stream_slots * N * 6 * H * 2
    # the EAGLE-3 head reads exactly 3: a refusal with its reason, not a traceback
    with pytest.raises(PlanError, match="takes exactly 3"):
        plan_memory(_job("b300x8", points), KIMI_K25)
    rows = {r.method: r for r in compare_methods(_job("b300x8", points), KIMI_K25)}
    assert "takes exactly 3" in rows["eagle3"].refused and not rows[MLA].refused


def test_compare_methods_puts_each_method_in_the_runs_place():
    job = _job("rtxpro6000x8")
    rows = {r.method: r for r in compare_methods(job, KIMI_K25)}
    assert {"eagle3", MLA} <= set(rows)  # every registered method has a row
    for name in ("eagle3", MLA):
        row, variant = rows[name], _job("rtxpro6000x8", method=name)
        plan = plan_memory(variant, KIMI_K25)
        assert row.trainable_params == trainable_params(plan.draft)
        assert row.peak_bytes == max(g.total() for g in plan.gpus) and row.fits == plan.capacity_ok
        assert row.tokens_per_s == {k: t.tokens_per_s for k, t in predict_layouts(variant, KIMI_K25).items()}
        assert row.longest_length and row.longest_length % 256 == 0
    assert rows["eagle3"].trainable_params == 963_407_872 and rows[MLA].trainable_params == MLA_P
    # an option one method lacks stays with the method that has it (plan/choose.py carries shared fields only)
    rows = {r.method: r for r in compare_methods(_job("rtxpro6000x8", "draft.fc_norm=true"), KIMI_K25)}
    assert rows["eagle3"].trainable_params == 963_407_872 + 3 * H and rows[MLA].trainable_params == MLA_P


def test_cli_prints_the_mla_draft_and_the_methods_table(capsys):
    from specforge_k25.plan.__main__ import main

    assert main(["+hw=rtxpro6000x8", "target=kimi_k25", KIMI_OF[MLA]]) == 0
    out = capsys.readouterr().out
    # the eagle3 row in the MLA run's place: its sizes, without the KV heads the MLA config has not (MHA)
    for text in ("draft (eagle3_mla): EAGLE-3, MLA attention: H 7168, 56 heads, q_lora 1536, kv_lora 512",
                 "kv_b_proj", "draft methods on hw=rtxpro6000x8", "eagle3_mla (this run)", f"{MLA_P:,}",
                 "eagle3: EAGLE-3, Llama attention: H 7168, heads 56/56 x 128, I 18432, Vd 32000", "fits."):
        assert text in out, text
