"""Co-located DFlash (hw.trainer_layout=colocated: a trainer rank beside each TP rank, the draft's
units, its `layers.i` among them, sharded with FSDP2 over gloo) against one dedicated rank reading
the same SGLang TP2 target with the same global batch: the same weights after every step.

DFlash draws each sequence's anchors from its own seed (the run's, the schedule item's and the
sample's), so the co-located ranks (each with its share of the batch) train on the same blocks as
the dedicated rank (the whole batch), with 4 anchors drawn of far more candidates."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from colocated_settings import COMMON
from rank_runs import checkpoint_diffs, max_rel_diff, run_side_by_side

EAGLE_ONLY = ("draft.vocab_size=1024", "draft.ttt_length=3")
DFLASH = [*(o for o in COMMON if o not in EAGLE_ONLY), "draft=dflash", "draft.block_size=4", "draft.num_anchors=4"]


def _cli(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "specforge_k25.train", *overrides, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir}/hydra"]


@pytest.fixture(scope="module")
def dflash_runs(tiny_deepseek_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated_dflash")
    one, two = root / "dedicated", root / "colocated"
    logs = run_side_by_side([_cli(one, [*DFLASH, "train.batch_size=4"]),
                             _cli(two, [*DFLASH, "hw.trainer_layout=colocated", "train.batch_size=2"])], timeout=900)
    return one, two, logs


@pytest.mark.e2e
def test_two_colocated_dflash_ranks_equal_one_dedicated_rank(dflash_runs):
    one, two, logs = dflash_runs
    assert "starting them with torchrun" in logs[1] and "DFlash" in logs[1]
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
