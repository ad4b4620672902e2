"""Co-located DFlash (hw.trainer_layout=colocated: a trainer rank beside each TP rank, the draft's
units, its `layers.i` among them, sharded with FSDP2 over gloo) against one dedicated rank reading
the same SGLang TP2 target with the same global batch: the same weights after every step.

DFlash draws each sequence's anchors from its own seed (the run's, the schedule item's and the
sample's), so the co-located ranks (each with its share of the batch) train on the same blocks as
the dedicated rank (the whole batch), with 4 anchors drawn of far more candidates. Each co-located
rank holds half of the target's lm_head rows (train/vocab_parallel.py) where the dedicated rank
holds all of them. A resume of the co-located run from its step-2 checkpoint ends on its bits."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colocated_settings import COMMON
from rank_runs import checkpoint_diffs, max_rel_diff, resume_from_copy, run_side_by_side

EAGLE_ONLY = ("draft.vocab_size=1024", "draft.ttt_length=3")
DFLASH = [*(o for o in COMMON if o not in EAGLE_ONLY), "draft=dflash", "draft.block_size=4", "draft.num_anchors=4"]
COLOCATED = [*DFLASH, "hw.trainer_layout=colocated", "train.batch_size=2"]


def _cli(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "specforge_k25.train", *overrides, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir}/hydra"]


@pytest.fixture(scope="module")
def dflash_runs(tiny_deepseek_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated_dflash")
    one, two = root / "dedicated", root / "colocated"
    logs = run_side_by_side([_cli(one, [*DFLASH, "train.batch_size=4"]),
                             _cli(two, COLOCATED)], timeout=900)
    return one, two, logs


@pytest.mark.e2e
def test_two_colocated_dflash_ranks_equal_one_dedicated_rank(dflash_runs):
    one, two, logs = dflash_runs
    assert "starting them with torchrun" in logs[1] and "DFlash" in logs[1]
    assert "the target's lm_head split 2 ways by vocabulary rows" in logs[1]
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert (s1["trainer_ranks"], s2["trainer_ranks"]) == (1, 2)
    assert s1["steps"] == s2["steps"] == 4 and s1["tokens_trained"] == s2["tokens_trained"]
    diffs = checkpoint_diffs(one, two)
    ckpts = sorted(p.name for p in (one / "checkpoints").iterdir())
    assert len(diffs) == len(ckpts) + 1 == 5
    print("max relative weight difference, dedicated vs co-located DFlash:", diffs)
    assert max(diffs.values()) < 1e-6, diffs
    first = load_file(one / "checkpoints" / ckpts[0] / "draft.safetensors")
    assert max_rel_diff(first, load_file(one / "checkpoints" / ckpts[-1] / "draft.safetensors")) > 1e-2
    assert any(k.startswith("layers.0.") for k in first)  # the dotted units trained and were gathered


@pytest.mark.e2e
def test_colocated_dflash_resumes_from_a_step_boundary_bit_exact(dflash_runs, tmp_path):
    _, two, _ = dflash_runs
    run = tmp_path / "resumed"
    assert resume_from_copy(two, run, _cli(run, [*COLOCATED, "train.resume=auto"]))["steps"] == 4
    for a, b in [(two / "export" / "model.safetensors", run / "export" / "model.safetensors"),
                 *((two / "checkpoints" / "step_00000004" / n, run / "checkpoints" / "step_00000004" / n)
                   for n in ("draft.safetensors", "optimizer.safetensors"))]:
        a, b = load_file(a), load_file(b)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "rng.torch")
