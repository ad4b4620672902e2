"""Tests of the batch schedule (train/schedule.py) and the LR schedule (train/optim.py)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specforge_k25.train.schedule import BatchItem, build_schedule, padding_share
from specforge_k25.train.optim import build_optimizer, build_scheduler, lr_factor, warmup_cosine, warmup_stable_decay


def plan_for(n_train=10, n_heldout=5, batch_size=3, grad_accum=2, epochs=2, max_steps=None, eval_every=2, seed=0):
    return build_schedule(n_train, n_heldout, batch_size=batch_size, grad_accum=grad_accum, epochs=epochs,
                      max_steps=max_steps, eval_every=eval_every, seed=seed)


def train_items(plan):
    return [p for p in plan if p.kind == "train"]


def shape(plan):
    """Compact view: 'T' per train micro-batch, the tag per eval batch."""
    return ["T" if p.kind == "train" else p.tag for p in plan]


# --------------------------------------------------------------------------------- 9. plan
def test_plan_layout_with_evals():
    # 10 samples, batch 3 -> 4 micro-batches per epoch, 2 epochs -> 8, accum 2 -> 4 steps (nothing cut).
    # 5 held-out samples -> 2 eval batches; eval_every 2 -> after step 2; not after step 4 (the last).
    plan, steps = plan_for()
    assert steps == 4
    assert all(isinstance(p, BatchItem) for p in plan)
    assert shape(plan) == ["start", "start",
                           "T", "T", "T", "T",
                           "step_2", "step_2",
                           "T", "T", "T", "T",
                           "end", "end"]
    evals = [p for p in plan if p.kind == "eval"]
    for tag in ("start", "step_2", "end"):
        assert [p.sample_ids for p in evals if p.tag == tag] == [[10, 11, 12], [13, 14]]
    assert all(p.tag == "" for p in train_items(plan))


@pytest.mark.parametrize("eval_every,want", [(1, ["start", "step_1", "step_2", "step_3", "end"]),
                                             (3, ["start", "step_3", "end"]),
                                             (4, ["start", "end"]),  # would land on the last step
                                             (None, ["start", "end"]),
                                             (0, ["start", "end"])])
def test_eval_tags(eval_every, want):
    plan, steps = plan_for(n_train=8, n_heldout=2, batch_size=2, grad_accum=1, epochs=1, eval_every=eval_every)
    assert steps == 4
    tags = [p.tag for p in plan if p.kind == "eval"]
    assert tags == want  # one eval batch each (2 held-out, batch 2)
    assert plan[0].kind == "eval" and plan[-1].kind == "eval"
    # each step_k eval follows exactly k*grad_accum train items
    for i, p in enumerate(plan):
        if p.kind == "eval" and p.tag.startswith("step_"):
            assert sum(q.kind == "train" for q in plan[:i]) == int(p.tag.split("_")[1])


def test_no_heldout_no_eval_items():
    plan, steps = plan_for(n_heldout=0, eval_every=1)
    assert steps == 4 and all(p.kind == "train" for p in plan) and len(plan) == 8


@pytest.mark.parametrize("n,batch,accum,epochs,max_steps", [
    (10, 3, 2, 2, None),  # 8 micro, 4 steps, no cut
    (10, 3, 3, 1, None),  # 4 micro -> 1 step of 3 (one micro-batch cut)
    (10, 3, 3, 2, None),  # 8 micro -> 2 steps of 3 (two cut)
    (7, 7, 1, 3, None),  # one full batch per epoch
    (7, 2, 1, 1, None),  # last micro-batch has one sample
    (10, 2, 1, 3, 4),  # 15 micro capped at 4 steps
    (10, 2, 2, 3, 100),  # cap above the natural count changes nothing: 15 micro -> 7 steps
])
def test_train_micro_batch_counts(n, batch, accum, epochs, max_steps):
    plan, steps = plan_for(n_train=n, n_heldout=3, batch_size=batch, grad_accum=accum, epochs=epochs,
                           max_steps=max_steps, eval_every=None)
    natural = epochs * math.ceil(n / batch) // accum
    want_steps = natural if max_steps is None else min(natural, max_steps)
    assert steps == want_steps
    items = train_items(plan)
    assert len(items) == want_steps * accum
    assert all(1 <= len(p.sample_ids) <= batch for p in items)
    assert all(0 <= i < n for p in items for i in p.sample_ids)


def test_epochs_cover_each_sample_once_per_epoch():
    n, batch, epochs = 11, 3, 3  # 4 micro-batches per epoch (3,3,3,2), 12 total, accum 2 -> nothing cut
    plan, steps = plan_for(n_train=n, n_heldout=4, batch_size=batch, grad_accum=2, epochs=epochs, eval_every=1)
    assert steps == 6
    items = train_items(plan)
    per_epoch = math.ceil(n / batch)
    for e in range(epochs):
        ids = [i for p in items[e * per_epoch:(e + 1) * per_epoch] for i in p.sample_ids]
        assert sorted(ids) == list(range(n)), f"epoch {e} is not a permutation"
    counts = Counter(i for p in items for i in p.sample_ids)
    assert counts == {i: epochs for i in range(n)}
    # the epochs are shuffled differently
    orders = [[i for p in items[e * per_epoch:(e + 1) * per_epoch] for i in p.sample_ids] for e in range(epochs)]
    assert len({tuple(o) for o in orders}) > 1


def test_heldout_ids_disjoint_from_train():
    n_train, n_heldout = 9, 7
    plan, _ = plan_for(n_train=n_train, n_heldout=n_heldout, batch_size=4, grad_accum=1, epochs=2, eval_every=1)
    train_ids = {i for p in train_items(plan) for i in p.sample_ids}
    held_ids = {i for p in plan if p.kind == "eval" for i in p.sample_ids}
    assert train_ids == set(range(n_train))
    assert held_ids == set(range(n_train, n_train + n_heldout))
    assert not train_ids & held_ids
    # every eval pass covers the held-out set exactly once, in batches of at most batch_size
    for tag in {p.tag for p in plan if p.kind == "eval"}:
        batches = [p.sample_ids for p in plan if p.kind == "eval" and p.tag == tag]
        assert sorted(i for b in batches for i in b) == list(range(n_train, n_train + n_heldout))
        assert all(len(b) <= 4 for b in batches)


def test_seed_determinism():
    a, _ = plan_for(n_train=20, seed=3)
    b, _ = plan_for(n_train=20, seed=3)
    c, _ = plan_for(n_train=20, seed=4)
    assert a == b
    order = lambda plan: [p.sample_ids for p in train_items(plan)]  # noqa: E731
    assert order(a) != order(c)
    assert shape(a) == shape(c)  # the seed changes the order, not the layout


@pytest.mark.parametrize("kw", [
    dict(n_train=3, batch_size=2, grad_accum=4, epochs=1),  # 2 micro-batches < accum 4
    dict(n_train=10, batch_size=2, grad_accum=1, epochs=1, max_steps=0),
    dict(n_train=0, batch_size=2, grad_accum=1, epochs=1),
    dict(n_train=10, batch_size=2, grad_accum=1, epochs=0),
])
def test_zero_steps_raises(kw):
    with pytest.raises(ValueError, match="no optimizer step"):
        plan_for(n_heldout=2, eval_every=None, **kw)


# ------------------------------------------------------------------------------ 10. LR schedule
def test_warmup_then_cosine_values():
    f = warmup_cosine(100, 0.1)  # warmup = 10 steps
    assert f(0) == pytest.approx(1 / 10)
    assert f(4) == pytest.approx(5 / 10)
    assert f(9) == pytest.approx(1.0)  # warmup reaches 1 on its last step
    assert f(10) == pytest.approx(1.0)  # cosine starts at 1
    assert f(55) == pytest.approx(0.5)  # cosine midpoint: 45 of 90 decay steps
    assert f(10 + 30) == pytest.approx(0.5 * (1 + math.cos(math.pi / 3)))  # = 0.75
    assert f(100) == pytest.approx(0.0, abs=1e-12)
    assert f(150) == pytest.approx(0.0, abs=1e-12)  # stays at 0 past the end
    assert 0 < f(99) < 1e-3
    warm = [f(s) for s in range(10)]
    assert all(b > a for a, b in zip(warm, warm[1:]))
    decay = [f(s) for s in range(10, 101)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))


def test_no_warmup_when_ratio_zero():
    f = warmup_cosine(100, 0.0)
    assert f(0) == 1.0
    assert f(50) == pytest.approx(0.5)
    assert f(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert f(100) == pytest.approx(0.0, abs=1e-12)


def test_small_warmup_ratio_rounds_up():
    assert warmup_cosine(100, 0.015)(0) == pytest.approx(1 / 2)  # ceil(1.5) = 2 warmup steps
    assert warmup_cosine(100, 0.015)(1) == pytest.approx(1.0)
    assert warmup_cosine(10, 0.001)(0) == pytest.approx(1.0)  # at least one (full-LR) warmup step


def test_warmup_length_exact_for_round_ratio():
    f = warmup_cosine(100, 0.07)  # 7% of 100 steps = 7 warmup steps
    assert f(0) == pytest.approx(1 / 7)
    assert f(6) == pytest.approx(1.0)


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], lr=2e-3, betas=[0.9, 0.95], weight_decay=0.0)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    sched = build_scheduler(opt, total_steps=20, warmup_ratio=0.2)  # warmup 4
    f = warmup_cosine(20, 0.2)
    seen = []
    for s in range(20):
        seen.append(opt.param_groups[0]["lr"])
        assert seen[-1] == pytest.approx(2e-3 * f(s))
        opt.step()
        sched.step()
    assert seen[:4] == pytest.approx([5e-4, 1e-3, 1.5e-3, 2e-3])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-15)


def test_warmup_stable_decay_hand_computed():
    """10 steps, warmup 0.2 -> 2 steps, decay 0.3 -> the last 3 steps at 3/4, 2/4, 1/4 of the peak."""
    f = warmup_stable_decay(10, 0.2, 0.3)
    assert [f(s) for s in range(10)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert f(10) == 0.0 and f(12) == 0.0  # past the end: nothing
    g = warmup_stable_decay(10, 0.0, 0.0)  # no warmup, no decay: constant
    assert [g(s) for s in range(10)] == [1.0] * 10
    h = warmup_stable_decay(4, 0.5, 1.0)  # the decay takes what the warmup leaves: 2 steps
    assert [h(s) for s in range(4)] == [0.5, 1.0, 2 / 3, 1 / 3]


def test_lr_schedule_by_name_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], lr=2e-3, betas=[0.9, 0.95], weight_decay=0.0)
    sched = build_scheduler(opt, total_steps=10, warmup_ratio=0.2, schedule="wsd", decay_ratio=0.3)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3, 1.5e-3, 1e-3, 5e-4])
    assert lr_factor("cosine", 20, 0.2)(7) == warmup_cosine(20, 0.2)(7)
    with pytest.raises(ValueError, match="train.lr_schedule='linear'"):
        lr_factor("linear", 10, 0.1)


# ------------------------------------------------------------------------- length grouping
def test_padding_share_known_answer():
    items = [BatchItem("train", [0, 1]), BatchItem("eval", [2, 3]), BatchItem("train", [2, 3])]
    lengths = [3, 5, 4, 4]
    assert padding_share(items, lengths, per_rank=2) == pytest.approx(1 - 16 / 18)  # [3,5] pads to 10, [4,4] none
    assert padding_share(items, lengths, per_rank=1) == 0.0  # each rank one sample: nothing to pad


def test_grouping_by_length_keeps_every_sample_once_per_epoch_and_pads_less():
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 257, (200,), generator=rng).tolist()
    args = dict(batch_size=4, grad_accum=1, epochs=2, max_steps=None, eval_every=None, seed=3)
    plain, _ = build_schedule(200, 0, **args)
    grouped, steps = build_schedule(200, 0, lengths=lengths, **args)
    again, _ = build_schedule(200, 0, lengths=lengths, **args)
    assert [i.sample_ids for i in grouped] == [i.sample_ids for i in again]  # a resume walks the same list
    batches = [i.sample_ids for i in train_items(grouped)]
    assert steps == 100 and all(len(b) == 4 for b in batches)
    for epoch in (batches[:50], batches[50:]):
        assert sorted(i for b in epoch for i in b) == list(range(200))
    assert padding_share(grouped, lengths, 4) < 0.2 * padding_share(plain, lengths, 4)
    # batches of neighbours in length, in a shuffled order of lengths
    firsts = [min(lengths[i] for i in b) for b in batches[:32]]
    assert firsts != sorted(firsts)


def test_the_schedule_does_not_depend_on_the_rank_it_is_built_on(monkeypatch):
    """Every data-parallel rank builds the one global schedule: nothing of the process (RANK,
    LOCAL_RANK, GROUP_RANK as torchrun sets them) may seed its order."""
    kw = dict(batch_size=2, grad_accum=2, epochs=2, max_steps=None, eval_every=3, seed=5,
              lengths=[7, 3, 9, 4, 8, 2, 6, 5, 1, 10, 11, 12])
    rank0 = build_schedule(12, 2, **kw)
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.setenv(name, "1")
    assert build_schedule(12, 2, **kw) == rank0
