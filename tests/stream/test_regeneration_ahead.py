"""TP rank 0's regeneration ahead of the forwards (stream/target_process.py `Regenerated`): prompts
decoded in groups within the group size and the KV pool, each sample once while it is kept for a
later use (held-out samples recur at every evaluation), identical conversations either way."""
from __future__ import annotations

import torch

from specforge_k25.stream.target_process import Regenerated as _Regenerated
from specforge_k25.target.factory import TargetSpec
from specforge_k25.target.sampling import Regeneration


class CountingTarget:
    """Answers a prompt with its first token repeated twice; records each generate call's prompts."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def generate(self, prompts, budgets, regen):
        self.calls.append([int(p[0]) for p in prompts])
        return [[int(p[0])] * min(2, b) for p, b in zip(prompts, budgets)]


def _regenerated(batches, group=2, pool=None, keep_tokens=None):
    seqs = [torch.tensor([10 + i, 1, 2]) for i in range(5)]  # sample i's prompt starts with 10 + i
    offsets = torch.tensor([0, 3, 6, 9, 12, 15])
    spec = TargetSpec(engine="hf", model_path="m", architecture="x", capture_points=[1, 2, 3],
                      regeneration=Regeneration(max_new_tokens=2, max_length=16, group_sequences=group))
    target = CountingTarget()
    ahead = _Regenerated(target, spec, torch.cat(seqs), offsets, batches, pool)
    if keep_tokens is not None:
        ahead.KEEP_TOKENS = keep_tokens
    return ahead, target


def test_groups_and_recurring_samples():
    batches = [[0], [1], [2, 3], [0], [4], [1]]  # samples 0 and 1 recur (an evaluation, later repeated)
    ahead, target = _regenerated(batches)
    got = [ahead.take(item) for item in range(len(batches))]
    assert target.calls == [[10, 11], [12, 13], [14]]  # groups of <= 2 prompts; 0 and 1 generated once
    for (conversations, prompt_lengths), batch in zip(got, batches):
        assert prompt_lengths == [3] * len(batch)
        assert [c.tolist() for c in conversations] == [[10 + i, 1, 2, 10 + i, 10 + i] for i in batch]
    assert ahead.ready == {} and ahead.kept_tokens == 0  # nothing left behind


def test_no_room_to_keep_means_regenerating_identically():
    batches = [[0], [1], [0]]
    ahead, target = _regenerated(batches, group=1, keep_tokens=0)
    got = [ahead.take(item)[0][0].tolist() for item in range(3)]
    assert target.calls == [[10], [11], [10]] and got[0] == got[2]


def test_a_group_stays_within_the_kv_pool():
    ahead, target = _regenerated([[0], [1], [2]], group=8, pool=10)  # each prompt + budget = 5 slots
    ahead.take(0)
    assert target.calls == [[10, 11]]
