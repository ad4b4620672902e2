"""benchmarks/learning.py --small: the structure of its curves (never their values), and that each
recipe's options reached the run it trained (the checkpoint's fingerprint records them).

Two tiny runs on the embedded tiny DeepSeek target (EAGLE-3 with the WSD schedule; DFlash on
regenerated answers with distillation and given position weights), ~1 minute."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


@pytest.mark.e2e
@pytest.mark.engine
def test_learning_small(tmp_path):
    out = tmp_path / "learning.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--work", str(tmp_path / "runs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out curve" in proc.stdout and "final heads" in proc.stdout
    r = json.loads(out.read_text())
    assert r["benchmark"] == "learning" and r["args"]["small"] is True
    assert set(r["recipes"]) == {"eagle3_wsd", "dflash_distill"}
    for name, rec in r["recipes"].items():
        steps = [p["step"] for p in rec["points"]]
        assert steps == [0, 2, 4, 6] == [*range(0, rec["steps"], 2), rec["steps"]], name  # every eval_every=2 + end
        tokens = [p["tokens_trained"] for p in rec["points"]]
        assert tokens[0] == 0 and all(b > a for a, b in zip(tokens, tokens[1:])) and tokens[-1] == rec["tokens_trained"]
        assert not any(p.get("tokens_estimated") for p in rec["points"])
        depth = 3
        for p in rec["points"]:
            accs = [p[f"acc_{k}"] for k in range(depth)]
            assert all(0 <= a <= 1 for a in accs) and math.isclose(
                p["tau_sim"], 1 + sum(math.prod(accs[:k + 1]) for k in range(depth)), rel_tol=1e-9)
        assert rec["points"][-1]["tau_sim"] == rec["end"]["tau_sim"]
        assert rec["command"].startswith("python -m specforge_k25.train target=tiny_deepseek")
        (state,) = Path(rec["run_dir"]).glob("checkpoints/*/state.json")
        fingerprint = json.loads(state.read_text())["fingerprint"]
        if name == "eagle3_wsd":
            assert (fingerprint["lr_schedule"], fingerprint["decay_ratio"]) == ("wsd", 0.2)
        else:
            assert fingerprint["draft_method"] == "dflash" and fingerprint["lr_schedule"] == "cosine"
            assert (fingerprint["distill"], fingerprint["loss_weights"]) == (0.5, [2.0, 1.0, 1.0])
    assert out.with_suffix(".png").stat().st_size > 0
