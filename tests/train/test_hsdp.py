"""Multi-node data parallel as HSDP (train/sharding.py `data_parallel_mesh`): two "nodes" of two
gloo ranks on loopback (2x2: shard inside a node, replicate across) make the updates of one node
of four (1x4) and of the unsharded draft on the whole batch, for every method's units; a 2x2 run
resumed from its full state continues bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_runs import worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fixtures" / "hsdp_worker.py"


@pytest.mark.slow
def test_two_nodes_of_two_ranks_equal_one_node_of_four_and_resume_bitwise(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=worker_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for method, r in json.loads(out.read_text()).items():
        assert r["hsdp"] and r["placements"] == {"(4,)": ["S(0)"], "(2, 2)": ["R", "S(0)"]}, r
        assert r["compared"] == r["trainable"] > 0 and r["moved"] > 1e-3, (method, r)  # the steps changed the weights
        assert max(r["one_vs_ref"], r["two_vs_ref"], r["two_vs_one"]) < 1e-12, (method, r)
        assert r["resume_bitwise"], (method, r)


def test_nodes_of_a_run():
    from specforge_k25.train.sharding import data_parallel_mesh, nodes_of

    assert nodes_of(16, 8) == 2 and nodes_of(8, 8) == 1
    with pytest.raises(ValueError, match="do not split into nodes of 3"):
        nodes_of(8, 3)
    assert data_parallel_mesh("cpu", world=8, local=8) is None  # one node: fully_shard's default mesh
