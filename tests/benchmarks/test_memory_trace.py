"""benchmarks/memory_trace.py: the trainer's build at Kimi-K2.5 shapes on a fake cuda device as rank 0
of a fake 8-rank process group (fake tensors: no memory, ~2 s a command). What reaches the device
is recorded op by op; the learner must never put a whole draft weight or a whole lm_head it
splits there (nothing made and freed: what the CUDA caching allocator would keep from SGLang),
and what it holds must be the plan's items for the same command (plan/budget.py `_place_items`)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# the README's co-located commands that shard the draft, and the one that moves the shards to the host
COMMANDS = {
    "rtx eagle3": ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi"],
    "rtx dflash": ["+hw=rtxpro6000x8", "target=kimi_k25", "draft=kimi_dflash"],
    "b300 dflash offload": ["+hw=b300x8", "target=kimi_k25", "draft=kimi_dflash", "train.optimizer_device=cpu"],
}


def trace():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("memory_trace")


def _check(row: dict) -> None:
    mt = trace()
    # nothing whole made and dropped: what the build created on the device is what the learner holds
    # (FSDP2 re-pads an uneven shard once: a few MB)
    assert row["created_bytes"] <= row["held_bytes"] + 8 * 2**20, row
    # every item the trace sees equals the plan's (the NCCL buffers are not allocated by torch)
    for key, held in row["held"].items():
        assert held == pytest.approx(row["planned"].get(key, 0), rel=0.01), (key, row)
    assert mt.worst_disagreement(row)[1] < 0.01


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_build_puts_only_shards_and_slices_on_the_device_as_planned(name):
    row = trace().trace_build(COMMANDS[name])
    assert row["ranks"] == 8 and row["layout"] == "colocated"
    _check(row)
    V, Ht = 163840, 7168
    if row["method"] == "dflash":  # 1/8 of the target's lm_head rows, nothing larger
        assert row["held"]["target lm_head"] == V // 8 * Ht * 2 and row["largest_bytes"] == V // 8 * Ht * 2
    else:  # EAGLE-3's teacher reads the whole head on every rank: the largest tensor there
        assert row["largest_bytes"] == row["held"]["target lm_head"] == V * Ht * 2
    if row["optimizer_device"] == "cpu":  # FSDP2's CPU offload: no draft weight on the device at all
        assert row["held"]["draft weights"] == 0


def test_the_recorder_sees_a_whole_draft_moved_before_sharding(monkeypatch):
    """The check above fails on the bug it guards against: a full-size move of the draft to the
    device before `shard_draft` (as `draft.to(device)` did)."""
    import specforge_k25.train.learner as learner

    shard = learner.shard_draft

    def whole_draft_first(draft, units, **kwargs):
        learner._move_outside(draft, [], kwargs["device"])
        return shard(draft, units, **kwargs)

    monkeypatch.setattr(learner, "shard_draft", whole_draft_first)
    row = trace().trace_build(COMMANDS["rtx dflash"])
    assert row["created_bytes"] > row["held_bytes"] + 2**30, row
    with pytest.raises(AssertionError):
        _check(row)


def test_the_fake_device_is_the_one_build_learner_fills():
    """Sanity of the harness: under fake_cuda_ranks a tensor moved to cuda is recorded, a host one
    is not."""
    mt = trace()
    with mt.fake_cuda_ranks(8, 0) as rec:
        host = torch.empty(1000, 10)
        moved = host.to("cuda")
    assert moved.device.type == "cuda" and [r[2] for r in rec.created] == [40_000]
