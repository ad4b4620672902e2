"""The node layout (plan/budget.py `NodeLayout`, built once by `node_layout`) of every hw profile in
both trainer layouts, written out by hand, and the launch checks against it (setup/layout.py
`check_layout`): the plan, the torchrun relaunch and the trainer ranks read this one value."""
from __future__ import annotations

import pytest

from specforge_k25.config import HwConfig, compose_job
from specforge_k25.plan import KIMI_K25, PlanError, plan_memory
from specforge_k25.plan.budget import NodeLayout, node_layout
from specforge_k25.setup.layout import World, check_layout


def _hw(profile: str, layout: str, *extra: str) -> HwConfig:
    return compose_job([f"+hw={profile}", f"hw.trainer_layout={layout}", *extra]).hw


# (profile, layout) -> the layout by hand: (colocated, tp, groups, trainer GPUs, replica each rank reads)
PROFILES = {
    # 8x RTX PRO 6000: one TP8 replica on GPUs 0-7
    ("rtxpro6000x8", "colocated"): NodeLayout(True, 8, ((0, 1, 2, 3, 4, 5, 6, 7),), (0, 1, 2, 3, 4, 5, 6, 7),
                                              (0, 0, 0, 0, 0, 0, 0, 0)),
    ("rtxpro6000x8", "dedicated"): NodeLayout(False, 8, ((0, 1, 2, 3, 4, 5, 6, 7),), (0,), (0,)),  # hw.trainer_gpu 0
    # 8x B300: two TP4 replicas on GPUs 0-3 and 4-7
    ("b300x8", "colocated"): NodeLayout(True, 4, ((0, 1, 2, 3), (4, 5, 6, 7)), (0, 1, 2, 3, 4, 5, 6, 7),
                                        (0, 0, 0, 0, 1, 1, 1, 1)),
    ("b300x8", "dedicated"): NodeLayout(False, 4, ((0, 1, 2, 3), (4, 5, 6, 7)), (0, 4), (0, 1)),  # hw.trainer_gpus
    # CPU: one TP1 replica, one trainer rank (its "GPU" 0 names no device)
    ("cpu", "colocated"): NodeLayout(True, 1, ((0,),), (0,), (0,)),
    ("cpu", "dedicated"): NodeLayout(False, 1, ((0,),), (0,), (0,)),
}
# (profile, layout) -> (ranks per node, trainer ranks per replica, each rank's (trainer GPU, replica's first GPU))
RANKS = {
    ("rtxpro6000x8", "colocated"): (8, 8, [(g, 0) for g in range(8)]),
    ("rtxpro6000x8", "dedicated"): (1, 1, [(0, 0)]),
    ("b300x8", "colocated"): (8, 4, [(0, 0), (1, 0), (2, 0), (3, 0), (4, 4), (5, 4), (6, 4), (7, 4)]),
    ("b300x8", "dedicated"): (2, 1, [(0, 0), (4, 4)]),
    ("cpu", "colocated"): (1, 1, [(0, 0)]),
    ("cpu", "dedicated"): (1, 1, [(0, 0)]),
}


@pytest.mark.parametrize("profile,layout", sorted(PROFILES))
def test_each_profile_by_hand(profile, layout):
    hw = _hw(profile, layout)
    got = node_layout(hw)
    assert got == PROFILES[profile, layout]
    ranks, per_replica, gpus = RANKS[profile, layout]
    assert (got.ranks_per_node, got.per_replica, got.replicas) == (ranks, per_replica, hw.target_replicas)
    assert [got.rank_gpus(r) for r in range(ranks)] == gpus
    check_layout(hw, World(rank=ranks - 1, size=ranks, local_rank=ranks - 1, local_size=ranks))  # the launch it wants
    check_layout(hw, World(rank=ranks, size=2 * ranks, local_rank=0, local_size=ranks))  # the same on two nodes


@pytest.mark.parametrize("profile,layout", sorted(PROFILES))
def test_the_plan_places_the_layouts_ranks(profile, layout):
    """The memory plan's GPUs are the layout's: every TP rank's and every trainer rank's, and the
    tokens of a step are those of its trainer ranks."""
    job = compose_job([f"+hw={profile}", f"hw.trainer_layout={layout}", "target=kimi_k25", "draft=kimi"])
    plan, want = plan_memory(job, KIMI_K25), PROFILES[profile, layout]
    tr = job.train
    assert plan.tokens_per_step == tr.batch_size * job.data.max_length * tr.grad_accum * len(want.trainer_gpus)
    if job.hw.device != "cuda":
        return
    assert [g.gpu for g in plan.gpus] == sorted({*want.trainer_gpus, *(g for group in want.groups for g in group)})
    for g in plan.gpus:
        assert ("trainer rank" in g.role) == (g.gpu in want.trainer_gpus)


def test_unknown_layout_is_refused_by_name():
    for build in (lambda hw: node_layout(hw), lambda hw: check_layout(hw, World())):
        with pytest.raises(PlanError, match=r"hw.trainer_layout='sideways': expected one of dedicated, colocated"):
            build(HwConfig(trainer_layout="sideways"))


def test_a_dedicated_rank_reads_the_replica_it_sits_on():
    """b300x8 with trainer_gpus [4, 0]: rank 0 reads the replica on GPUs 4-7 (its first GPU), rank 1
    the one on 0-3; the plan puts no extra trainer context on a ring GPU (the same numbers as [0, 4])."""
    swapped = _hw("b300x8", "dedicated", "hw.trainer_gpus=[4,0]")
    assert node_layout(swapped).reads == (1, 0)
    assert [node_layout(swapped).rank_gpus(r) for r in range(2)] == [(4, 4), (0, 0)]
    check_layout(swapped, World(size=2, local_size=2))
    kimi = ["target=kimi_k25", "draft=kimi", "hw.trainer_layout=dedicated"]
    plans = [plan_memory(compose_job(["+hw=b300x8", *kimi, *extra]), KIMI_K25)
             for extra in ([], ["hw.trainer_gpus=[4,0]"])]
    assert [g.total() for g in plans[0].gpus] == [g.total() for g in plans[1].gpus]
    assert plans[0].mem_fraction_min == plans[1].mem_fraction_min
    assert all(g.get("CUDA context (trainer process, for the ring)") == 0 for g in plans[1].gpus)
    # a trainer on a GPU of its own reads replica number local_rank, and opens a context on its ring GPU
    alone = _hw("b300x8", "dedicated", "hw.target_replicas=1", "hw.trainer_gpus=[4]", "hw.trainer_gpu=4")
    assert (node_layout(alone).reads, node_layout(alone).rank_gpus(0)) == ((0,), (4, 0))
    ring_gpu = plan_memory(compose_job(["+hw=b300x8", *kimi, "hw.target_replicas=1", "hw.trainer_gpus=[4]",
                                        "hw.trainer_gpu=4"]), KIMI_K25).gpu(0)
    assert ring_gpu.get("CUDA context (trainer process, for the ring)") > 0


def test_cpu_ranks_need_no_gpu_list():
    """Dedicated on CPU: hw.target_replicas ranks per node, hw.trainer_gpus unset (no GPU to name)."""
    hw = HwConfig(target_replicas=2)
    layout = node_layout(hw)
    assert (layout.ranks_per_node, layout.per_replica, layout.trainer_gpus) == (2, 1, (0,))
    check_layout(hw, World(size=2, local_size=2))


def test_a_target_spanning_nodes_holds_its_share_of_tp_ranks_on_node_0():
    layout = node_layout(HwConfig(device="cuda", num_gpus=8, target_tp=16, target_nnodes=2))
    assert (layout.tp, layout.groups, layout.ranks_per_node) == (8, (tuple(range(8)),), 1)
    assert node_layout(HwConfig(target_tp=2, target_nnodes=2, trainer_layout="colocated")).tp == 1


# ------------------------------------------------------------------ launches against the layout
def _b300(**kw) -> HwConfig:
    base = dict(name="b300x8", device="cuda", num_gpus=8, target_tp=4, target_replicas=2, target_gpu=0,
                trainer_gpu=0, trainer_gpus=[0, 4])
    return HwConfig(**{**base, **kw})


def _colocated_b300(**kw) -> HwConfig:
    return _b300(trainer_layout="colocated", trainer_gpus=None, **kw)


@pytest.mark.parametrize("hw,world,message", [
    (_b300(), World(size=1, local_size=1), "1 trainer rank(s) were started on this node but the hw profile"),
    (_b300(), World(size=3, local_size=3), "torchrun --nproc-per-node 2"),
    (_b300(), World(size=3, local_size=2), "WORLD_SIZE=3 is not a multiple of the 2 ranks per node"),
    (HwConfig(), World(size=2, local_size=2), "has 1 target replica"),
    (HwConfig(target_replicas=0), World(), "need at least one target replica"),
    (_b300(trainer_gpus=[0]), World(size=2, local_size=2), "lists 1 trainer rank(s) but hw.target_replicas=2"),
    (_b300(trainer_gpus=None), World(size=2, local_size=2), "set hw.trainer_gpus"),
    (_b300(trainer_gpus=[4, 1]), World(size=2, local_size=2),
     "hw.trainer_gpus=[4, 1]: two trainer ranks would read the same target replica (first GPUs [4, 4])"),
    (_colocated_b300(), World(size=2, local_size=2), "2 replica(s) x TP 4 = 8 trainer ranks, one beside each TP rank: "
                                                     "start `torchrun --nproc-per-node 8"),
    (_colocated_b300(), World(size=12, local_size=8), "WORLD_SIZE=12 is not a multiple of the 8 ranks per node"),
    (HwConfig(target_tp=2, target_nnodes=2, trainer_layout="colocated"), World(), "runs a target on one node"),
])
def test_layout_mismatch_is_refused(hw, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        check_layout(hw, world)
