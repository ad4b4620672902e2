"""The target's lm_head split over the vocabulary between co-located ranks (train/vocab_parallel.py):
three gloo ranks (one launch for every case, tests/fixtures/vocab_parallel_worker.py), each with a
third of the head, give the per-token loss, its gradient and the argmax of one rank holding the
whole head: float64 on a 37-row head (hard labels, distillation mixed and alone, a tie across two
slices), fp32 and bf16 logits of realistic size on a 2003-row head against float64 (a short last
chunk on every rank, a tie on every rank), and the DFlash loss of each rank's own batch.

Every rank's report is read before anything is asserted, so one rank's failure never hides another's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_runs import worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "vocab_parallel_worker.py"
# fp32 / bf16 logits against float64: the loss to 2e-5 of the largest loss (measured <= 2.1e-6:
# fp32's log-sum-exp; the distillation term lse * sum(p) - sum(p z) cancels two values ~60), the
# gradient to 1e-4 (fp32, measured <= 6e-6) or 2e-2 (bf16: dz rounded to bf16, measured <= 5e-3)
# of its largest element. A log-sum-exp shifted by anything but the maximum underflows: inf / nan.
CE_REL = 2e-5
GRAD_REL = {"fp32": 1e-4, "bf16": 2e-2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vocab_parallel") / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=worker_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 3
    return result["ranks"]


def _every_rank(ranks: list[dict], case: str, checks) -> None:
    """`checks(report, rank)` -> {what: holds} for one rank's report of `case`; every rank's
    failures asserted at once (a NaN fails every comparison)."""
    failures = [f"rank {rank}: {what}: {r[case]}" for rank, r in enumerate(ranks)
                for what, holds in checks(r[case], rank).items() if not holds]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("distill", [0.0, 0.5, 1.0])
def test_token_losses_grads_and_argmax_equal_the_whole_head(ranks, distill):
    def checks(case, rank):
        held = {"loss": case["ce"] < 1e-12, "grad": case["grad"] < 1e-12, "argmax": case["correct_equal"],
                "whole head": case["full_head"] == 0.0}
        if rank == 0:  # rows 1, 2: their maximum exactly at 3 and 30; label 3 is correct, 30 not
            held.update({"tie exact": case["tie_exact"], "tie rule": case["tie_rows"] == [1, 0]})
        return held
    _every_rank(ranks, f"tokens_d{distill}", checks)


@pytest.mark.slow
@pytest.mark.parametrize("distill", [0.0, 0.5])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_realistic_logits_with_a_short_last_chunk_equal_float64(ranks, dtype, distill):
    """Logits |z| ~ 13 on average, the largest 65-71, over 2003 rows; rows 7 / 6 / 5 in chunks of 4:
    the last chunk is 3 rows on every rank (a rank's rows in it are at rank * 3 of the gathered
    rows, not rank * 4). An argmax is compared where no rounding can move it (all of bf16's integer
    logits; fp32's with a lead > 1e-3: every row here)."""
    def checks(case, rank):
        return {"loss": case["ce"] <= CE_REL * case["ce_ref_max"], "grad": case["grad_rel"] <= GRAD_REL[dtype],
                "argmax": case["correct_equal"], "rows left out": case["unclear"] == 0,
                "a correct row": case["correct_rows"] > 0,
                "realistic logits": 40 < case["logit_max"] < 100 and 8 < case["logit_mean"] < 30}
    _every_rank(ranks, f"real_{dtype}_d{distill}", checks)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_maximum_tied_across_slices_is_the_first_slices_on_every_rank(ranks, dtype):
    """torch.argmax's rule over the whole vocab: of two rows holding the maximum (exactly 128, an
    integer logit), the one of the earlier slice; rank 0's label is the later one (not correct),
    ranks 1 and 2's the earlier one (correct)."""
    _every_rank(ranks, f"real_{dtype}_d0.0", lambda case, rank: {
        "tie exact": case["tie"]["exact"], "tie rule": case["tie"]["correct"] == case["tie"]["expected"]})
    assert [r[f"real_{dtype}_d0.0"]["tie"]["expected"] for r in ranks] == [0, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_dflash_loss_with_a_slice_of_the_head_equals_the_whole_head(ranks, distill):
    _every_rank(ranks, f"dflash_d{distill}", lambda case, rank: {
        "loss": case["loss_rel"] < 1e-12, "grad": case["grad_rel"] < 1e-12, "argmax": case["correct_equal"],
        "counted": case["counted"] > 0})
