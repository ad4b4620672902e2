"""A heartbeat of every trainer rank on the run's host store: a dead or hung rank ends the run
within a bound, on NCCL as on gloo, naming it.

Why a collective's own failure is not enough on GPUs: torchrun exports
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torch/distributed/elastic/agent/server/local_elastic_agent.py:
430-432), so an NCCL collective that waits on a dead or hung peer raises nothing in Python:
ProcessGroupNCCL's watchdog aborts the process after the group's timeout (ErrorHandlingMode
TearDown, torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:161-169;
distributed_c10d.py:1623-1627), train.dist_timeout_s, and a rank blocked in a host sync
(`.item()`) runs no Python signal handler until it returns. The RankFailed path (a Python error,
rank 0 saves) is gloo's.

So each rank runs a thread that, every train.heartbeat_timeout_s / 6 seconds, publishes on the
store (the TCPStore torchrun serves on MASTER_ADDR:MASTER_PORT) a beat counter, the schedule item
and phase the main thread last marked (`mark`) and whether it waits in a collective the trainer
calls (`waiting`), reads every other rank's, and ends the run when:
- a rank's beat stops for train.heartbeat_timeout_s (the process died, was killed or aborted by
  NCCL's watchdog, or its interpreter is frozen), or the store stops answering that long (node 0's
  torchrun agent is gone);
- a rank ended with an error (it published why before it left) while this one still runs;
- a rank stays in one schedule item longer than its phase allows (`bound`: train.step_timeout_s
  for a training or evaluation item; train.dist_timeout_s for start-up, a checkpoint and the
  export; the wait for the target's batch also up to train.engine_start_timeout_s, the stream's
  own bound on the first batch) while no rank is in a long phase within its bound (the
  others may be waiting for that one): named are the overdue ranks not waiting in a collective
  the trainer calls (those in a long phase first: the others likely wait for them), or every
  rank when all wait. On NCCL a rank waiting for a peer inside the step (a host sync) is not
  marked waiting and is named beside the one it waits for.
The first rank that sees it writes the reason under one key (compare-and-set), every rank reads
it, prints it with the newest complete checkpoint and the resume command, kills its process tree
(the target processes) and exits 1; torchrun then ends what is left. Nothing is saved on the way
out: a rank cannot gather, or even safely read, state that a hung collective may be writing; the
newest complete checkpoint (renamed into place only when whole) is the progress.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# bounded by train.dist_timeout_s; "stopping": a rank saving and reporting its own error
LONG_PHASES = ("start", "target", "checkpoint", "end", "stopping")
FAILED = "failed"  # the key of the reason the run ends


@dataclass
class Bounds:
    beat_s: float  # train.heartbeat_timeout_s: silence that makes a rank dead
    step_s: float  # train.step_timeout_s: one training or evaluation item
    long_s: float  # train.dist_timeout_s: start-up, a checkpoint, the export
    target_s: float = 0.0  # the target's batch: the first may take train.engine_start_timeout_s (the stream's own bound)

    def of(self, phase: str) -> float:
        if phase == "target":
            return max(self.long_s, self.target_s)
        return self.long_s if phase in LONG_PHASES else self.step_s

    def name(self, phase: str) -> str:
        """The field that bounds `phase`."""
        if phase == "target" and self.target_s > self.long_s:
            return "train.engine_start_timeout_s"
        return "train.dist_timeout_s" if phase in LONG_PHASES else "train.step_timeout_s"


@dataclass
class Seen:
    """What this rank's watcher last saw of a rank, and when (its own monotonic clock: no skew)."""
    state: dict
    beat_at: float  # when its beat last changed
    moved_at: float  # when its (item, phase) last changed


class Heartbeat:
    """This rank's beat on `store` and its watch over the other ranks'. `poll(now)` is one round
    (the thread's loop calls it; tests call it with their own clock). `on_failure(message)` ends
    the process (`end_process`); a test may pass its own."""

    def __init__(self, store, rank: int, world: int, bounds: Bounds,
                 on_failure: Optional[Callable[[str], None]] = None, clock=time.monotonic):
        self.store, self.rank, self.world, self.bounds, self.clock = store, rank, world, bounds, clock
        self.on_failure = on_failure or self.end_process
        self.run_dir: Optional[Path] = None
        self._item, self._phase, self._waiting, self._beat = -1, "start", "", 0
        self._seen: dict[int, Seen] = {}
        self._store_down_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._host = socket.gethostname()
        self._started = clock()

    # ---------------------------------------------------------------------- the main thread
    def mark(self, item: int, phase: str) -> None:
        """The schedule item and phase the main thread is in (a change is progress). "stopping"
        stays: the save on the way out (its "checkpoint") must not let another rank's end stop it."""
        if self._phase != "stopping":
            self._item, self._phase = item, phase

    def phase(self, phase: str) -> None:
        self.mark(self._item, phase)

    @contextmanager
    def waiting(self, what: str):
        """The main thread waits on the other ranks in `what` (a collective it calls)."""
        self._waiting = what
        try:
            yield
        finally:
            self._waiting = ""

    def start(self) -> "Heartbeat":
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="specforge-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, ended: str = "done") -> None:
        """Stop beating and leave `ended` for the others: "done", or why this rank ends (an error:
        the others then end at once, naming it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._phase = f"ended: {ended}"
        try:
            self._publish()
        except Exception:
            pass  # the store is gone: the others find that out themselves

    # --------------------------------------------------------------------------- the watch
    def _loop(self) -> None:
        interval = max(0.1, self.bounds.beat_s / 6)
        while not self._stop.wait(interval):
            message = self.poll(self.clock())
            if message is not None:
                self.on_failure(message)
                return

    def _state(self) -> dict:
        return {"beat": self._beat, "item": self._item, "phase": self._phase, "waiting": self._waiting,
                "host": self._host, "pid": os.getpid()}

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(f"rank{self.rank}", json.dumps(self._state()))

    def poll(self, now: float) -> Optional[str]:
        """One round: publish this rank's state, read the others', and the reason the run ends (None: go on)."""
        try:
            self._publish()
            if self._phase.startswith("ended") or self._phase == "stopping":
                return None  # on its own way out (an error being saved and reported): not stopped midway
            if self.store.check([FAILED]):
                return self.store.get(FAILED).decode()
            states = {r: json.loads(self.store.get(f"rank{r}")) for r in range(self.world)
                      if r == self.rank or self.store.check([f"rank{r}"])}
            self._store_down_since = None
        except Exception as err:  # the store's host is gone (node 0's torchrun agent, or rank 0 without torchrun)
            self._store_down_since = self._store_down_since or now
            if now - self._store_down_since <= self.bounds.beat_s:
                return None
            addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"the run's store at {addr} (torchrun's agent on node 0) has not answered for "
                    f"{now - self._store_down_since:.0f} s (train.heartbeat_timeout_s={self.bounds.beat_s:g}): node 0 "
                    f"or its agent is gone ({type(err).__name__}: {err})")
        states[self.rank] = self._state()
        for r, state in states.items():
            seen = self._seen.get(r)
            if seen is None:
                self._seen[r] = Seen(state, now, now)
                continue
            if state["beat"] != seen.state["beat"]:
                seen.beat_at = now
            if (state["item"], state["phase"]) != (seen.state["item"], seen.state["phase"]):
                seen.moved_at = now
            seen.state = state
        message = self.verdict(now)
        if message is not None:  # the first rank's reason is everyone's
            self.store.compare_set(FAILED, "", message)
            return self.store.get(FAILED).decode()
        return None

    def verdict(self, now: float) -> Optional[str]:
        """The reason the run ends, from what this rank has seen (None: go on)."""
        for r in range(self.world):
            if r == self.rank:
                continue
            seen = self._seen.get(r)
            if seen is None:  # never published: it has not reached its heartbeat yet, or died before
                if now - self._started > self.bounds.beat_s:
                    return (f"trainer rank {r} has sent no heartbeat in {now - self._started:.0f} s since this "
                            f"rank's first (train.heartbeat_timeout_s={self.bounds.beat_s:g}): it died or never started")
                continue
            ended = seen.state["phase"]
            if ended.startswith("ended") and ended != "ended: done":
                return f"{self._name(r)} {ended[len('ended: '):]}"
            if not ended.startswith("ended") and now - seen.beat_at > self.bounds.beat_s:
                return (f"{self._name(r)} has sent no heartbeat for {now - seen.beat_at:.0f} s "
                        f"(train.heartbeat_timeout_s={self.bounds.beat_s:g}): the process died (killed, out of "
                        f"memory, aborted by NCCL's watchdog) or is frozen; it was last seen in {self._where(r)}")
        live = {r: s for r, s in self._seen.items() if not s.state["phase"].startswith("ended")}
        overdue = [r for r, s in live.items() if now - s.moved_at > self.bounds.of(s.state["phase"])]
        if not overdue or any(s.state["phase"] in LONG_PHASES and r not in overdue for r, s in live.items()):
            return None
        stuck = [r for r in overdue if not live[r].state["waiting"]]
        in_long = [r for r in stuck if live[r].state["phase"] in LONG_PHASES]
        hung = in_long or stuck or (overdue if len(overdue) == len(live) else [])
        if not hung:
            return None  # the overdue ones wait in collectives for ranks still moving
        r = hung[0]
        bound = self.bounds.name(live[r].state["phase"])
        others = "; ".join(f"rank {q}: {self._where(q)}" for q in sorted(live) if q not in hung)
        who = ", ".join(self._name(q) for q in hung)
        verb = "have" if len(hung) > 1 else "has"
        return (f"{who} {verb} made no progress for {now - live[r].moved_at:.0f} s in {self._where(r)} "
                f"({bound}={self.bounds.of(live[r].state['phase']):g}): hung" + (f"; {others}" if others else ""))

    def _name(self, r: int) -> str:
        s = self._seen[r].state
        return f"trainer rank {r} (host {s['host']}, pid {s['pid']})"

    def _where(self, r: int) -> str:
        s = self._seen[r].state
        where = f"schedule item {s['item']} ({s['phase']})" if s["item"] >= 0 else f"its {s['phase']}"
        return where + (f", waiting in {s['waiting']}" if s["waiting"] else "")

    # ------------------------------------------------------------------------------ the end
    def end_process(self, message: str) -> None:
        """Print why, the newest complete checkpoint and the resume command; kill this rank's
        process tree (its target processes ignore SIGTERM); exit 1. Runs on the heartbeat thread:
        the main thread may be blocked in a collective that never returns."""
        from .checkpoint import list_checkpoints

        progress = ""
        if self.run_dir is not None:
            found = list_checkpoints(self.run_dir)
            progress = (f"\nprogress saved: {found[-1]} (the newest complete checkpoint; resume with "
                        f"train.resume=auto train.out_dir={self.run_dir})" if found else
                        "\nno checkpoint yet (saved every train.checkpoint_every steps)")
        print(f"\ndata-parallel failure: trainer rank {self.rank} stops: {message}{progress}", file=sys.stderr,
              flush=True)
        kill_tree()
        sys.stdout.flush()
        os._exit(1)


def kill_tree() -> None:
    """SIGKILL every process this one started (and theirs)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=10)


def start_heartbeat(tr, rank: int, world: int, nccl: bool) -> Optional[Heartbeat]:
    """The heartbeat of this rank when train.heartbeat_timeout_s asks for one (null: on NCCL only),
    over a client of the store at MASTER_ADDR:MASTER_PORT (torchrun's, or rank 0's without it);
    `tr`: the `train` group."""
    beat_s = tr.heartbeat_timeout_s if tr.heartbeat_timeout_s is not None else (60.0 if nccl else 0.0)
    if not beat_s or world == 1:
        return None
    import datetime

    import torch.distributed as dist

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=max(beat_s, 30)))
    prefix = f"specforge_k25/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return Heartbeat(dist.PrefixStore(prefix, client), rank, world,
                     Bounds(beat_s=beat_s, step_s=tr.step_timeout_s, long_s=tr.dist_timeout_s,
                            target_s=tr.engine_start_timeout_s)).start()
