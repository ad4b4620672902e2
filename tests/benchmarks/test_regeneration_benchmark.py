"""Smoke test of benchmarks/regeneration.py: the structure of its result, never its timings.

The benchmark builds an SGLang engine in its own process (SGLang's process-wide state stays out of
pytest's), generates 4 tokens for 2 MT-bench prompts and prefills the conversations (~30 s)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "regeneration.py"


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.engine
def test_regeneration_smoke(tmp_path):
    out = tmp_path / "regeneration.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True, check=False,
                          timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill / generate" in proc.stdout and "decode capture: answer rows" in proc.stdout
    r = json.loads(out.read_text())
    assert r["benchmark"] == "regeneration" and r["args"]["smoke"] is True
    n, m = r["n_prompts"], r["max_new_tokens"]
    assert (n, m) == (2, 4)
    assert len(r["prompt_lengths"]) == len(r["answer_lengths"]) == n
    assert all(1 <= a <= m for a in r["answer_lengths"])
    assert r["answer_tokens"] == sum(r["answer_lengths"]) and r["prompt_tokens"] == sum(r["prompt_lengths"])
    assert r["conversation_tokens"] == r["prompt_tokens"] + r["answer_tokens"]
    assert r["decode_steps"] == max(r["answer_lengths"]) - 1  # the last token is never fed
    t = r["timings"]
    for key in ("engine_start_s", "generate_best_s", "prefill_best_s", "prefill_over_generate",
                "prefill_design_speed_vs_capture", "generate_new_tokens_per_s", "generate_all_tokens_per_s",
                "prefill_tokens_per_s", "decode_ms_per_step"):
        assert finite(t[key]) and t[key] > 0, key
    assert len(t["generate_s"]) == r["reps"] and len(t["prefill_s"]) == r["reps"] + 1

    e = r["exactness"]
    # the prefill design is exact by construction: the same batch prefilled again gives the same bits
    again = e["prefill_again"]
    assert again["positions"] == r["conversation_tokens"]
    assert again["aux"] == again["final"] == again["aux_max_abs_diff"] == again["final_max_abs_diff"] == 0.0
    assert finite(e["prefill_alone_vs_packed"]["aux"]) and finite(e["prefill_alone_vs_packed"]["final"])
    # the decode capture is reported, per part; every prompt token and every fed answer token compared
    d = e["decode_capture"]
    assert d["prompt_rows"]["positions"] == r["prompt_tokens"]
    assert d["answer_rows"]["positions"] == r["fed_answer_tokens"] >= r["decode_steps"] > 0
    assert d["all"]["positions"] == r["prompt_tokens"] + r["fed_answer_tokens"]
    for part in ("all", "prompt_rows", "answer_rows"):
        for key in ("aux", "final", "aux_max_abs_diff", "final_max_abs_diff"):
            assert finite(d[part][key]) and d[part][key] >= 0, (part, key)
    # not a tolerance check: a row assembled at the wrong position would differ by ~|h| (ratio ~1e4)
    assert d["all"]["aux"] < 50 and d["all"]["final"] < 50, d["all"]
    w = d["worst_position"]
    assert w["ratio"] == max(d["all"]["aux"], d["all"]["final"])
    assert 0 <= w["conversation"] < n and {"position", "row", "aux", "final"} <= set(w)
    assert r["machine"]["cpu_count"] and r["model"]["dtype"] == "float32"
