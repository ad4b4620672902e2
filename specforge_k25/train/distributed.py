"""Trainer ranks started by torchrun: which rank this process is, its GPUs, its share of every
batch, and the few collectives the loop needs.

Every global batch (train.batch_size samples per rank x ranks) is cut into contiguous per-replica
slices (train.batch_size x the replica's trainer ranks). hw.trainer_layout=dedicated: one trainer
rank per target replica, the slice is its share. colocated: one trainer rank beside every TP rank
of a replica; the replica's target runs the whole slice and each of its ranks takes a share of
whole sequences balanced by tokens (`balanced_shares`). Each rank divides its summed loss by the
GLOBAL number of loss positions and the gradients are summed over ranks, so W ranks x batch b make
the same update as one rank x batch W*b.

A single process (plain `python -m ...`, or torchrun with one rank) is rank 0 of 1: no process
group, no collective, the code path of a one-rank run is unchanged.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..plan.budget import node_layout
from ..setup.layout import World
from .heartbeat import start_heartbeat


class RankFailed(RuntimeError):
    """A collective with the other trainer ranks failed (a rank died, hung or timed out)."""


def torch_collective(err: BaseException) -> str | None:
    """The torch.distributed function a RuntimeError came out of (its innermost frame there), or
    None when it was raised elsewhere. gloo and NCCL raise plain RuntimeErrors ("Connection closed
    by peer", "Timed out waiting"), from collectives that torch itself calls inside the draft's step
    (FSDP2's all-gathers and reduce-scatters in its hooks, DTensor's all-reduce of the gradient
    norm): where it was raised is what tells them from the step's own errors (a shape mismatch).
    Out of memory is never a peer's fault, even inside an all-gather's allocation."""
    if isinstance(err, torch.OutOfMemoryError):
        return None
    name, tb, inside = None, err.__traceback__, f"{os.sep}torch{os.sep}distributed{os.sep}"
    while tb is not None:
        code = tb.tb_frame.f_code
        if inside in code.co_filename and code.co_name not in ("wrapper", "__call__"):  # not a decorator's
            name = code.co_name
        tb = tb.tb_next
    return name


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks and the collectives over them.

    With one rank every method is the identity; with several, a failed or timed-out collective
    raises RankFailed, and `heartbeat` (train/heartbeat.py; on NCCL by default) ends the run when a
    rank dies or hangs where a collective raises nothing.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    per_replica: int = 1  # trainer ranks that read one target replica (colocated: its TP size)
    colocated: bool = False  # hw.trainer_layout=colocated: the draft state sharded over the ranks (FSDP2)
    cp: int = 1  # hw.context_parallel: consecutive ranks of a replica that split each sequence's positions
    cp_group: Any = field(default=None, compare=False, repr=False)  # their process group
    heartbeat: Any = field(default=None, compare=False, repr=False)  # train/heartbeat.Heartbeat, or None
    grouped: bool = False  # one rank in a process group of its own (ONE_RANK_GROUP): sharded as several are

    def mark(self, item: int, phase: str) -> None:
        """The schedule item and phase this rank is in ("target": waiting for its batch, "train",
        "eval", "checkpoint", "end", "stopping"): what the heartbeat bounds and names."""
        if self.heartbeat is not None:
            self.heartbeat.mark(item, phase)

    def phase(self, phase: str, run_dir=None) -> None:
        """The phase only (the item stays); `run_dir`: where the heartbeat finds the newest checkpoint."""
        if self.heartbeat is not None:
            self.heartbeat.phase(phase)
            if run_dir is not None:
                self.heartbeat.run_dir = run_dir

    def marked(self, batches, start: int, kind_of, run_dir=None):
        """`batches` (one per schedule item from `start`), marking each item's phases: "target"
        while its batch is awaited, then its kind ("train" / "eval") until the next; "end" after
        the last."""
        self.phase("target", run_dir)
        for index, got in enumerate(batches, start):
            self.mark(index, kind_of(index))
            yield got
            self.mark(index + 1, "target")
        self.phase("end")

    def _waiting(self, what: str):
        return self.heartbeat.waiting(what) if self.heartbeat is not None else nullcontext()

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group: the block of positions it holds."""
        return self.replica_rank % self.cp

    @property
    def groups_per_replica(self) -> int:
        """Sequence owners of a replica: its trainer ranks, or their context-parallel groups."""
        return self.per_replica // self.cp

    @property
    def main(self) -> bool:
        """Rank 0: the only one that prints, logs, checkpoints and exports."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1 or self.grouped

    @property
    def replica(self) -> int:
        return self.rank // self.per_replica

    @property
    def replica_rank(self) -> int:
        """This rank's place among its replica's trainer ranks (colocated: its TP rank)."""
        return self.rank % self.per_replica

    def replica_batch(self, sample_ids: list[int], per_rank: int) -> list[int]:
        """This rank's replica's contiguous slice of a global batch (replica-major; may be empty
        for a short batch): what that replica's target runs. `per_rank`: train.batch_size, the
        sequences of one rank (of one context-parallel group)."""
        n = per_rank * self.groups_per_replica
        return sample_ids[self.replica * n:(self.replica + 1) * n]

    def share_positions(self, batch: list[int], sizes) -> list[int]:
        """Positions in the replica's batch of this rank's share (in batch order); `sizes[i]`:
        the tokens of sample i."""
        return self.replica_shares(batch, sizes)[self.replica_rank]

    def replica_shares(self, batch: list[int], sizes) -> list[list[int]]:
        """`share_positions` of every rank of this replica, by replica rank (the ranks of a
        context-parallel group share the same sequences)."""
        if self.per_replica == 1:
            return [list(range(len(batch)))]
        shares = balanced_shares([sizes[i] for i in batch], self.groups_per_replica)
        return [shares[r // self.cp] for r in range(self.per_replica)]

    def share(self, sample_ids: list[int], per_rank: int, sizes=None) -> list[int]:
        """This rank's samples of a global batch (may be empty for a short batch)."""
        batch = self.replica_batch(sample_ids, per_rank)
        return [batch[p] for p in self.share_positions(batch, sizes)]

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.world > 1:
            try:
                with self._waiting(f"an all_reduce ({op})"):
                    dist.all_reduce(t, op=op)
            except RuntimeError as err:  # gloo: peer closed / timeout; nccl: timeout
                raise RankFailed(f"trainer rank {self.rank}: a collective with the other ranks failed "
                                 f"(another rank died or hung): {err}") from None
        return t

    @contextmanager
    def collectives(self, what: str):
        """Run `what`, a part of the step in which torch runs collectives itself (FSDP2, DTensor):
        one that fails (a peer died or hung: `torch_collective`) raises RankFailed naming it, as
        the collectives called here do, so that the run ends as every data-parallel failure does
        (the newest checkpoint and the resume command, train/__main__.py's exit). Any other error
        passes unchanged."""
        try:
            yield
        except RankFailed:
            raise
        except RuntimeError as err:
            op = torch_collective(err) if self.world > 1 else None
            if op is None:
                raise
            raise RankFailed(f"trainer rank {self.rank} of {self.world}: a collective with the other ranks (torch."
                             f"distributed {op}) failed during {what}; another rank died or hung: {err}") from None

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """In place: t = Σ over ranks."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def sum_ints(self, values: list[int], device) -> list[int]:
        with self._waiting("a sum of counts"):  # NCCL: the host waits in .tolist(), not in all_reduce
            return [int(v) for v in self.sum(torch.tensor(values, dtype=torch.int64, device=device)).tolist()]

    def check_same(self, value: int, what: str, device) -> None:
        """Raise (on every rank) unless all ranks hold the same integer."""
        if self.world == 1:
            return
        t = self._reduce(torch.tensor([value, -value], dtype=torch.int64, device=device), dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise ValueError(f"the trainer ranks disagree on {what} (from {-int(t[1])} to {int(t[0])}): "
                             f"train.out_dir must be one folder every rank sees")

    def check_same_data(self, digest: str) -> None:
        """Raise (on every rank) unless all ranks prepared the same data: each rank reads and
        tokenizes data.source itself, and a rank that got other samples (another file at
        data.path on its node, another tokenizer or datasets version) would train on them while
        the schedule's sample ids, the vocab maps and the fingerprint assume rank 0's. `digest`:
        this rank's `TokenizedData.sha1()`. One collective."""
        digests = self.gather(digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            each = ", ".join(f"rank {r} {digests[r][:12]}" for r in [0, *differ])
            raise ValueError(f"trainer rank(s) {differ} prepared different data than rank 0 (sha1 of the tokenized "
                             f"train and held-out samples: {each}): every rank tokenizes data.source/data.path with "
                             f"the target's tokenizer itself, so all must read the same data files with the same "
                             f"tokenizer and library versions")

    def gather(self, obj) -> list:
        """Every rank's value of a picklable object, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        try:
            with self._waiting("all_gather_object"):
                dist.all_gather_object(out, obj)
        except RuntimeError as err:
            raise RankFailed(f"trainer rank {self.rank}: gathering from the other ranks failed: {err}") from None
        return out

    def from_main(self, obj):
        """Rank 0's value of a picklable object, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        try:
            with self._waiting("broadcast_object_list from rank 0"):
                dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:
            raise RankFailed(f"trainer rank {self.rank}: broadcast from rank 0 failed: {err}") from None
        return box[0]


def balanced_shares(sizes: list[int], parts: int) -> list[list[int]]:
    """Split whole items over `parts` ranks, balancing their summed sizes: longest first, each to the
    rank with the fewest tokens so far (ties: the lower rank). Returns each rank's positions in
    ascending order. Deterministic, so every rank computes the same split."""
    loads, shares = [0] * parts, [[] for _ in range(parts)]
    for pos in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        r = min(range(parts), key=lambda q: (loads[q], q))
        loads[r] += sizes[pos]
        shares[r].append(pos)
    return [sorted(share) for share in shares]


# A co-located run of one rank under torchrun with this set to 1 builds its process group and shards
# its draft (FSDP2 over one rank, the vocab-split head) as a node's ranks do: the GPU check runs the
# node's code path on one GPU (benchmarks/gpu_cli.py)
ONE_RANK_GROUP = "SPECFORGE_ONE_RANK_GROUP"


def start_ranks(job, world: World | None = None):
    """This process's job (its trainer GPU, its replica's first GPU) and its `Ranks`; with several
    ranks also the process group (gloo on CPU, nccl on CUDA, and gloo for host tensors when the
    co-located shards live on the host; collectives time out after
    train.dist_timeout_s). Returns (job, ranks)."""
    world = world or World.from_env()
    if world.size == 1 and not (os.environ.get(ONE_RANK_GROUP) == "1" and node_layout(job.hw).colocated):
        return job, Ranks()
    layout = node_layout(job.hw)
    timeout = datetime.timedelta(seconds=job.train.dist_timeout_s)
    if job.hw.device == "cuda":
        trainer_gpu, target_gpu = layout.rank_gpus(world.local_rank)
        job = dataclasses.replace(job, hw=dataclasses.replace(job.hw, trainer_gpu=trainer_gpu, target_gpu=target_gpu))
        torch.cuda.set_device(trainer_gpu)
        # FSDP2's CPU offload (co-located, train.optimizer_device=cpu) keeps the grad shards on the
        # host: the gradient norm's all-reduce over them needs a CPU backend beside NCCL
        offload = layout.colocated and job.train.optimizer_device == "cpu"
        dist.init_process_group("cuda:nccl,cpu:gloo" if offload else "nccl", timeout=timeout,
                                device_id=torch.device("cuda", trainer_gpu))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    cp, cp_group = job.hw.context_parallel, None
    if cp > 1:  # every rank creates every group, in the same order (torch.distributed.new_group)
        for first in range(0, dist.get_world_size(), cp):
            group = dist.new_group(list(range(first, first + cp)), timeout=timeout)
            if first <= dist.get_rank() < first + cp:
                cp_group = group
    heartbeat = start_heartbeat(job.train, dist.get_rank(), dist.get_world_size(), nccl=job.hw.device == "cuda")
    return job, Ranks(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=world.local_rank,
                      per_replica=layout.per_replica, colocated=layout.colocated, cp=cp, cp_group=cp_group,
                      heartbeat=heartbeat, grouped=world.size == 1)


# What torchrun puts in a rank's environment (TORCHELASTIC_* too).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def launcher_env_hidden():
    """Hide torchrun's variables from processes started inside (the target process), then restore
    them. The target's SGLang sets up its own torch.distributed world over tcp://; with torchrun's
    TORCHELASTIC_USE_AGENT_STORE=True inherited, torch makes every rank of that world a client of
    a store nobody serves, and the engine hangs at start."""
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(hidden)


def stop_ranks(ranks: Ranks | None = None) -> None:
    """End the process group; first the heartbeat, leaving "done" or, called while an error
    propagates (a `finally`), its first line: the other ranks then end at once, naming it."""
    if ranks is not None and ranks.heartbeat is not None:
        err = sys.exc_info()[1]
        ranks.heartbeat.stop("done" if err is None else
                             f"ended with {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
