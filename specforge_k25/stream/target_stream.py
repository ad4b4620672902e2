"""The trainer's side of the target processes (stream/target_process.py): `TargetStream` starts
them, iterates the batches they stream into a `SlotRing`, and notices within `poll_s` + `timeout_s`
if one dies or stalls.

Tensor parallelism (tp_size > 1): one process per TP rank, as SGLang's own one_batch benchmark
runs them. TP rank 0 (`run_producer`) walks the batches and broadcasts each batch's token ids to
the other ranks (`run_tp_rank`), which run the same forward (or, regenerating, the same decoding
of a group of prompts) and discard its output; only rank 0 writes into the ring. The TP group may
span nodes (SGLang's nnodes / node_rank / dist_init_addr): the trainer's node starts its local
ranks here, every other node runs only its own ranks (`run_tp_node`, `python -m
specforge_k25.train.tp_node`).

Pipeline parallelism (pp_size > 1, one node): tp_size * pp_size processes, world rank = tp_size *
stage + TP rank (SGLang's layout). Every rank walks the same batches itself (`run_producer`: no
per-batch broadcast, which would make each stage wait for the last); every stage forwards its own
layers and sends the proxies, with the aux states captured so far, to the next
(target_engine/sglang_pipeline.py). Dedicated trainer: the last stage's TP rank 0 holds the whole
states and fills the ring. Co-located: one trainer rank beside every stage rank, as below, except
that the last stage sends each earlier stage's rank its share (stream/pipeline_shares.py).

Co-located trainer ranks (hw.trainer_layout=colocated): each trainer rank starts only its own TP
rank (`TargetStream(tp_rank=...)`) with a ring of its own on the same GPU. Every TP rank holds the
whole residual stream after SGLang's all-reduce, so each writes only its trainer's share of every
batch (`keep`: positions in the batch) and no hidden state crosses GPUs.
"""
from __future__ import annotations

import os
import queue
import signal
import time
from multiprocessing import resource_tracker

import psutil
import torch

from ..target_engine.factory import TargetSpec, check_tp_layout
from .channel import Channel, first_ready
from .progress import BatchProgress
from .ring import EndOfStream, ProducerFailed, SeqWindow, SlotMessage, SlotRing
from .target_process import GROUP_SIGNALS, run_producer, run_tp_rank, sequence_room




class Rendezvous:
    """Where the TP ranks of a one-node target meet: a TCPStore this (the trainer's) process serves,
    on 127.0.0.1 only, bound to a port the kernel picks (port 0) and kept until the ranks are gone. Picking a free port,
    releasing it and letting rank 0 bind it would race with any other process; a store that is
    already listening cannot be taken. The ranks reach it through torch's env:// rendezvous as
    clients (TORCHELASTIC_USE_AGENT_STORE), and SGLang 0.5.23 uses env:// when
    SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE says so (distributed/bootstrap.py _resolve_dist_init_method)."""

    def __init__(self, timeout_s: float):
        import datetime
        import socket

        from torch.distributed import TCPStore

        # The store is unauthenticated: it listens on loopback only. Given a host and port, torch
        # binds every interface; a socket bound here and handed over (master_listen_fd, which
        # torch's libuv server supports) keeps it to 127.0.0.1. The store owns the socket from
        # then on and closes it with itself.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(socket.SOMAXCONN)
            port = listener.getsockname()[1]
            self.store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  master_listen_fd=listener.fileno(), use_libuv=True)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the fd is the store's now: closing it here too would close it twice

    def env(self) -> dict[str, str]:
        """What a rank's environment needs to join (set in the parent around process start)."""
        return self.env_for(self.store.port)

    @staticmethod
    def env_for(port: int) -> dict[str, str]:
        return {"SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": "env://", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _start_quietly(process, env: dict[str, str] | None = None) -> None:
    """Start a target process with PYTHONDONTWRITEBYTECODE (it writes nothing to disk, not even
    bytecode caches, so its I/O counter measures hidden-state bytes on disk: expected 0), `env`
    added to the environment it inherits and the group signals blocked until it ignores them."""
    added = {"PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    previous = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    # multiprocessing starts its resource tracker on the first spawn and UNBLOCKS SIGINT / SIGTERM
    # after doing so (resource_tracker.ensure_running): started inside process.start(), it would
    # let the child start with them unblocked. Start it first, so the mask below holds.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)  # inherited: the child starts with them blocked
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came meanwhile reaches this process now
        for k, v in previous.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _stop(processes, grace_s: float = 0.0) -> None:
    """Kill target processes and anything they started (no orphans). SIGKILL: they ignore SIGTERM
    (target_process.GROUP_SIGNALS) and hold nothing to save (the trainer owns the ring).
    grace_s: time to let processes that are ending on their own (after their EndOfStream) finish
    their interpreter exit first. A kill during that exit can land between multiprocessing's unlink
    of a semaphore the process made (a library's lock; tqdm's is a thread lock here) and its message
    to the resource tracker, which then warns of a "leaked semaphore" at the trainer's exit."""
    children = []
    for process in processes:
        if process.is_alive():
            try:
                children += psutil.Process(process.pid).children(recursive=True)
            except psutil.Error:
                pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=5)


def run_tp_node(spec: TargetSpec, poll_s: float = 1.0) -> int:
    """A node of a multi-node target that does not hold TP rank 0: run this node's TP ranks until
    rank 0 ends the batches. Returns 0, or raises RuntimeError naming the first rank that failed
    (the others are stopped). The ranks die with this process."""
    check_tp_layout(spec)
    ranks = spec.local_tp_ranks()
    if 0 in ranks:
        raise ValueError("this node holds TP rank 0: it runs the trainer (python -m specforge_k25.train)")
    print(f"target TP ranks {ranks[0]}..{ranks[-1]} of {spec.tp_size} (node {spec.node_rank} of {spec.nnodes}), "
          f"rendezvous {spec.dist_init_addr}", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=run_tp_rank, args=(spec, r, None, os.getpid()), name=f"specforge-target-tp{r}",
                             daemon=True) for r in ranks]
    try:
        for process in processes:
            _start_quietly(process)
        while any(p.is_alive() for p in processes):
            for rank, process in zip(ranks, processes):
                if not process.is_alive() and process.exitcode != 0:
                    raise RuntimeError(f"target TP rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
            time.sleep(poll_s)
        for rank, process in zip(ranks, processes):
            if process.exitcode != 0:
                raise RuntimeError(f"target TP rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
        return 0
    finally:
        _stop(processes)


class StreamError(RuntimeError):
    """The target process failed, died or stalled."""


class StreamInterrupted(RuntimeError):
    """`should_stop()` turned true while waiting for the target (e.g. a SIGTERM flag)."""


class TargetStream:
    """Trainer-side handle: starts the target process and yields its batches in order.

    with TargetStream(spec, sequences, batches, ...) as stream:
        for msg, aux, final in stream:   # aux [N, K*Ht] (K = spec.num_aux), final [N, Ht] views into shared memory
            ...use them...
            stream.release(msg)          # hand the slot back (do this as early as possible)
    """

    def __init__(self, spec: TargetSpec, sequences: list[torch.Tensor], batches: list[list[int]], *,
                 hidden_size: int, slots: int = 3, timeout_s: float = 600.0, start_timeout_s: float = 3600.0,
                 poll_s: float = 1.0, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 tp_rank: int | None = None, keep: list[list[int]] | None = None, before: list[list[int]] = (),
                 routes: list[list[list[int]]] | None = None, window: SeqWindow | None = None,
                 known: dict[int, torch.Tensor] | None = None):
        """tp_rank (co-located): start only this TP rank, which fills this stream's ring with the
        positions `keep[i]` of batch i (batches with none send nothing); the TP group meets at
        `open_rendezvous()` of the stream holding TP rank 0 (`join_rendezvous(port)` elsewhere).
        before (a resume that regenerates): the batches run before `batches`, which place the
        remaining prompts in the regeneration groups of an uninterrupted run (target_process.py).
        known (regenerating): {sequence index: prompt + saved answer}, never decoded again.
        routes (co-located beside a pipeline's stages): per batch, every rank's positions (`keep` is
        this rank's); the last stage sends each rank its share (stream/pipeline_shares.py).
        window (co-located, context parallelism): this rank's rows of each kept sequence only (the
        slots are sized for them)."""
        self.spec, self.batches, self.poll_s, self.before = spec, batches, poll_s, list(before)
        self.tp_rank, self.keep, self.routes, self.window = tp_rank, keep, routes, window
        self.known = known or {}
        # the rank that fills this ring: co-located, this stream's TP rank; dedicated, the one holding
        # the whole states (TP rank 0; a pipeline's last stage's TP rank 0)
        self.producer_rank = tp_rank if tp_rank is not None else spec.tp_size * (spec.pp_size - 1)
        self.expected = sum(1 for k in keep if k) if keep is not None else len(batches)  # messages to read
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s  # between batches / until the first
        self._received_any = False
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.tokens = torch.cat(sequences) if sequences else torch.zeros(0, dtype=torch.int64)
        room = [sequence_room(spec, int(n)) for n in lengths]  # regeneration: prompt + its answer budget
        carried = [b if keep is None else [b[p] for p in k] for b, k in zip(batches, keep or batches)]
        if window is not None:
            max_tokens = max((sum(e - a for a, e in window.spans([room[i] for i in b])) for b in carried if b), default=1)
        else:
            max_tokens = max((sum(room[i] for i in b) for b in carried), default=1)
        self.prompt_lengths = lengths.tolist()
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.ring = SlotRing(self.ctx, slots, max_tokens, hidden_size, dtype, device, num_aux=spec.num_aux)
        self.process = None  # TP rank 0: the one that fills the ring
        self.tp_processes: dict[int, object] = {}  # every TP rank started on this node, rank 0 included
        self.reports: dict[int, Channel] = {}  # the failure channels of the ranks that do not fill the ring
        self.progress = BatchProgress(spec.world_size)  # each rank's batches started / finished: who is behind
        self.wait_s = 0.0  # trainer time spent waiting for the target
        self.target_io: EndOfStream | None = None  # the target's own write counters, sent at its end
        self.should_stop = lambda: False  # polled while waiting; True -> StreamInterrupted
        self.rendezvous: Rendezvous | None = None  # one-node TP > 1: where the ranks meet
        self._rendezvous_env: dict[str, str] | None = None

    def open_rendezvous(self) -> int:
        """Co-located, TP rank 0's stream: serve the TP group's rendezvous; returns its port."""
        self.rendezvous = Rendezvous(self.start_timeout_s)
        self._rendezvous_env = self.rendezvous.env()
        return self.rendezvous.store.port

    def join_rendezvous(self, port: int) -> None:
        """Co-located, another TP rank's stream: meet at the port TP rank 0's stream serves."""
        self._rendezvous_env = {**Rendezvous.env_for(port)}

    def start(self) -> "TargetStream":
        """Start this node's target ranks: rank 0 and, with tp_size or pp_size > 1, the others (the
        rank filling the ring among them); co-located, only this stream's TP rank."""
        spec = self.spec
        check_tp_layout(spec)
        if spec.pp_size > 1 and self.tp_rank is not None and self.routes is None:
            raise ValueError("co-located trainer ranks beside a pipeline's stages need every rank's shares (routes)")
        ranks = ((spec.local_tp_ranks() if spec.pp_size == 1 else list(range(spec.world_size)))  # PP: one node
                 if self.tp_rank is None else [self.tp_rank])
        if self.tp_rank is None and 0 not in ranks:
            raise ValueError(f"target node rank {spec.node_rank} does not hold TP rank 0: the trainer runs on "
                             f"node 0; this node runs `python -m specforge_k25.train.tp_node` instead")
        env = self._rendezvous_env
        if env is None and spec.world_size > 1 and spec.nnodes == 1:  # several nodes meet at hw.target_dist_init_addr instead
            if self.tp_rank is not None:
                raise ValueError("a co-located TP rank needs the rendezvous of TP rank 0 (open_rendezvous / join_rendezvous)")
            self.rendezvous = Rendezvous(self.start_timeout_s)
            env = self.rendezvous.env()
        for rank in ranks:
            if spec.pp_size > 1:  # every pipeline rank walks the batches itself (run_producer)
                fills = rank == self.producer_rank
                process = self.ctx.Process(
                    target=run_producer, args=(spec, self.tokens, self.offsets, self.batches,
                                                 self.ring if fills else None, os.getpid(), self.keep, self.before,
                                                 self.routes, rank, self.ring.ready if fills else self._report(rank)),
                    kwargs={"progress": self.progress}, name=f"specforge-target-{self._rank_name(rank)}", daemon=True)
                if fills:
                    self.process = process
            elif rank == 0:
                process = self.ctx.Process(
                    target=run_producer, args=(spec, self.tokens, self.offsets, self.batches, self.ring, os.getpid(),
                                                 self.keep, self.before, self.routes),
                    kwargs={"window": self.window, "progress": self.progress, "known": self.known},
                    name="specforge-target", daemon=True)
                self.process = process
            elif self.tp_rank is not None:  # co-located: this rank fills the ring too
                process = self.ctx.Process(
                    target=run_tp_rank, args=(spec, rank, self.ring.ready, os.getpid(), self.ring,
                                                (self.prompt_lengths, self.batches, self.keep, self.window)),
                    kwargs={"progress": self.progress}, name=f"specforge-target-{self._rank_name(rank)}", daemon=True)
                self.process = process
            else:
                process = self.ctx.Process(target=run_tp_rank, args=(spec, rank, self._report(rank), os.getpid()),
                                           kwargs={"progress": self.progress},
                                           name=f"specforge-target-{self._rank_name(rank)}", daemon=True)
            self.tp_processes[rank] = process
            _start_quietly(process, env)
        return self

    def _report(self, rank: int) -> Channel:
        """Where a rank that does not fill the ring reports its failure: a channel of its own (one
        writer per channel: stream/channel.py), read beside the ring's `ready`."""
        self.reports[rank] = Channel(self.ctx)
        return self.reports[rank]

    def _rank_name(self, rank: int) -> str:
        """tp3, or with pipeline stages pp1-tp0 (rank = tp_size * stage + TP rank)."""
        tp = self.spec.tp_size
        return f"pp{rank // tp}-tp{rank % tp}" if self.spec.pp_size > 1 else f"tp{rank}"

    def _describe(self, rank: int) -> str:
        process = self.tp_processes[rank]
        spec = self.spec
        where = f"TP rank {rank % spec.tp_size} of {spec.tp_size}, " if spec.tp_size > 1 else ""
        if spec.pp_size > 1:
            where = f"pipeline stage {rank // spec.tp_size} of {spec.pp_size}, " + where
        return f"target process {process.name} ({where}pid {process.pid})"

    def _dead_ranks(self, but: int | None = None) -> list[str]:
        """Ranks (other than `but`) that are gone before their time: the rank filling the ring ends
        only after its end message, the others end with exit code 0 once rank 0 has told them the
        batches are done."""
        return [f"{self._describe(rank)} died with exit code {p.exitcode}" for rank, p in self.tp_processes.items()
                if rank != but and not p.is_alive() and (rank == self.producer_rank or p.exitcode != 0)]

    def _stalled(self, waited: float, knob: str) -> str:
        """Why nothing came for `waited` s: the ranks of this node the filler waits on, when one is
        behind it (stream/progress.py), else the filler itself."""
        filler, progress = self.producer_rank, self.progress
        behind = progress.behind(filler, self.tp_processes, self.spec.tp_size)
        if not behind:
            return f"{self._describe(filler)} produced nothing for {waited:.0f} s ({knob})"
        late = "; ".join(f"{self._describe(rank)} is behind: it {progress.where(rank)}" for rank in behind)
        tp = self.spec.tp_size
        needs = ("which needs the earlier stage's states" if behind[0] // tp < filler // tp
                 else "whose collectives need every TP rank")
        return (f"{late}, while {self._describe(filler)} {progress.where(filler)}, {needs}; nothing reached "
                f"the ring for {waited:.0f} s ({knob})")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        for expected in range(self.expected):
            msg = self._next()
            if isinstance(msg, EndOfStream):
                raise StreamError(f"target process ended after {msg.produced} of {self.expected} batches")
            if msg.item != expected:
                raise StreamError(f"stream out of order: got item {msg.item}, expected {expected}")
            aux, final = self.ring.view(msg)
            yield msg, aux, final
        end = self._next()
        if not isinstance(end, EndOfStream):
            raise StreamError(f"target process sent {type(end).__name__} after the last batch")
        self.target_io = end

    def _next(self):
        waited = 0.0
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    channel = first_ready([self.ring.ready, *self.reports.values()], self.poll_s)
                    msg = self.ring.get(timeout=0) if channel is self.ring.ready else channel.get(timeout=0)
                except queue.Empty:
                    waited += self.poll_s
                    if self.should_stop():
                        raise StreamInterrupted("stop requested while waiting for the target") from None
                    dead = self._dead_ranks()
                    if dead:
                        raise StreamError("; ".join(dead) + " and sent no error") from None
                    limit, knob = ((self.timeout_s, "train.stream_timeout_s") if self._received_any
                                   else (self.start_timeout_s, "train.engine_start_timeout_s"))
                    if waited >= limit:
                        raise StreamError(self._stalled(waited, knob)) from None
                    continue
                self._received_any = True
                if isinstance(msg, ProducerFailed):
                    time.sleep(min(self.poll_s, 1.0))  # a peer that died first is the likely cause: name it too
                    dead = self._dead_ranks(but=msg.rank)
                    also = ("\n(" + "; ".join(dead) + ")") if dead and self.spec.world_size > 1 else ""
                    name = self._describe(msg.rank) if msg.rank in self.tp_processes else f"target rank {msg.rank}"
                    raise StreamError(f"{name} failed during {msg.where}:{also}\n{msg.error}")
                return msg
        finally:
            self.wait_s += time.perf_counter() - t0

    def ids(self, msg: SlotMessage) -> torch.Tensor:
        """The token ids of a batch [N] (view into shared memory): with regeneration, prompt + answer."""
        return self.ring.view_ids(msg)

    def release(self, msg: SlotMessage) -> None:
        self.ring.release(msg)

    def depth(self) -> int:
        return self.ring.depth()

    def close(self) -> None:
        """Stop the target processes (every TP rank on this node) and anything they started (no orphans)."""
        _stop(list(self.tp_processes.values()), grace_s=30.0 if self.target_io is not None else 0.0)
        self.ring.close()
        for channel in self.reports.values():
            channel.close()
        self.reports = {}
        self.rendezvous = None  # closes the store's port
