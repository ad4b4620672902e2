"""The co-located layout's FSDP2 sharding (train/sharding.py) on two gloo ranks, for every
method's units (EAGLE-3's top-level modules, DFlash's dotted `layers.i`): the updates equal the
unsharded draft's on the whole batch; EAGLE-3's units are all-gathered once per micro-batch
although the TTT loop calls them K times, DFlash's twice (freed after their forward, gathered
again for their backward), also with the shards and the optimizer on the host."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_runs import worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "sharding_worker.py"


def _run(tmp_path, method: str, *flags: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out), method, *flags],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=worker_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "activation_checkpointing"])
def test_sharded_updates_equal_unsharded_with_the_methods_gathers(tmp_path, method, checkpoint):
    result = _run(tmp_path, method, *(["checkpoint"] if checkpoint else []))
    assert result["compared"] == result["trainable"] > 0 and result["max_rel_diff"] < 1e-12, result
    # kept (EAGLE-3): one all-gather per unit and micro-batch, not K (resharded between the K calls'
    # backward segments); freed (DFlash): two, the forward's and the backward's (a recompute with
    # checkpointing finds the unit gathered); the second micro-batch gathers the updated shards
    # again (not 0: stale weights)
    per_unit = 1 if result["keep_gathered"] else 2
    assert result["keep_gathered"] == (method == "eagle3"), result
    assert result["gathers"] == [per_unit * result["units"]] * 2, result


@pytest.mark.slow
def test_dflash_offloaded_to_the_host_equals_unsharded(tmp_path):
    """train.optimizer_device=cpu in the co-located layout: FSDP2's CPU offload, the same updates."""
    result = _run(tmp_path, "dflash", "checkpoint", "offload")
    assert result["offloaded"] and result["max_rel_diff"] < 1e-12, result
    assert result["gathers"] == [2 * result["units"]] * 2, result
