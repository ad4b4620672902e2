"""The plan's mem_fraction_static against SGLang 0.5.23's own start-up arithmetic
(KVCacheConfigurator._profile_available_bytes and the MLA cache width), run in a fresh process on
the plan's numbers for both GPU profiles: the derived fraction leaves the KV pool it plans plus
hw.kv_pool_margin_gib; SGLang's minimum leaves no margin; just below it the pool is too small."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_k25.config import compose_job
from specforge_k25.plan import KIMI_K25, GiB, plan_memory

PROBE = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_pool_probe.py"
KIMI = ["target=kimi_k25", "draft=kimi", "hw.trainer_layout=dedicated"]


def _probe(cases: list[dict]) -> list[dict]:
    out = subprocess.run([sys.executable, str(PROBE), json.dumps(cases)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plans():
    return {hw: plan_memory(compose_job([f"+hw={hw}", *KIMI]), KIMI_K25) for hw in ("rtxpro6000x8", "b300x8")}


@pytest.mark.slow
def test_the_derived_fraction_leaves_the_planned_pool_and_the_margin(plans, tmp_path):
    cases, expect = [], []
    for hw, plan in plans.items():
        gpu = plan.gpus[0]
        weights = gpu.get("target weights (TP shard + replicated)")
        kv = gpu.get("KV cache pool")
        pre = plan.free_before_load
        margin = compose_job([f"+hw={hw}", *KIMI]).hw.kv_pool_margin_gib * GiB
        for f in (plan.mem_fraction_static, plan.mem_fraction_min, plan.mem_fraction_min - 0.002):
            cases.append({"available_gib": (pre - weights) / GiB, "pre_gib": pre / GiB, "f": f, "multimodal": True})
            expect.append((hw, f, kv, margin))
    cases.append({"mla": {"kv_lora_rank": KIMI_K25.kv_lora_rank, "qk_rope_head_dim": KIMI_K25.qk_rope_head_dim}})
    results = _probe(cases)
    # SGLang's bytes per token per rank for Kimi's MLA cache (bf16, all 61 layers) are the plan's
    assert results[-1]["mla_kv_cache_dim"] * KIMI_K25.num_layers * 2 == KIMI_K25.kv_bytes_per_token(8)
    for (hw, f, kv, margin), got, kind in zip(expect, results, ["derived", "minimum", "below"] * len(plans)):
        rest = got.get("rest_bytes", 0)
        if kind == "derived":
            assert rest >= kv + margin, f"{hw}: f={f} leaves {rest / GiB:.2f} GiB for a {kv / GiB:.2f} GiB pool"
        elif kind == "minimum":
            assert math.isclose(rest, kv, rel_tol=1e-3), f"{hw}: SGLang's minimum leaves {rest} B, plan says {kv}"
        else:
            assert rest < kv, f"{hw}: just below the minimum SGLang still fits the pool ({rest} >= {kv})"


def test_a_fraction_below_the_margin_is_refused_naming_both_switches():
    from specforge_k25.plan import PlanError, check_fits

    job = compose_job(["+hw=rtxpro6000x8", *KIMI, "train.optimizer_device=cpu", "hw.mem_fraction_static=0.82"])
    with pytest.raises(PlanError, match=r"plus hw.kv_pool_margin_gib=1.0 \(0\.82\d+\): set hw.mem_fraction_static=0.83"):
        check_fits(job, KIMI_K25)
    assert check_fits(compose_job(["+hw=rtxpro6000x8", *KIMI, "train.optimizer_device=cpu", "hw.mem_fraction_static=0.82",
                                   "hw.kv_pool_margin_gib=0"]), KIMI_K25).fits
