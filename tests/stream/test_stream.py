"""The two-process stream: order, content, backpressure, and failure detection.

Uses the HF reference engine in the target process (fast to start); the SGLang engine goes
through the same `TargetStream` in tests/target_engine/test_target.py and tests/train/test_train_e2e.py.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from specforge_k25.stream.target_stream import StreamError, TargetStream
from specforge_k25.target_engine.factory import TargetSpec
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.target_engine.hf_reference import HFTarget


def _spec(path, **kw):
    info = read_target_info(path)
    return TargetSpec(engine="hf", model_path=path, architecture=info.architecture, capture_points=[2, 4, 5], **kw), info


def _seqs(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.slow
def test_stream_delivers_plan_in_order_with_exact_tensors(tiny_deepseek_path):
    spec, info = _spec(tiny_deepseek_path)
    seqs = _seqs(7, info.vocab_size)
    plan = [[3, 0], [6], [1, 2, 5], [4]]
    ref = HFTarget(tiny_deepseek_path, [2, 4, 5])
    got = []
    with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=2, timeout_s=120) as stream:
        for msg, aux, final in stream:
            got.append((msg.item, msg.lengths, aux.clone(), final.clone()))
            stream.release(msg)
    assert [g[0] for g in got] == [0, 1, 2, 3]
    for (item, lengths, aux, final), batch in zip(got, plan):
        assert lengths == [len(seqs[i]) for i in batch]
        expect = ref.forward([seqs[i] for i in batch])
        # same weights and inputs; only the thread count differs between the processes (summation order)
        torch.testing.assert_close(aux, expect.aux_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, expect.final_hidden, rtol=1e-5, atol=1e-5)
    assert stream.target_io is not None and stream.target_io.streaming_write_bytes == 0


@pytest.mark.slow
def test_backpressure_bounds_batches_in_flight(tiny_deepseek_path):
    """With S slots the target can never be more than S batches ahead of a slow trainer."""
    spec, info = _spec(tiny_deepseek_path)
    seqs = _seqs(12, info.vocab_size, seed=1)
    plan = [[i] for i in range(12)]
    slots = 2
    depths = []
    with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=slots, timeout_s=120) as stream:
        for msg, aux, final in stream:
            time.sleep(0.3)  # a slow trainer: the target fills every free slot meanwhile
            depths.append(stream.depth())
            stream.release(msg)
    # the consumer holds one slot while sleeping, so at most slots-1 others can be ready (the last
    # two readings may also count the end-of-stream marker, which occupies no slot)
    assert max(depths[:-2]) <= slots - 1 and max(depths) <= slots
    assert max(depths) >= 1  # and the target did run ahead (the pipeline overlaps)


@pytest.mark.slow
def test_slow_consumer_copies_what_the_producer_wrote_checksum_every_slot(tiny_deepseek_path):
    """Stress the slot hand-off: 2 slots, 16 batches, a consumer slower than the target. The
    producer records a float64 checksum of every slot it fills; the consumer copies the batch out,
    hands the slot back, then (slowly) checks its copy: every checksum must match, so no slot was
    overwritten while the consumer still read it (a copy after the release would see the next batch)."""
    from specforge_k25.stream.ring import slot_checksum

    spec, info = _spec(tiny_deepseek_path)
    seqs = _seqs(16, info.vocab_size, seed=3)
    checked = 0
    with TargetStream(spec, seqs, [[i] for i in range(16)], hidden_size=info.hidden_size, slots=2,
                      timeout_s=120) as stream:
        for msg, aux, final in stream:
            copy = (aux.clone(), final.clone())  # what the trainer keeps (DraftLearner.make_batch copies)
            stream.release(msg)
            time.sleep(0.05)  # the producer refills the slot meanwhile
            assert slot_checksum(*copy) == msg.checksum, f"batch {msg.item}: the copy is not what was produced"
            checked += 1
    assert checked == 16


@pytest.mark.slow
def test_five_aux_states_cross_the_ring_intact(tiny_deepseek_path):
    """K=5 capture points: the spec's K sizes the ring's slots [max_tokens, 5Ht]; every batch arrives
    whole (the consumer's copy has the producer's checksum) and equal to HF's five states in order."""
    from specforge_k25.stream.ring import slot_checksum

    points = [1, 2, 4, 5, 7]
    spec, info = _spec(tiny_deepseek_path)
    spec.capture_points = points
    assert spec.num_aux == 5
    seqs = _seqs(5, info.vocab_size, seed=4)
    plan = [[0, 1], [2], [3, 4]]
    ref = HFTarget(tiny_deepseek_path, points)
    H = info.hidden_size
    items = []
    with TargetStream(spec, seqs, plan, hidden_size=H, slots=2, timeout_s=120) as stream:
        assert all(t.shape[1] == 5 * H for t in stream.ring.aux)
        for msg, aux, final in stream:
            items.append(msg.item)
            copy = (aux.clone(), final.clone())
            stream.release(msg)
            assert slot_checksum(*copy) == msg.checksum, f"batch {msg.item}: the copy is not what was produced"
            expect = ref.forward([seqs[i] for i in plan[msg.item]])
            assert copy[0].shape == (sum(msg.lengths), 5 * H)
            torch.testing.assert_close(copy[0], expect.aux_hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(copy[1], expect.final_hidden, rtol=1e-5, atol=1e-5)
    assert items == [0, 1, 2]


def test_ring_refuses_states_of_another_count_before_taking_a_slot():
    from specforge_k25.stream.ring import SlotRing

    ring = SlotRing(torch.multiprocessing.get_context("spawn"), 1, 8, 4, torch.float32, num_aux=5)
    try:
        assert ring.aux[0].shape == (8, 20)
        with pytest.raises(ValueError, match=r"aux \[3, 12\] / final \[3, 4\] for a ring of 5 aux states x 4"):
            ring.put(0, torch.ones(3, 12), torch.ones(3, 4), [3])
        ring.put(0, torch.ones(3, 20), torch.ones(3, 4), [3])  # the one slot is still free
        msg = ring.get(timeout=10)
        assert msg.checksum == 72.0 and ring.view(msg)[0].shape == (3, 20)
    finally:
        ring.close()


@pytest.mark.slow
def test_group_signals_leave_the_target_serving(tiny_deepseek_path):
    """SIGTERM and SIGINT reach a rank's whole process group (torchrun, Slurm, Ctrl-C); the target
    ignores them, also while it starts up, and serves every batch until the trainer stops it."""
    spec, info = _spec(tiny_deepseek_path)
    seqs = _seqs(6, info.vocab_size, seed=3)
    got = []
    with TargetStream(spec, seqs, [[i] for i in range(6)], hidden_size=info.hidden_size, slots=1,
                      timeout_s=120, poll_s=0.2) as stream:
        os.kill(stream.process.pid, signal.SIGTERM)  # still importing: blocked, then ignored
        for msg, aux, final in stream:
            if msg.item == 1:
                os.kill(stream.process.pid, signal.SIGTERM)
                os.kill(stream.process.pid, signal.SIGINT)
            got.append(msg.item)
            stream.release(msg)
    assert got == list(range(6))
    assert not stream.process.is_alive()


@pytest.mark.slow
def test_dead_target_process_is_reported_quickly(tiny_deepseek_path):
    spec, info = _spec(tiny_deepseek_path)
    seqs = _seqs(40, info.vocab_size, seed=2)
    plan = [[i] for i in range(40)]
    stream = TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=1, timeout_s=120, poll_s=0.2)
    with pytest.raises(StreamError, match=r"specforge-target .* died"):
        with stream:
            for i, (msg, aux, final) in enumerate(stream):
                if i == 1:
                    os.kill(stream.process.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                stream.release(msg)
    assert time.monotonic() - killed_at < 10
    assert not stream.process.is_alive()


@pytest.mark.slow
def test_engine_start_failure_names_the_stage(tmp_path, tiny_deepseek_path):
    spec, info = _spec(tiny_deepseek_path)
    spec.model_path = str(tmp_path / "no-such-model")
    with pytest.raises(StreamError, match="engine start"):
        with TargetStream(spec, _seqs(2, 100), [[0], [1]], hidden_size=info.hidden_size, timeout_s=60) as stream:
            for msg, _, _ in stream:
                stream.release(msg)


@pytest.mark.slow
def test_stalled_target_times_out(tiny_deepseek_path):
    spec, info = _spec(tiny_deepseek_path)
    stream = TargetStream(spec, _seqs(3, info.vocab_size), [[0], [1], [2]], hidden_size=info.hidden_size,
                          timeout_s=1.0, start_timeout_s=1.0, poll_s=0.2)
    with pytest.raises(StreamError, match="produced nothing"):
        with stream:
            os.kill(stream.process.pid, signal.SIGSTOP)  # alive but frozen
            try:
                for msg, _, _ in stream:
                    stream.release(msg)
            finally:
                os.kill(stream.process.pid, signal.SIGCONT)


def test_a_ring_without_capture_points_carries_width_zero_aux():
    """K = 0 (target.aux_layers=[]): slots of aux [max_tokens, 0] that share like any other (a view
    with storage, SlotRing._aux_slot), put / view / checksum and a co-located share with a
    context-parallel window, the final states intact."""
    from specforge_k25.stream.ring import SeqWindow, SlotRing
    from specforge_k25.stream.target_process import put_share
    from specforge_k25.target_engine.base import TargetOutput

    ring = SlotRing(torch.multiprocessing.get_context("spawn"), 2, 8, 4, torch.float32, num_aux=0)
    try:
        assert all(t.shape == (8, 0) and t.is_shared() for t in ring.aux)
        final = torch.arange(20, dtype=torch.float32).reshape(5, 4)
        with pytest.raises(ValueError, match=r"aux \[5, 4\] / final \[5, 4\] for a ring of 0 aux states x 4"):
            ring.put(0, torch.ones(5, 4), final, [5])
        ring.put(0, final.new_empty(5, 0), final, [2, 3])
        msg = ring.get(timeout=10)
        aux, got = ring.view(msg)
        assert aux.shape == (5, 0) and torch.equal(got, final) and msg.checksum == float(final.sum())
        ring.release(msg)
        # the second sequence's rows [2, 4) + a halo of 1, of rank 1 of a context-parallel pair
        out = TargetOutput(final.new_empty(5, 0), final, [2, 3])
        put_share(ring, 1, out, [1], None, None, SeqWindow(rank=1, size=2, halo=1))
        msg = ring.get(timeout=10)
        aux, got = ring.view(msg)
        assert msg.lengths == [1] and aux.shape == (1, 0) and torch.equal(got, final[4:5])
    finally:
        ring.close()


@pytest.mark.slow
def test_zero_capture_points_stream_the_final_state_alone(tiny_deepseek_path):
    """A target process with no capture point (the HF reference; the SGLang engine's own [N, 0] is in
    tests/target_engine/test_target.py): the ring's width-0 aux slots cross the process boundary,
    every batch arrives with aux [N, 0] and HF's final states."""
    from specforge_k25.stream.ring import slot_checksum

    spec, info = _spec(tiny_deepseek_path)
    spec.capture_points = []
    assert spec.num_aux == 0
    seqs = _seqs(4, info.vocab_size, seed=5)
    plan = [[0, 1], [2, 3]]
    ref = HFTarget(tiny_deepseek_path, [])
    with TargetStream(spec, seqs, plan, hidden_size=info.hidden_size, slots=2, timeout_s=120) as stream:
        for msg, aux, final in stream:
            copy = (aux.clone(), final.clone())
            stream.release(msg)
            assert copy[0].shape == (sum(msg.lengths), 0)
            assert slot_checksum(*copy) == msg.checksum
            torch.testing.assert_close(copy[1], ref.forward([seqs[i] for i in plan[msg.item]]).final_hidden,
                                       rtol=1e-5, atol=1e-5)
