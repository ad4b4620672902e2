"""Data-parallel trainer ranks started by torchrun: which rank this process is, its GPUs, and the
few collectives the loop needs.

One trainer rank per target replica; each rank runs its own target process (its own stream).
Every global batch (train.batch_size samples per rank x ranks) is cut into contiguous per-rank
slices. Each rank divides its summed loss by the GLOBAL number of loss positions and the gradients
are summed over ranks, so W ranks x batch b make the same update as one rank x batch W*b.

A single process (plain `python -m ...`, or torchrun with one rank) is rank 0 of 1: no process
group, no collective, the code path of a one-rank run is unchanged.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..setup.layout import World, rank_gpus


class RankFailed(RuntimeError):
    """A collective with the other trainer ranks failed (a rank died, hung or timed out)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks and the collectives over them.

    With one rank every method is the identity; with several, a failed or timed-out collective
    raises RankFailed.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the only one that prints, logs, checkpoints and exports."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def share(self, sample_ids: list[int], per_rank: int) -> list[int]:
        """This rank's contiguous slice of a global batch (rank-major; may be empty for a short batch)."""
        return sample_ids[self.rank * per_rank:(self.rank + 1) * per_rank]

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.world > 1:
            try:
                dist.all_reduce(t, op=op)
            except RuntimeError as err:  # gloo: peer closed / timeout; nccl: timeout
                raise RankFailed(f"trainer rank {self.rank}: a collective with the other ranks failed "
                                 f"(another rank died or hung): {err}") from None
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """In place: t = Σ over ranks."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def sum_ints(self, values: list[int], device) -> list[int]:
        return [int(v) for v in self.sum(torch.tensor(values, dtype=torch.int64, device=device)).tolist()]

    def check_same(self, value: int, what: str, device) -> None:
        """Raise (on every rank) unless all ranks hold the same integer."""
        if self.world == 1:
            return
        t = self._reduce(torch.tensor([value, -value], dtype=torch.int64, device=device), dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise ValueError(f"the trainer ranks disagree on {what} (from {-int(t[1])} to {int(t[0])}): "
                             f"train.out_dir must be one folder every rank sees")

    def from_main(self, obj):
        """Rank 0's value of a picklable object, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as err:
            raise RankFailed(f"trainer rank {self.rank}: broadcast from rank 0 failed: {err}") from None
        return box[0]


def start_ranks(job, world: World | None = None):
    """This process's job (its trainer GPU, its replica's first GPU) and its `Ranks`; with several
    ranks also the process group (gloo on CPU, nccl on CUDA; collectives time out after
    train.dist_timeout_s). Returns (job, ranks)."""
    world = world or World.from_env()
    if world.size == 1:
        return job, Ranks()
    timeout = datetime.timedelta(seconds=job.train.dist_timeout_s)
    if job.hw.device == "cuda":
        trainer_gpu, target_gpu = rank_gpus(job.hw, world.local_rank)
        job = dataclasses.replace(job, hw=dataclasses.replace(job.hw, trainer_gpu=trainer_gpu, target_gpu=target_gpu))
        torch.cuda.set_device(trainer_gpu)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", trainer_gpu))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return job, Ranks(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=world.local_rank)


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


def stop_ranks() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
