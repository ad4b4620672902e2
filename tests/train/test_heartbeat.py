"""The trainer ranks' heartbeat (train/heartbeat.py): what ends the run when a collective raises
nothing (NCCL under torchrun), and the abort path on CPU as NCCL's watchdog leaves it.

The rules run on hand-made rounds (two ranks' Heartbeats on one in-memory store, a clock the test
sets); the whole path (a real TCPStore, the thread, the process tree, the checkpoint) runs in two
gloo ranks whose collective never returns, as on NCCL."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from specforge_k25.train.heartbeat import Bounds, Heartbeat


def _pair(beat_s=2.0, step_s=10.0, long_s=100.0, target_s=0.0):
    store = dist.HashStore()
    bounds = Bounds(beat_s=beat_s, step_s=step_s, long_s=long_s, target_s=target_s)
    return [Heartbeat(store, r, 2, bounds, clock=lambda: 0.0) for r in range(2)]


def _round(beats, now):
    return [hb.poll(now) for hb in beats]


def test_a_silent_rank_is_named_after_the_heartbeat_timeout():
    h0, h1 = _pair(beat_s=2.0)
    for t in (0, 1, 2):
        assert _round([h0, h1], t) == [None, None]
    # rank 1 falls silent; h0 sees its last beat (published after h0's round at t=2) at t=3, on
    # its own clock (no skew between nodes)
    assert h0.poll(3) is None and h0.poll(5) is None  # silent for 2 s: not more than the bound
    message = h0.poll(5.2)
    assert message.startswith(f"trainer rank 1 (host {socket.gethostname()}, pid {os.getpid()}) has sent no "
                              f"heartbeat for 2 s (train.heartbeat_timeout_s=2): the process died"), message
    assert h1.poll(5.3) == message  # the first reason is every rank's (one key on the store)


def test_a_hung_rank_is_named_not_the_one_waiting_for_it():
    h0, h1 = _pair(step_s=10.0)
    for hb in (h0, h1):
        hb.mark(3, "train")
    with h0.waiting("an all_reduce (SUM)"):
        for t in range(11):
            assert _round([h0, h1], t) == [None, None], t
        message = h0.poll(11.6)  # h0 first saw rank 1 at t=1
    assert message == (f"trainer rank 1 (host {socket.gethostname()}, pid {os.getpid()}) has made no progress for 11 s "
                       f"in schedule item 3 (train) (train.step_timeout_s=10): hung; rank 0: schedule item 3 (train), "
                       f"waiting in an all_reduce (SUM)")
    # every rank waiting in a collective past the bound: all are named; a waiting rank alone is
    # not, while the rank it waits for still moves
    g0, g1 = _pair(step_s=10.0)
    for hb in (g0, g1):
        hb.mark(5, "eval")
    with g0.waiting("all_gather_object"):
        _round([g0, g1], 0), _round([g0, g1], 0.1)
        for t in range(1, 12):
            g1.mark(5 + t, "eval")
            assert _round([g0, g1], t) == [None, None], t
        with g1.waiting("a sum of counts"):
            _round([g0, g1], 12), _round([g0, g1], 13)  # g0 sees rank 1's last move a round late: at t=12
            assert g0.poll(21.9) is None
            message = g0.poll(22.2)
    assert message.startswith("trainer rank 0 (host") and "trainer rank 1 (host" in message, message
    assert "have made no progress for 22 s in schedule item 5 (eval), waiting in all_gather_object" in message


def test_a_long_phase_is_bounded_by_the_dist_timeout_and_shelters_those_waiting_for_it():
    h0, h1 = _pair(step_s=10.0, long_s=100.0)
    h0.mark(7, "checkpoint")  # rank 0 writes a checkpoint; rank 1 waits in the next item for it
    h1.mark(8, "train")
    for t in range(0, 101, 5):
        assert _round([h0, h1], t) == [None, None], t
    message = h1.poll(101)
    assert message.startswith("trainer rank 0 (host") and "made no progress for 101 s in schedule item 7 " \
        "(checkpoint) (train.dist_timeout_s=100): hung; rank 1: schedule item 8 (train)" in message, message
    # the wait for the target's batch: up to the engine's start bound, when that is the larger
    g0, g1 = _pair(step_s=10.0, long_s=100.0, target_s=300.0)
    g0.mark(0, "target")  # its engine still loading
    g1.mark(0, "train")
    for t in range(0, 301, 50):
        assert _round([g0, g1], t) == [None, None], t
    assert "(target) (train.engine_start_timeout_s=300): hung" in g1.poll(301)


def test_a_rank_that_ended_with_an_error_ends_the_others_and_done_does_not():
    h0, h1 = _pair()
    _round([h0, h1], 0)
    h1.stop("done")  # finished its part (its export is rank 0's)
    h0.phase("end")
    for t in range(1, 30):
        assert h0.poll(t) is None
    g0, g1 = _pair()
    _round([g0, g1], 0)
    g1.stop("ended with StreamError: target process specforge-target died (exit code -9)")
    assert g0.poll(0.5) == (f"trainer rank 1 (host {socket.gethostname()}, pid {os.getpid()}) ended with "
                            f"StreamError: target process specforge-target died (exit code -9)")
    # a rank saving and reporting its own error is not stopped midway by another's reason
    k0, k1 = _pair()
    _round([k0, k1], 0)
    k0.phase("stopping")
    k0.phase("checkpoint")  # the save on its way out (Trainer.save marks it): still stopping
    k1.store.compare_set("failed", "", "trainer rank 1 found a reason")
    assert k0.poll(1) is None and k1.poll(1) == "trainer rank 1 found a reason"
    k1.stop("ended with TrainingInterrupted: stopped by SIGTERM")  # its part of an agreed stop done first
    assert k0.poll(2) is None  # rank 0 still writing the checkpoint is not ended midway


def test_stop_ranks_during_an_error_leaves_its_first_line_for_the_others():
    from specforge_k25.train.distributed import Ranks, stop_ranks

    h0, h1 = _pair()
    _round([h0, h1], 0)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("target process specforge-target died (exit code -9)\nprogress saved: ...")
        finally:  # as run_training ends
            stop_ranks(Ranks(rank=1, world=2, heartbeat=h1))
    assert h0.poll(1) == (f"trainer rank 1 (host {socket.gethostname()}, pid {os.getpid()}) ended with "
                          f"RuntimeError: target process specforge-target died (exit code -9)")


def test_a_store_that_stops_answering_ends_the_run_after_the_heartbeat_timeout(monkeypatch):
    h0, h1 = _pair(beat_s=2.0)
    _round([h0, h1], 0)

    class Gone:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("Connection reset by peer")
            return fail

    h0.store = Gone()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert h0.poll(1) is None and h0.poll(3) is None
    assert h0.poll(3.5) == ("the run's store at 10.0.0.1:29500 (torchrun's agent on node 0) has not answered for 2 s "
                            "(train.heartbeat_timeout_s=2): node 0 or its agent is gone (RuntimeError: Connection "
                            "reset by peer)")


# --------------------------------------- the abort path: two gloo ranks whose collective never returns
def _rank(rank: int, port: int, run_dir: str, scenario: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # what this rank prints on its way out, for the test to read
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    import subprocess
    import sys

    import torch

    from specforge_k25.config import JobConfig
    from specforge_k25.train.distributed import start_ranks

    job = JobConfig()
    job.hw.target_replicas = 2
    job.train.heartbeat_timeout_s, job.train.step_timeout_s, job.train.dist_timeout_s = 2.0, 3.0, 600.0
    job, ranks = start_ranks(job)
    assert ranks.heartbeat is not None
    # a stand-in for the target process: started by the rank, ignores SIGTERM as the real one does
    target = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "time.sleep(600)"])
    Path(run_dir, f"target{rank}.pid").write_text(str(target.pid))
    ranks.sum(torch.ones(1))  # both ranks here: a real gloo all_reduce
    dist.all_reduce = lambda *a, **k: time.sleep(3600)  # from now on as on NCCL: the host waits, nothing raises
    batches = ranks.marked(iter([None] * 10), 0, lambda i: "train", Path(run_dir))
    next(batches), next(batches), next(batches)  # at schedule item 2
    time.sleep(1)  # into its step (the heartbeat publishes the item and phase every 1/6 of its timeout)
    if rank == 1:
        Path(run_dir, "lost_at").write_text(repr(time.time()))
    if rank == 1 and scenario == "abort":
        os.kill(os.getpid(), signal.SIGABRT)  # what NCCL's watchdog does to a rank (TORCH_NCCL_ASYNC_ERROR_HANDLING=1)
    if rank == 1 and scenario == "hang":
        time.sleep(3600)  # stuck in its forward (a host sync that never returns), its heartbeat still beating
    ranks.sum(torch.ones(1))  # rank 0 waits here for rank 1, forever


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["abort", "hang"])
def test_a_rank_lost_on_a_collective_that_never_returns_ends_the_run_naming_it(tmp_path, scenario):
    """Rank 1 is aborted (SIGABRT, as NCCL's watchdog does) or hangs in its step while rank 0 waits
    in a collective that never returns (NCCL's host wait): within the bound every remaining rank
    prints the reason naming rank 1 and the newest complete checkpoint, its target process is
    killed, it exits 1, and the checkpoint is untouched."""
    import torch
    import torch.multiprocessing as mp

    from specforge_k25.train.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

    run = tmp_path / "run"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    saved = save_checkpoint(run, 4, model.state_dict(), opt.state_dict(), {}, {"step": 4})
    digest = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in saved.iterdir()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    logs = [str(tmp_path / f"rank{r}.err") for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, port, str(run), scenario, logs[r])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=90)
        ended_at = time.time()
        procs[1].join(timeout=30)
    finally:
        for p in procs:
            p.kill()
        leftover = [int(f.read_text()) for f in run.glob("target*.pid")]
        for pid in leftover:  # rank 1's stand-in after its abort (the real target dies with its rank: PDEATHSIG)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    errs = [Path(log).read_text() for log in logs]
    assert procs[0].exitcode == 1, (procs[0].exitcode, errs)
    assert procs[1].exitcode == (-signal.SIGABRT if scenario == "abort" else 1), (procs[1].exitcode, errs[1])
    ranks_out = [0] if scenario == "abort" else [0, 1]  # a hung rank ends itself too: its own watch sees it
    why = ("has sent no heartbeat for" if scenario == "abort" else
           "has made no progress for")
    for r in ranks_out:
        line = next(l for l in errs[r].splitlines() if l.startswith("data-parallel failure: "))
        assert line.startswith(f"data-parallel failure: trainer rank {r} stops: trainer rank 1 (host "), errs[r]
        assert why in line and "schedule item 2 (train)" in line, line
        assert f"progress saved: {saved} (the newest complete checkpoint; resume with train.resume=auto " \
            f"train.out_dir={run})" in errs[r]
        pid = int((run / f"target{r}.pid").read_text())
        assert not _alive(pid), f"rank {r}'s target process {pid} outlived it"
    took = ended_at - float((run / "lost_at").read_text())  # from rank 1's abort or hang to rank 0's end
    print(f"{scenario}: rank 0 ended {took:.1f} s after rank 1 was lost")
    assert took < 10, took  # the bounds (2 s silent, 3 s in an item) and a beat or two, not train.dist_timeout_s
    assert list_checkpoints(run) == [saved]
    assert {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in saved.iterdir()} == digest
    tensors = read_checkpoint(saved)[1]
    assert torch.equal(tensors["weight"], model.weight.detach())


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_heartbeat_is_nccls_by_default_and_off_on_gloo():
    from specforge_k25.config import JobConfig
    from specforge_k25.train.heartbeat import start_heartbeat

    job = JobConfig()
    assert job.train.heartbeat_timeout_s is None
    assert start_heartbeat(job.train, 0, 2, nccl=False) is None  # gloo: its collectives raise by themselves
    job.train.heartbeat_timeout_s = 0.0
    assert start_heartbeat(job.train, 0, 2, nccl=True) is None  # 0: off
    job.train.heartbeat_timeout_s = None
    assert start_heartbeat(job.train, 0, 1, nccl=True) is None  # one rank: nobody to watch
