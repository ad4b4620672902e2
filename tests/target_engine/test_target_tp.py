"""Tensor-parallel target ranks: TP=2 through the real stream equals TP=1 and HF; a dead rank is
named; the TP group split over two "nodes" (both on this machine) equals TP=1; layout checks."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specforge_k25.stream.target_stream import StreamError, TargetStream
from specforge_k25.target_engine.factory import TargetSpec, check_tp_layout
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget
from specforge_k25.target_engine.layers import default_capture_points
from specforge_k25.target_engine.sglang_engine import cpu_bind_groups

LENGTHS = (23, 7, 41)


def _unused_port() -> int:
    """A port nothing listens on now (the two-'node' test's rendezvous address: as a user would pick one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(path):
    info = read_target_info(path)
    g = torch.Generator().manual_seed(0)
    return info, default_capture_points(info.num_layers), [torch.randint(3, info.vocab_size, (n,), generator=g)
                                                           for n in LENGTHS]


def _cat(got):
    assert [n for lengths, _, _ in got for n in lengths] == list(LENGTHS)
    return torch.cat([a for _, a, _ in got]), torch.cat([f for _, _, f in got])


def _worst(a, r):
    """max |diff| / (1e-4 * max(1, |ref|)): <= 1 is fp32 agreement (see test_target.py)."""
    return ((a - r).abs() / (1e-4 * r.abs().clamp(min=1.0))).max().item()


@pytest.fixture(scope="module")
def tp1_and_hf(tiny_deepseek_path, sglang_capture):
    info, points, seqs = _inputs(tiny_deepseek_path)
    tp1 = _cat(sglang_capture(tiny_deepseek_path, points, seqs, num_threads=1))
    ref = HFTarget(tiny_deepseek_path, points).forward(seqs)
    return tp1, (ref.aux_hidden, ref.final_hidden)


@pytest.mark.engine
def test_tp2_hidden_states_equal_tp1_and_hf(tiny_deepseek_path, sglang_capture, tp1_and_hf):
    """Two SGLang TP ranks (gloo all-reduce on CPU), two batches through the ring, prefilled in
    chunks of 16 tokens (hw.target_prefill_chunk; both ranks cut each batch alike): rank 0's states
    equal the TP=1 engine's one forward per batch and HF's to fp32 tolerance. (The two-node test
    below runs TP 2 one forward per batch.)"""
    info, points, seqs = _inputs(tiny_deepseek_path)
    t0 = time.perf_counter()
    tp2 = _cat(sglang_capture(tiny_deepseek_path, points, seqs, tp_size=2, num_threads=1, prefill_chunk=16))
    print(f"TP2 stream (start + 2 batches): {time.perf_counter() - t0:.1f} s")
    (tp1, ref) = tp1_and_hf
    for name, a, b, r in zip(("aux", "final"), tp2, tp1, ref):
        assert a.shape == b.shape == r.shape
        print(f"{name}: chunked TP2 vs TP1 max |diff| {(a - b).abs().max():.3g}, TP2 vs HF {(a - r).abs().max():.3g}")
        assert _worst(a, b) <= 1.0, f"{name}: TP2 differs from TP1 by {(a - b).abs().max():.3g}"
        assert _worst(a, r) <= 1.0, f"{name}: TP2 differs from HF by {(a - r).abs().max():.3g}"
    assert not torch.equal(tp2[0][:, :info.hidden_size], tp2[0][:, info.hidden_size:2 * info.hidden_size])


def test_tp_ranks_meet_at_a_port_no_other_process_can_take(tiny_deepseek_path):
    """One-node TP: the rendezvous port is bound (by the trainer's TCPStore) before any rank starts
    and stays bound while they start, so no other process can take it between choice and use; the
    ranks reach the store as clients."""
    import socket

    from torch.distributed import TCPStore

    info, points, seqs = _inputs(tiny_deepseek_path)
    spec = TargetSpec(engine="sglang", model_path=tiny_deepseek_path, architecture=info.architecture,
                      capture_points=points, tp_size=2, num_threads=1)
    stream = TargetStream(spec, seqs, [[0]], hidden_size=info.hidden_size, slots=1, timeout_s=60)
    try:
        stream.start()
        port = int(stream.rendezvous.env()["MASTER_PORT"])
        with socket.socket() as thief, pytest.raises(OSError):
            thief.bind(("127.0.0.1", port))
        TCPStore("127.0.0.1", port, is_master=False).set("probe", "ok")
        assert stream.rendezvous.store.get("probe") == b"ok"
    finally:
        stream.close()


@pytest.mark.engine
def test_tp_group_over_two_nodes_equals_tp1(tiny_deepseek_path, tp1_and_hf):
    """SGLang's multi-node fields (nnodes, node_rank, dist_init_addr): node 0 = the trainer's stream
    with TP rank 0, node 1 = `run_tp_node` in another process with TP rank 1; same machine."""
    info, points, seqs = _inputs(tiny_deepseek_path)
    addr = f"127.0.0.1:{_unused_port()}"
    spec = TargetSpec(engine="sglang", model_path=tiny_deepseek_path, architecture=info.architecture,
                      capture_points=points, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
    node1 = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import dataclasses
        from specforge_k25.stream.target_stream import run_tp_node
        from specforge_k25.target_engine.factory import TargetSpec
        spec = TargetSpec(**{dataclasses.asdict(spec)!r})
        spec.node_rank = 1
        run_tp_node(spec)
        print("NODE1 DONE")
    """)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    try:
        got = []
        plan = [[0, 1], [2]]
        with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=2, timeout_s=300) as stream:
            for msg, aux, final in stream:
                got.append((msg.lengths, aux.clone(), final.clone()))
                stream.release(msg)
        out, _ = node1.communicate(timeout=120)
    finally:
        node1.kill()
    assert node1.returncode == 0 and "NODE1 DONE" in out, out[-3000:]
    (tp1, _) = tp1_and_hf
    for name, a, b in zip(("aux", "final"), _cat(got), tp1):
        print(f"{name}: two-node TP2 vs TP1 max |diff| {(a - b).abs().max():.3g}")
        assert _worst(a, b) <= 1.0, f"{name}: two-node TP2 differs from TP1 by {(a - b).abs().max():.3g}"


@pytest.mark.engine
def test_dead_tp_rank_is_named(tiny_deepseek_path):
    """Kill TP rank 1 mid-stream: rank 0 is stuck in a collective or fails in it; either way the
    trainer gets a StreamError naming rank 1 within seconds, and no rank is left running."""
    info, points, _ = _inputs(tiny_deepseek_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, info.vocab_size, (16,), generator=g) for _ in range(30)]
    spec = TargetSpec(engine="sglang", model_path=tiny_deepseek_path, architecture=info.architecture,
                      capture_points=points, tp_size=2)
    stream = TargetStream(spec, seqs, [[i] for i in range(30)], hidden_size=info.hidden_size, slots=1,
                          timeout_s=120, poll_s=0.2)
    with pytest.raises(StreamError, match=r"TP rank 1 of 2.*died with exit code -9"):
        with stream:
            for i, (msg, _, _) in enumerate(stream):
                if i == 1:
                    os.kill(stream.tp_processes[1].pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                stream.release(msg)
    assert time.monotonic() - killed_at < 15
    assert not any(p.is_alive() for p in stream.tp_processes.values())


def _spec(**kw):
    return TargetSpec(engine="sglang", model_path="m", architecture="LlamaForCausalLM", capture_points=[1, 2, 3], **kw)


def test_tp_layout_checks():
    check_tp_layout(_spec(tp_size=8, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29600"))
    assert _spec(tp_size=8, nnodes=2, node_rank=1).local_tp_ranks() == [4, 5, 6, 7]
    assert _spec(tp_size=2).local_tp_ranks() == [0, 1]
    with pytest.raises(ValueError, match="does not split evenly"):
        check_tp_layout(_spec(tp_size=6, nnodes=4, dist_init_addr="h:1"))
    with pytest.raises(ValueError, match="node rank 2 is out of range"):
        check_tp_layout(_spec(tp_size=4, nnodes=2, node_rank=2, dist_init_addr="h:1"))
    with pytest.raises(ValueError, match="rendezvous address"):
        check_tp_layout(_spec(tp_size=4, nnodes=2))
    with pytest.raises(ValueError, match="TP 1 only"):
        check_tp_layout(TargetSpec(engine="hf", model_path="m", architecture="x", capture_points=[1, 2, 3], tp_size=2))


def test_stream_refuses_a_node_without_tp_rank_0():
    spec = _spec(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")
    stream = TargetStream(spec, [torch.arange(4)], [[0]], hidden_size=8, slots=1)
    with pytest.raises(ValueError, match="tp_node"):
        stream.start()
    assert stream.tp_processes == {}


def test_cpu_bind_groups_one_group_per_rank():
    groups = cpu_bind_groups(2).split("|")
    assert len(groups) == 2 and all(groups)
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_bind_groups(1) in (f"{cpus[0]}-{cpus[-1]}", str(cpus[0]), ",".join(map(str, cpus)))


def test_memory_plan_of_a_target_over_two_nodes():
    """TP16 over two 8-GPU nodes: node 0 holds 8 TP ranks (a 1/16 weight shard each), so the plan
    sees GPUs 0-7 only; the same TP16 on one node is refused for lack of GPUs."""
    from specforge_k25.plan import KIMI_K25, plan_memory
    from specforge_k25.config import compose_job as load_job

    base = ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi", "hw.target_tp=16"]
    two = plan_memory(load_job(base + ["hw.target_nnodes=2", "hw.target_dist_init_addr=h:1"]), KIMI_K25)
    one = plan_memory(load_job(base), KIMI_K25)
    assert not any("do not fit on hw.num_gpus" in p for p in two.problems), two.problems
    assert any("do not fit on hw.num_gpus" in p for p in one.problems)
    tp8 = plan_memory(load_job(base[:-1]), KIMI_K25)

    def weights(plan):
        return next(i.bytes for i in plan.gpus[0].items if i.name.startswith("target weights"))

    assert [g.gpu for g in two.gpus if "target" in g.role] == list(range(8))
    assert weights(two) < 0.6 * weights(tp8)  # half the shard (plus the replicated part)
