"""`run_training`: one run of `python -m specforge_k25.train` on this rank: its threads, the run's
setup (setup/run.py `prepare`), torchrun's ranks and the Trainer (train/trainer.py); the ranks are
stopped however it ends."""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from ..config import JobConfig
from ..setup.data_checks import regeneration_note
from ..setup.run import prepare
from ..setup.target import make_target_stream
from .distributed import start_ranks, stop_ranks
from .optim import rank_threads
from .run_lock import RunLock
from .trainer import Trainer


def run_training(job: JobConfig, run_dir: str | Path, engine: str = "sglang", lock: RunLock | None = None) -> dict:
    """Train a draft online and export it. Returns the summary (also written to summary.json).

    Raises TrainingInterrupted (after saving) on SIGTERM/SIGINT, and StreamError (after saving)
    when the target process fails, dies or stalls. Under torchrun every rank calls this
    (train/distributed.py); only rank 0 prints, logs, checkpoints and exports, and a rank that
    sees another one fail raises RankFailed (rank 0 after saving).
    """
    ranks = None
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        t_start = time.perf_counter()
        torch.manual_seed(job.train.seed)
        threads = rank_threads(job.hw.device, job.hw.trainer_threads, job.hw.host_threads_per_rank,
                               job.train.optimizer_device)
        if threads:  # torchrun leaves a rank OMP_NUM_THREADS=1
            torch.set_num_threads(threads)
        setup = prepare(job)
        job, ranks = start_ranks(job)  # torchrun: this rank's trainer GPU and target replica, the process group
        ranks.check_same_data(setup.data.sha1())
        note = regeneration_note(setup.method, job.data.regenerate) if ranks.main else None
        if note:
            print(note, flush=True)
        run_dir = Path(ranks.from_main(str(run_dir)))  # Hydra's default folder is a timestamp: take rank 0's
        trainer = Trainer(job, setup, run_dir, ranks, partial(make_target_stream, engine=engine), t_start)
        trainer.held_lock = lock  # `lock`: rank 0's, on run_dir, taken by the caller
        return trainer.run()
    finally:
        stop_ranks(ranks)  # with the heartbeat: "done", or the error the other ranks then end with
        if lock is not None:  # released cleanly also when the run failed before training
            lock.release()
