"""The co-located layout's FSDP2 sharding (train/sharding.py) on two gloo ranks, for every
method's units (EAGLE-3's top-level modules, DFlash's dotted `layers.i`): the updates equal the
unsharded draft's on the whole batch, and each unit is all-gathered once per micro-batch although
the TTT loop calls it K times."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_runs import worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "sharding_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "activation_checkpointing"])
def test_sharded_updates_equal_unsharded_with_one_gather_per_unit(tmp_path, method, checkpoint):
    out = tmp_path / "result.json"
    env = worker_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out), method, *(["checkpoint"] if checkpoint else [])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["compared"] == result["trainable"] > 0 and result["max_rel_diff"] < 1e-12, result
    # one all-gather per unit and micro-batch: not K (resharded between the K calls' backward
    # segments), and the second micro-batch gathers the updated shards again (not 0: stale weights)
    assert result["gathers"] == [result["units"]] * 2, result
