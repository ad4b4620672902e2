"""A stream that stalls names the target rank the others wait on (stream/progress.py): a TP rank > 0
that never took TP rank 0's next batch, an earlier pipeline stage still in the batch the last stage
needs; when every rank is in the same batch, nobody can be told apart and the ring's filler is named
as before. The target processes are the real ones (run_producer, run_tp_rank) over a stand-in
engine that hangs, alive, where SPECFORGE_TEST_STALL says: no SGLang."""
from __future__ import annotations

import os
import time

import pytest
import torch

from specforge_k25.stream import target_process, target_stream
from specforge_k25.stream.progress import BatchProgress
from specforge_k25.stream.target_stream import StreamError, TargetStream
from specforge_k25.target_engine.base import TargetOutput
from specforge_k25.target_engine.factory import TargetSpec

H = 4  # hidden size; three capture points


class StallingTarget:
    """A target rank's engine. TP rank 0's broadcasts reach the other ranks as the same batches;
    SPECFORGE_TEST_STALL = "rank,batch,where,flag" hangs that rank at that batch: `before` (a TP rank
    > 0 waiting for a broadcast it never takes) or `inside` (its forward). Every other rank then
    hangs in that batch's forward, as it would in the collectives or the stage-to-stage sends it
    shares. The warm-up waits for every rank (as SGLang's start does: the file `flag` stands in),
    so that the stream's timeout runs from a batch every rank got to."""

    max_total_tokens = None

    def __init__(self, spec: TargetSpec, tp_rank: int = 0, pp_rank: int = 0):
        rank, batch, self.where, self.flag = os.environ["SPECFORGE_TEST_STALL"].split(",")
        self.rank, self.stuck, self.at = spec.tp_size * pp_rank + tp_rank, int(rank), int(batch)
        self.taken = self.forwards = 0

    def warmup(self) -> None:
        if self.rank == self.stuck:
            open(self.flag, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.05)

    def share_batch(self, message):
        if self.rank % 2 == 0:  # TP rank 0 (tp_size 2 here): broadcasts
            return None
        if self.rank == self.stuck and self.where == "before" and self.taken == self.at:
            time.sleep(3600)
        self.taken += 1
        return [target_process.FORWARD, torch.ones(3, dtype=torch.int64)]

    def forward(self, seqs) -> TargetOutput:
        if self.forwards >= self.at and (self.rank != self.stuck or self.where == "inside"):
            time.sleep(3600)
        self.forwards += 1
        n = sum(len(s) for s in seqs)
        return TargetOutput(torch.zeros(n, 3 * H), torch.zeros(n, H), [len(s) for s in seqs])

    def close(self) -> None:
        pass


def _producer(*args, **kwargs):  # in the target process: the real entry point over the stand-in engine
    target_process.build_target = StallingTarget
    return target_process.run_producer(*args, **kwargs)


def _tp_rank(*args, **kwargs):
    target_process.build_target = StallingTarget
    return target_process.run_tp_rank(*args, **kwargs)


def _stall(monkeypatch, tmp_path, stall: str, **layout) -> str:
    """The StreamError of a 4-batch stream whose target hangs as `stall` says."""
    monkeypatch.setattr(target_stream, "run_producer", _producer)
    monkeypatch.setattr(target_stream, "run_tp_rank", _tp_rank)
    monkeypatch.setattr(target_stream, "check_tp_layout", lambda spec: None)  # no model folder to count layers in
    monkeypatch.setenv("SPECFORGE_TEST_STALL", f"{stall},{tmp_path / 'started'}")
    spec = TargetSpec(engine="sglang", model_path="unused", architecture="LlamaForCausalLM",
                      capture_points=[1, 2, 3], **layout)
    seqs = [torch.arange(3 + i) for i in range(4)]
    stream = TargetStream(spec, seqs, [[0], [1], [2], [3]], hidden_size=H, timeout_s=1.5, start_timeout_s=120,
                          poll_s=0.2)
    got = []
    with pytest.raises(StreamError) as err:
        with stream:
            for msg, _, _ in stream:
                got.append(msg.item)
                stream.release(msg)
    assert got == [0, 1]
    return str(err.value)


@pytest.mark.slow
def test_a_tp_rank_that_never_took_the_next_batch_is_named(monkeypatch, tmp_path):
    message = _stall(monkeypatch, tmp_path, "1,2,before", tp_size=2)
    assert message.startswith("target process specforge-target-tp1 (TP rank 1 of 2, pid "), message
    assert "is behind: it finished batch 1 and has not started batch 2, while target process specforge-target " \
           "(TP rank 0 of 2, pid" in message and "is in batch 2, whose collectives need every TP rank" in message
    assert "nothing reached the ring for 2 s (train.stream_timeout_s)" in message


@pytest.mark.slow
def test_an_earlier_pipeline_stage_still_in_the_batch_is_named(monkeypatch, tmp_path):
    message = _stall(monkeypatch, tmp_path, "0,2,inside", pp_size=2)
    assert message.startswith("target process specforge-target-pp0-tp0 (pipeline stage 0 of 2, pid "), message
    assert "is behind: it is in batch 2, while target process specforge-target-pp1-tp0 (pipeline stage 1 of 2, " \
           "pid" in message and "which needs the earlier stage's states" in message


@pytest.mark.slow
def test_ranks_all_in_the_same_batch_name_the_filler_as_before(monkeypatch, tmp_path):
    message = _stall(monkeypatch, tmp_path, "1,2,inside", tp_size=2)
    assert message.startswith("target process specforge-target (TP rank 0 of 2, pid "), message
    assert "produced nothing for 2 s (train.stream_timeout_s)" in message and "behind" not in message


def test_the_furthest_behind_of_the_ranks_the_filler_waits_on_are_named():
    """Two stages x TP 2 (world rank = 2 * stage + TP rank), the filler rank 2 in batch 5."""
    progress = BatchProgress(4)

    def at(*rows):
        progress.counts[:] = torch.tensor(rows)
        return progress.behind(2, range(4), tp_size=2)

    assert at((6, 5), (5, 5), (6, 5), (6, 5)) == [1]  # stage 0's TP rank 1 has not started batch 5
    assert at((6, 5), (6, 5), (6, 5), (6, 5)) == [0, 1]  # stage 0 still in batch 5: both its ranks owe it
    assert at((7, 6), (7, 6), (6, 5), (5, 5)) == [3]  # stage 0 is done; the filler's TP peer never began it
    assert at((7, 6), (7, 6), (6, 5), (6, 5)) == []  # the filler's own stage, all in the batch: nobody told apart
    assert progress.where(3) == "is in batch 5" and progress.where(0) == "is in batch 6"
    progress.counts.zero_()
    assert progress.where(1) == "has started no batch (engine start or warm-up)"
