"""TP rank 0's regeneration ahead of the forwards (stream/target_process.py `Regenerated`): prompts
decoded in groups within the group size and the KV pool, each sample once per run (held until its
last use: later epochs, held-out samples at every evaluation), a resumed run decoding the remaining
prompts in the groups of an uninterrupted run, and answers saved already (`known`) never decoded."""
from __future__ import annotations

import os

import pytest
import torch

from specforge_k25.stream.target_process import Regenerated as _Regenerated
from specforge_k25.target_engine.factory import TargetSpec
from specforge_k25.target_engine.sampling import Regeneration


class CountingTarget:
    """Answers a prompt with its first token repeated twice; records each generate call's prompts."""

    max_total_tokens = None

    def __init__(self):
        self.calls: list[list[int]] = []

    def generate(self, prompts, budgets, regen):
        self.calls.append([int(p[0]) for p in prompts])
        return [[int(p[0])] * min(2, b) for p, b in zip(prompts, budgets)]


class MakeupTarget(CountingTarget):
    """Answers tell the group they were decoded in (its first tokens' sum), as kernels that depend on
    the batch makeup can."""

    def generate(self, prompts, budgets, regen):
        super().generate(prompts, budgets, regen)
        makeup = sum(int(p[0]) for p in prompts)
        return [[int(p[0]), makeup][:b] for p, b in zip(prompts, budgets)]


def _regenerated(batches, group=2, pool=16384, start=0, lengths=None, target=None, known=None):
    lengths = lengths or [3] * 5
    seqs = [torch.tensor([10 + i, *range(1, n)]) for i, n in enumerate(lengths)]  # sample i's prompt starts with 10 + i
    offsets = torch.tensor([0] + lengths).cumsum(0)
    spec = TargetSpec(engine="hf", model_path="m", architecture="x", capture_points=[1, 2, 3], max_total_tokens=pool,
                      regeneration=Regeneration(max_new_tokens=2, max_length=16, group_sequences=group))
    target = target or CountingTarget()
    ahead = _Regenerated(target, spec, torch.cat(seqs), offsets, batches, start=start, known=known)
    return ahead, target


def test_groups_and_recurring_samples():
    batches = [[0], [1], [2, 3], [0], [4], [1]]  # samples 0 and 1 recur (an evaluation, later repeated)
    ahead, target = _regenerated(batches)
    got = [ahead.take(item) for item in range(len(batches))]
    assert target.calls == [[10, 11], [12, 13], [14]]  # groups of <= 2 prompts; 0 and 1 generated once
    for (conversations, prompt_lengths), batch in zip(got, batches):
        assert prompt_lengths == [3] * len(batch)
        assert [c.tolist() for c in conversations] == [[10 + i, 1, 2, 10 + i, 10 + i] for i in batch]
    assert ahead.ready == {}  # nothing left behind


def test_a_group_stays_within_the_kv_pool():
    ahead, target = _regenerated([[0], [1], [2]], group=8, pool=9)  # each prompt + answer fed back = 4 slots
    ahead.take(0)
    assert target.calls == [[10, 11]]


@pytest.mark.parametrize("group, pool", [(3, 16384), (8, 11)])
def test_a_resume_decodes_in_the_groups_of_an_uninterrupted_run(group, pool):
    """Issue 18 §3.4: a group's makeup decides the decode kernels, hence the answers. A run resumed
    at any item gets the conversations of the uninterrupted run for the remaining items: its groups
    (by prompt count and by KV pool room) are the uninterrupted run's, and a group begun before the
    resume (nothing of it saved) is decoded whole again."""
    batches = [[0], [1, 2], [3], [0, 4], [1], [2, 3]]  # samples 0..3 recur
    lengths = [3, 4, 2, 5, 3]  # KV slots each: 4, 5, 3, 6, 4

    def conversations(start):
        ahead, _ = _regenerated(batches, group=group, pool=pool, start=start, lengths=lengths, target=MakeupTarget())
        return [[c.tolist() for c in ahead.take(item)[0]] for item in range(start, len(batches))]

    whole = conversations(0)
    assert len({c[-1] for item in whole for c in item}) > 1  # several groups
    for start in range(1, len(batches)):
        assert conversations(start) == whole[start:], start


class FakeRing:
    """What the producer puts: (item, ids, prompt lengths) per message, then its end message."""

    def __init__(self):
        self.got, self.ready = [], self

    def put(self, item, aux=None, final=None, lengths=None, ids=None, prompt_lengths=None):
        self.got.append(item if aux is None else (item, ids.tolist(), prompt_lengths))


def test_the_target_process_resumes_in_the_uninterrupted_runs_groups(monkeypatch):
    """run_producer (TP rank 0) given the batches run before a resume: it forwards only the rest,
    and their conversations are the uninterrupted run's; given them all as saved, it decodes none."""
    from specforge_k25.stream import target_process
    from specforge_k25.stream.ring import EndOfStream
    from specforge_k25.target_engine.base import TargetOutput

    class Engine(MakeupTarget):
        def warmup(self):
            pass

        def close(self):
            pass

        def forward(self, seqs):
            n = sum(len(s) for s in seqs)
            return TargetOutput(torch.zeros(n, 6), torch.zeros(n, 2), [len(s) for s in seqs])

    monkeypatch.setattr(target_process, "bind_to_trainer", lambda: None)
    batches = [[0], [1, 2], [3], [0, 4]]
    seqs = [torch.tensor([10 + i, 1, 2]) for i in range(5)]
    spec = TargetSpec(engine="hf", model_path="m", architecture="x", capture_points=[1, 2, 3],
                      regeneration=Regeneration(max_new_tokens=2, max_length=16, group_sequences=2))

    engines = []
    monkeypatch.setattr(target_process, "build_target",
                        lambda spec, tp_rank, pp_rank=0: engines.append(Engine()) or engines[-1])

    def produce(before, rest, known=None):
        ring = FakeRing()
        target_process.run_producer(spec, torch.cat(seqs), torch.arange(0, 16, 3), rest, ring, os.getppid(),
                                    before=before, known=known)
        assert isinstance(ring.got[-1], EndOfStream)
        return ring.got[:-1]

    whole = produce([], batches)
    assert produce(batches[:2], batches[2:]) == [(item - 2, ids, lens) for item, ids, lens in whole[2:]]
    # given every conversation as saved, it decodes nothing and sends the same
    known = {i: torch.tensor(ids[5 * k:5 * k + 5]) for (_, ids, _), batch in zip(whole, batches)  # 3 + 2 tokens each
             for k, i in enumerate(batch)}
    assert known[0].tolist()[:3] == [10, 1, 2] and produce([], batches, known) == whole and engines[-1].calls == []


def test_two_epochs_decode_each_prompt_once_and_hold_only_what_is_used_again():
    """Two epochs in other orders: every prompt decoded once, in the first epoch; a conversation is
    held until its last use and no longer (memory: the samples still to be used again)."""
    batches = [[i] for i in range(8)] + [[7], [3], [5], [1], [0], [6], [2], [4]]
    ahead, target = _regenerated(batches, group=4, lengths=[3] * 8)
    held = []
    for item, batch in enumerate(batches):
        conversations, _ = ahead.take(item)
        assert [c.tolist() for c in conversations] == [[10 + i, 1, 2, 10 + i, 10 + i] for i in batch]
        held.append(len(ahead.ready))
    assert sorted(p for call in target.calls for p in call) == [10 + i for i in range(8)]
    assert target.calls == [[10, 11, 12, 13], [14, 15, 16, 17]] and ahead.decoded == 8
    assert held[7] == 8 and held[8:] == [7, 6, 5, 4, 3, 2, 1, 0]


def test_saved_answers_are_never_decoded():
    """A resume (or a later run) with some answers saved: those are prefilled as saved, a group
    decodes only its members without one that are still to be used (a member decoded before the
    interruption but not yet trained, hence not saved, is decoded again: the only repeat)."""
    batches = [[0], [1, 2], [3], [0, 4], [1], [2, 3]]
    whole, first = _regenerated(batches, group=3, target=MakeupTarget())
    conversations = [[c.tolist() for c in whole.take(item)[0]] for item in range(len(batches))]
    assert first.calls == [[10, 11, 12], [13, 14]]
    # resume at item 3: samples 0..3 trained (saved); the group [3, 4] began before the resume
    saved = {i: torch.tensor(c) for b, convs in zip(batches[:3], conversations[:3]) for i, c in zip(b, convs)}
    resumed, again = _regenerated(batches, group=3, target=MakeupTarget(), start=3, known=saved)
    got = [[c.tolist() for c in resumed.take(item)[0]] for item in range(3, len(batches))]
    assert again.calls == [[14]] and resumed.decoded == 1
    for item, convs in zip(range(3, len(batches)), got):  # the saved ones exactly as saved
        for i, c in zip(batches[item], convs):
            if i in saved:
                assert c == saved[i].tolist()
    # a later run with every answer saved decodes nothing
    everything = {i: torch.tensor(c) for b, convs in zip(batches, conversations) for i, c in zip(b, convs)}
    later, none = _regenerated(batches, group=3, target=MakeupTarget(), known=everything)
    assert [[c.tolist() for c in later.take(item)[0]] for item in range(len(batches))] == conversations
    assert none.calls == [] and later.decoded == 0
