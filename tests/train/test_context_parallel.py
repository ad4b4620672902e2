"""Context parallelism (train/context_parallel.py, hw.context_parallel): two gloo ranks each holding
half of every sequence's positions make the loss, gradients and updates of one rank holding whole
sequences; how a batch is cut, which ranks share which sequences, and what is refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rank_runs import worker_env
from specforge_k25.config import HwConfig
from specforge_k25.train.context_parallel import SeqShard, shard_of
from specforge_k25.plan.budget import node_layout
from specforge_k25.setup.layout import World, check_layout
from specforge_k25.train.distributed import Ranks
from specforge_k25.train.learner import pad_packed

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "context_parallel_worker.py"


@pytest.fixture(scope="module")
def two_rank_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp") / "result.json"
    env = worker_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "gqa_repeat", "mla"])
def test_split_positions_give_one_ranks_loss_and_gradients_float64(two_rank_result, case):
    """Llama GQA heads that split (2 KV heads / 2 ranks), one KV head repeated for 2 ranks, and the
    MLA head (latents gathered, kv_b_proj per rank's heads); lengths 9 and 6 cut at 5."""
    r = two_rank_result["float64"][case]
    assert r["counted_equal"], r
    assert r["loss_rel"] < 1e-12 and r["grad_rel"] < 1e-12 and r["grads"] > 10, r


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dflash", "dflash_distill"])
def test_dflash_split_positions_give_one_ranks_loss_and_gradients_float64(two_rank_result, case):
    """DFlash (hard labels, and half distillation from the target's final states in the halo):
    lengths 11 and 8 cut at 6, blocks of 3. Every block runs on exactly one rank (the one holding
    its anchor; a rank running every block fails), attending to the context gathered from both
    (the keys of the other rank's positions left out fails); labels and teacher rows cross the cut."""
    r = two_rank_result["float64"][case]
    assert r["counted_equal"] and r["blocks"] == r["blocks_whole"] and 0 < r["blocks_here"] < r["blocks_whole"], r
    assert r["loss_rel"] < 1e-12 and r["grad_rel"] < 1e-12 and r["grads"] > 10, r


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "mla_checkpointed", "dflash_checkpointed"])
def test_split_learner_trains_as_one_rank(two_rank_result, case):
    """The trainer's path: windows and teacher halo cut by DraftLearner from packed states, FSDP2
    shards, global normaliser, AdamW x 2 steps and an evaluation, fp32 (MLA and DFlash with
    activation checkpointing: the exchanges re-run in backward; DFlash's units freed per layer)."""
    r = two_rank_result["learner"][case]
    assert r["counts_equal"], r
    assert r["loss_rel"] < 1e-6 and r["weight_rel"] < 1e-5, r


def test_shard_windows_cover_the_padded_sequence():
    shards = [shard_of([13, 6], None, c, 4) for c in range(4)]
    assert [(s.start, s.length) for s in shards] == [(0, 4), (4, 4), (8, 4), (12, 4)]
    assert shards[0].padded_length == 16
    assert shard_of([1], None, 1, 2).length == 1  # a one-token batch still gives every rank a position
    assert SeqShard(None, 1, 4, 3).head_slice(8) == slice(2, 4)
    with pytest.raises(ValueError, match="9 attention heads do not split over 2"):
        SeqShard(None, 0, 2, 3).check_heads(9, "attention heads")


def test_pad_packed_takes_a_window_zero_past_each_end():
    packed = torch.arange(1, 8, dtype=torch.float32)[:, None]  # sequences [1..4] and [5..7]
    assert pad_packed(packed, [4, 3])[:, :, 0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert pad_packed(packed, [4, 3], start=2, length=3)[:, :, 0].tolist() == [[3, 4, 0], [7, 0, 0]]
    assert pad_packed(packed, [4, 3], start=4, length=2)[:, :, 0].tolist() == [[0, 0], [0, 0]]


def test_a_context_parallel_group_shares_its_sequences():
    """4 co-located ranks, groups of 2: the replica's batch is train.batch_size x 2 groups, each
    group's ranks get the same sequences, balanced by tokens between the groups."""
    sizes = {10: 50, 11: 7, 12: 30, 13: 22}
    ranks = [Ranks(rank=r, world=4, per_replica=4, colocated=True, cp=2) for r in range(4)]
    assert ranks[0].replica_batch([10, 11, 12, 13, 99], 2) == [10, 11, 12, 13]
    shares = [r.share([10, 11, 12, 13], 2, sizes) for r in ranks]
    assert shares[0] == shares[1] and shares[2] == shares[3]
    assert sorted(shares[0] + shares[2]) == [10, 11, 12, 13]
    assert sorted(sum(sizes[i] for i in s) for s in (shares[0], shares[2])) == [52, 57]
    assert [r.cp_rank for r in ranks] == [0, 1, 0, 1]


def test_context_parallel_layout_rules():
    rtx = dict(name="rtx", device="cuda", num_gpus=8, target_tp=8, trainer_layout="colocated")
    check_layout(HwConfig(**rtx, context_parallel=8), World(size=8, local_size=8))
    check_layout(HwConfig(**rtx, context_parallel=4), World(size=8, local_size=8))
    with pytest.raises(ValueError, match="does not divide the 8 co-located"):
        check_layout(HwConfig(**rtx, context_parallel=3), World(size=8, local_size=8))
    with pytest.raises(ValueError, match="hw.trainer_layout=colocated"):
        check_layout(HwConfig(target_tp=2, context_parallel=2), World())
    with pytest.raises(ValueError, match="pipeline stages"):
        check_layout(HwConfig(target_pp=2, trainer_layout="colocated", context_parallel=2),
                     World(size=2, local_size=2))
    with pytest.raises(ValueError, match="at least 1"):
        check_layout(HwConfig(context_parallel=0), World())
    assert node_layout(HwConfig(**rtx, context_parallel=8)).per_replica == 8
