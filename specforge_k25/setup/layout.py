"""Which trainer ranks a launch has on a node (torchrun's `World`), checked against the node's layout
(plan/budget.py `node_layout`: hw.trainer_layout=dedicated, one trainer rank per target replica;
colocated, one trainer rank per TP rank of every replica) before any process starts."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..plan.budget import context_parallel_problems, node_layout


@dataclass(frozen=True)
class World:
    """What torchrun says about this process (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls) -> "World":
        env = os.environ
        size = int(env.get("WORLD_SIZE", 1))
        return cls(rank=int(env.get("RANK", 0)), size=size, local_rank=int(env.get("LOCAL_RANK", 0)),
                   local_size=int(env.get("LOCAL_WORLD_SIZE", size)))


def check_layout(hw, world: World) -> None:
    """Refuse a launch whose ranks do not match the hw profile, before any process starts.

    The profile describes one node: hw.target_replicas replicas with one trainer rank each (on GPU,
    hw.trainer_gpus lists their GPUs), or colocated one beside each TP rank. torchrun must start
    exactly `node_layout(hw).ranks_per_node` ranks per node.
    """
    replicas = hw.target_replicas
    if replicas < 1:
        raise ValueError(f"hw.target_replicas={replicas}: need at least one target replica")
    layout = node_layout(hw)  # PlanError (a ValueError) for an unknown hw.trainer_layout
    if hw.target_pp < 1:
        raise ValueError(f"hw.target_pp={hw.target_pp}: need at least one pipeline stage")
    if hw.target_pp > 1 and (hw.target_nnodes > 1 or replicas > 1):
        raise ValueError(f"hw.target_pp={hw.target_pp}: a pipeline-parallel target runs for now as one replica on one "
                         f"node (hw.target_replicas=1, hw.target_nnodes=1)")
    for problem in context_parallel_problems(hw, layout):
        raise ValueError(problem)
    if layout.colocated:
        if hw.target_nnodes > 1:
            raise ValueError("hw.trainer_layout=colocated runs a target on one node (hw.target_nnodes=1): "
                             "use hw.trainer_layout=dedicated for a target spanning nodes")
        wanted = layout.ranks_per_node
        if world.local_size != wanted:
            raise ValueError(f"{world.local_size} trainer rank(s) were started on this node but the hw profile "
                             f"{hw.name!r} with hw.trainer_layout=colocated has {replicas} replica(s) x TP "
                             f"{layout.tp}{f' x {layout.pp} stages' if layout.pp > 1 else ''} = {wanted} trainer ranks, one beside each TP rank: start "
                             f"`torchrun --nproc-per-node {wanted} -m specforge_k25.train ...` or set "
                             f"hw.trainer_layout=dedicated")
        if world.size % world.local_size:
            raise ValueError(f"WORLD_SIZE={world.size} is not a multiple of the {world.local_size} ranks per node")
        return
    if hw.trainer_gpus is not None and len(hw.trainer_gpus) != replicas:
        raise ValueError(f"hw.trainer_gpus={list(hw.trainer_gpus)} lists {len(hw.trainer_gpus)} trainer rank(s) but "
                         f"hw.target_replicas={replicas}: one trainer rank per target replica")
    if hw.device == "cuda" and hw.trainer_gpus is None and replicas > 1:
        raise ValueError(f"hw.target_replicas={replicas}: set hw.trainer_gpus to the GPU of each trainer rank")
    if world.local_size != replicas:
        launch = (f"torchrun --nproc-per-node {replicas} -m specforge_k25.train ..." if replicas > 1
                  else "python -m specforge_k25.train ... (or torchrun --nproc-per-node 1)")
        raise ValueError(f"{world.local_size} trainer rank(s) were started on this node but the hw profile "
                         f"{hw.name!r} has {replicas} target replica(s) (hw.target_replicas, hw.trainer_gpus), one "
                         f"rank each: start `{launch}` or change hw.target_replicas / hw.trainer_gpus")
    if world.size % world.local_size:
        raise ValueError(f"WORLD_SIZE={world.size} is not a multiple of the {world.local_size} ranks per node")
    if hw.device == "cuda":
        targets = [layout.rank_gpus(r)[1] for r in range(replicas)]
        if len(set(targets)) != replicas:
            raise ValueError(f"hw.trainer_gpus={list(layout.trainer_gpus)}: two trainer ranks would read the same "
                             f"target replica (first GPUs {targets}); put each rank on its replica's first GPU")
