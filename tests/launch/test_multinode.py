"""launch/multinode.py: the per-node commands of a dry run, and clear errors for bad input."""
from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

LAUNCHER = str(Path(__file__).resolve().parents[2] / "launch" / "multinode.py")
KIMI = ["+hw=rtxpro6000x8", "target=kimi_k25", "target.path=/models/Kimi-K2.5", "hw.trainer_layout=dedicated"]


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LAUNCHER, *args], capture_output=True, text=True, timeout=120)


def _commands(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if not line.startswith("#")]


@pytest.mark.slow
def test_one_node_dry_run():
    out = _launch("--nodes", "1", "--dry-run", "--", "+hw=b300x8", "train.lr=1e-4")
    assert _commands(out) == [
        "torchrun --nnodes 1 --node-rank 0 --nproc-per-node 8 --rdzv-backend static --rdzv-endpoint 127.0.0.1:29500 "
        "-m specforge_k25.train +hw=b300x8 train.lr=1e-4",  # b300x8: co-located, a trainer rank per GPU
    ]
    assert out.stdout.startswith("# node 0 of 1: 8 co-located trainer ranks beside 2 TP 4 target replica(s)")
    dedicated = _launch("--nodes", "1", "--dry-run", "--", "+hw=b300x8", "hw.trainer_layout=dedicated")
    assert " --nproc-per-node 2 " in _commands(dedicated)[0]  # two target replicas -> two trainer ranks
    assert dedicated.stdout.startswith("# node 0 of 1: 2 trainer rank(s), each with a TP 4 target replica")


@pytest.mark.slow
def test_two_nodes_data_parallel_dry_run():
    out = _launch("--nodes", "2", "--master-addr", "10.0.0.1", "--dry-run", "--", *KIMI)
    assert _commands(out) == [
        "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29500 "
        "-m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 hw.trainer_layout=dedicated",
        "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29500 "
        "-m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 hw.trainer_layout=dedicated",
    ]
    # --node-rank with --dry-run prints that node only
    only = _launch("--nodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--dry-run", "--", *KIMI)
    assert _commands(only) == _commands(out)[1:]


def test_two_nodes_one_target_over_both_dry_run():
    out = _launch("--nodes", "2", "--master-addr", "10.0.0.1", "--target-nodes", "2", "--target-port", "29700",
                  "--iface", "eth1", "--dry-run", "--", *KIMI, "hw.target_tp=16")
    env = [line for line in out.stdout.splitlines() if line.startswith("# environment: ")]
    assert env == [f"# environment: NCCL_SOCKET_IFNAME=eth1 GLOO_SOCKET_IFNAME=eth1 SGLANG_HOST_IP=<eth1's IPv4 "
                   f"address on node {i}, read there>" for i in range(2)], out.stdout  # --iface: every node's three
    assert _commands(out) == [
        "torchrun --nnodes 1 --node-rank 0 --nproc-per-node 1 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29500 "
        "-m specforge_k25.train +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 hw.trainer_layout=dedicated hw.target_tp=16 "
        "hw.target_nnodes=2 hw.target_node_rank=0 hw.target_dist_init_addr=10.0.0.1:29700",
        "python -m specforge_k25.train.tp_node +hw=rtxpro6000x8 target=kimi_k25 target.path=/models/Kimi-K2.5 "
        "hw.trainer_layout=dedicated hw.target_tp=16 hw.target_nnodes=2 hw.target_node_rank=1 hw.target_dist_init_addr=10.0.0.1:29700",
    ]
    assert "# node 1 of 2: target TP ranks 8..15 of 16 (no trainer)" in out.stdout


@pytest.mark.slow
def test_bad_input_is_refused_clearly():
    cases = [
        (["--nodes", "2", "--node-rank", "2", "--master-addr", "h", "--dry-run"], "--node-rank 2 is out of range"),
        (["--nodes", "2", "--node-rank", "-1", "--master-addr", "h", "--dry-run"], "--node-rank -1 is out of range"),
        (["--nodes", "2", "--dry-run", "--", *KIMI], "--master-addr"),
        (["--nodes", "2", "--master-addr", "h", "--", *KIMI], "--node-rank is required"),
        (["--nodes", "0", "--dry-run"], "at least one node"),
        (["--nodes", "3", "--master-addr", "h", "--target-nodes", "2", "--dry-run"], "--target-nodes 2: use 1"),
        (["--nodes", "2", "--master-addr", "h", "--target-nodes", "2", "--dry-run", "--", "+hw=b300x8",
          "hw.trainer_layout=dedicated"], "hw.target_replicas=1, got 2"),
        (["--nodes", "2", "--master-addr", "h", "--target-nodes", "2", "--dry-run", "--", "+hw=b300x8"],
         "add hw.trainer_layout=dedicated"),
        (["--nodes", "2", "--master-addr", "h", "--target-nodes", "2", "--dry-run", "--", *KIMI, "hw.target_tp=7"],
         "does not split evenly"),
        (["--nodes", "2", "--master-addr", "h", "--dry-run", "--", "hw.target_node_rank=1"], "set by the launcher"),
        (["--nodes", "1", "--dry-run", "--", "hw.no_such_field=1"], "do not compose"),
    ]
    for args, message in cases:
        out = _launch(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr and out.stdout == "", (args, out.stderr)


def test_help():
    out = _launch("--help")
    assert out.returncode == 0 and "--master-addr" in out.stdout and "--dry-run" in out.stdout


def test_iface_sets_the_three_variables_for_the_command_a_node_runs(tmp_path, monkeypatch):
    """Run (not --dry-run) with a stand-in torchrun that prints what it inherited: the interface's
    name for NCCL and gloo and its address (read on this node) for SGLang; an interface the node
    lacks is refused by name before anything starts."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "inherited $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $SGLANG_HOST_IP $1 $2"\n')
    fake.chmod(0o755)
    out = _launch("--nodes", "1", "--iface", "lo", "--torchrun", str(fake), "--", "train.lr=1e-4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "inherited lo lo 127.0.0.1 --nnodes 1"
    assert out.stdout.startswith("node 0 of 1: NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo SGLANG_HOST_IP=127.0.0.1 ")

    import importlib.util
    spec = importlib.util.spec_from_file_location("multinode", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "multinode", launcher)  # its dataclass looks its module up
    spec.loader.exec_module(launcher)
    with pytest.raises(launcher.LaunchError, match=r"--iface no_such0: no such network interface on this node "
                                                   r"\(it has: lo"):
        launcher.interface_address("no_such0")
