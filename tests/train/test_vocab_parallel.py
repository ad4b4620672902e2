"""The target's lm_head split over the vocabulary between co-located ranks (train/vocab_parallel.py):
three gloo ranks, each with 1/3 of a 37-row head (13 + 13 + 11 rows) and its own rows (7, 3 and
none, scored in chunks of 2), give the per-token loss, its gradient and the argmax of one rank
holding the whole head, float64: hard labels, distillation mixed and alone, a tie across two
slices (torch.argmax's first maximum), and the DFlash loss of each rank's own batch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_runs import worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "vocab_parallel_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vocab_parallel") / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=worker_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 3
    return result["ranks"]


@pytest.mark.slow
@pytest.mark.parametrize("distill", [0.0, 0.5, 1.0])
def test_token_losses_grads_and_argmax_equal_the_whole_head(ranks, distill):
    for rank, r in enumerate(ranks):
        case = r[f"tokens_d{distill}"]
        assert case["ce"] < 1e-12 and case["grad"] < 1e-12, (rank, case)
        assert case["correct_equal"] and case["full_head"] == 0.0, (rank, case)
    assert ranks[0][f"tokens_d{distill}"]["tie_rows_checked"]  # row 3 == row 30: label 3 correct, 30 not


@pytest.mark.slow
@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_dflash_loss_with_a_slice_of_the_head_equals_the_whole_head(ranks, distill):
    for rank, r in enumerate(ranks):
        case = r[f"dflash_d{distill}"]
        assert case["loss_rel"] < 1e-12 and case["grad_rel"] < 1e-12 and case["correct_equal"], (rank, case)
        assert case["counted"] > 0
