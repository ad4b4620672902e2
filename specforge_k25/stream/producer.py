"""The target process: runs the frozen target over a fixed list of batches and streams the
hidden states into a `SlotRing`. The trainer side (`TargetStream`) starts it, iterates the
batches, and notices within `poll_s` + `timeout_s` if the process dies or stalls.

Tensor parallelism (tp_size > 1): one process per TP rank, as SGLang's own one_batch benchmark
runs them. TP rank 0 (`_producer_main`) walks the batches and broadcasts each batch's token ids to
the other ranks (`_tp_rank_main`), which run the same forward (or, regenerating, the same decoding
of a group of prompts) and discard its output; only rank 0 writes into the ring. The TP group may span nodes (SGLang's nnodes / node_rank / dist_init_addr):
the trainer's node starts its local ranks here, every other node runs only its own ranks
(`run_tp_node`, `python -m specforge_k25.train.tp_node`).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections import Counter

import psutil
import torch

from ..target.factory import TargetSpec, build_target, check_tp_layout
from .ring import EndOfStream, ProducerFailed, SlotMessage, SlotRing


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the trainer dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _producer_main(spec: TargetSpec, tokens: torch.Tensor, offsets: torch.Tensor, batches: list, ring: SlotRing,
                   parent_pid: int):
    """Entry point of the target process (TP rank 0). tokens: all sequences concatenated; offsets [N+1]."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the trainer decides
    torch.set_num_threads(spec.num_threads)
    stage = "engine start"
    try:
        target = build_target(spec, tp_rank=0)
        torch.set_num_threads(spec.num_threads)
        pool = target.max_total_tokens  # SGLang sizes its KV pool from free memory at start
        largest = max((sum(_room(spec, int(offsets[i + 1] - offsets[i])) for i in b) for b in batches), default=0)
        if pool is not None and largest > pool:
            raise ValueError(f"the largest batch has {largest} tokens but the engine's KV pool holds {pool}: "
                             f"lower train.batch_size or data.max_length, or raise hw.mem_fraction_static")
        stage = "engine warmup"
        target.warmup()
        io = psutil.Process().io_counters
        ready_bytes = io().write_bytes
        ahead = _Regenerated(target, spec, tokens, offsets, batches, pool) if spec.regeneration is not None else None
        for item, batch in enumerate(batches):
            stage = f"target forward of batch {item}"
            seqs = [tokens[offsets[i]:offsets[i + 1]] for i in batch]
            ids = prompt_lengths = None
            if ahead is not None:
                stage = f"regeneration up to batch {item}"
                seqs, prompt_lengths = ahead.take(item)
                ids = torch.cat(seqs)
                stage = f"target forward of batch {item}"
            if spec.tp_size > 1:
                target.share_batch([FORWARD, *seqs])  # the other TP ranks run the same forward
            out = target.forward(seqs)
            ring.put(item, out.aux_hidden, out.final_hidden, out.lengths, ids, prompt_lengths)
        if spec.tp_size > 1:
            stage = "end of the batches (telling the other TP ranks)"
            target.share_batch(None)
        target.close()
        ring.ready.put(EndOfStream(len(batches), ready_bytes, io().write_bytes - ready_bytes))
    except BaseException as err:  # report, never hang the trainer
        ring.ready.put(ProducerFailed(stage, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise


def _room(spec: TargetSpec, length: int) -> int:
    """Tokens a sequence of `length` occupies in the engine and the ring (its answer included)."""
    return length + (spec.regeneration.budget(length) if spec.regeneration is not None else 0)


# what TP rank 0 broadcasts ahead of the sequences, so the other ranks take the same step
FORWARD, GENERATE = torch.tensor([0]), torch.tensor([1])


class _Regenerated:
    """TP rank 0's answers, generated ahead of the forwards in groups of up to
    regeneration.group_sequences prompts (decoding a batch of prompts costs about as much per step
    as decoding one), each group within the engine's KV pool. A conversation used again later (a
    held-out sample at every evaluation) is kept for that use while the kept ones stay under
    KEEP_TOKENS, else regenerated (identically: seeded). Memory stays bounded."""

    KEEP_TOKENS = 1 << 20

    def __init__(self, target, spec: TargetSpec, tokens: torch.Tensor, offsets: torch.Tensor, batches: list,
                 pool: int | None):
        self.target, self.spec, self.batches, self.pool = target, spec, batches, pool
        self.prompt = lambda i: tokens[offsets[i]:offsets[i + 1]]
        self.ready: dict[int, torch.Tensor] = {}  # sample -> its conversation, until its last use
        self.uses = Counter(i for batch in batches for i in batch)
        self.kept: set[int] = set()  # used again later, kept meanwhile
        self.kept_tokens = 0

    def take(self, item: int) -> tuple[list[torch.Tensor], list[int]]:
        """Batch `item`'s conversations (prompt + answer) and prompt lengths."""
        batch = self.batches[item]
        if any(i not in self.ready for i in batch):
            self._generate_from(item)
        conversations = [self.ready[i] for i in batch]
        for i in batch:
            self.uses[i] -= 1
            if self.uses[i] > 0 and (i in self.kept or self.kept_tokens + len(self.ready[i]) <= self.KEEP_TOKENS):
                if i not in self.kept:
                    self.kept.add(i)
                    self.kept_tokens += len(self.ready[i])
                continue
            conversation = self.ready.pop(i)
            if i in self.kept:
                self.kept.discard(i)
                self.kept_tokens -= len(conversation)
        return conversations, [len(self.prompt(i)) for i in batch]

    def _generate_from(self, first: int) -> None:
        regen = self.spec.regeneration
        wanted, room = [], 0
        for item in range(first, len(self.batches)):
            need = [i for i in dict.fromkeys(self.batches[item]) if i not in self.ready and i not in wanted]
            need_room = sum(len(self.prompt(i)) + regen.budget(len(self.prompt(i))) for i in need)
            if wanted and (len(wanted) + len(need) > regen.group_sequences
                           or (self.pool is not None and room + need_room > self.pool)):
                break
            wanted += need
            room += need_room
        prompts = [self.prompt(i) for i in wanted]
        if self.spec.tp_size > 1:
            self.target.share_batch([GENERATE, *prompts])
        self.ready.update(zip(wanted, _regenerate(self.target, prompts, regen)))


def _regenerate(target, prompts: list[torch.Tensor], regen) -> list[torch.Tensor]:
    """prompt + the target's own answer, per sequence. The answer is generated first, then the
    whole conversation is prefilled as any training batch is: its hidden states are exactly those of
    a plain prefill of the same ids (capturing during decoding would give the decode kernels'
    numbers instead; docs/PERFORMANCE.md measures both)."""
    answers = target.generate(prompts, [regen.budget(len(p)) for p in prompts], regen)
    return [torch.cat([p, torch.tensor(a, dtype=p.dtype)]) for p, a in zip(prompts, answers)]


def _tp_rank_main(spec: TargetSpec, tp_rank: int, report, parent_pid: int):
    """Entry point of a TP rank other than 0: the same engine start, warm-up and forwards as rank 0,
    batch by batch as rank 0 broadcasts them, until rank 0 says the batches are done. Its outputs are
    dropped (rank 0 holds the full hidden states). A failure goes to `report` (the trainer's ready
    queue on the trainer's node; None elsewhere: the traceback and exit code tell)."""
    _die_with_parent()
    if os.getppid() != parent_pid:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    stage = "engine start"
    try:
        target = build_target(spec, tp_rank=tp_rank)
        torch.set_num_threads(spec.num_threads)
        stage = "engine warmup"
        target.warmup()
        item = 0
        while True:
            stage = f"target step {item}"
            message = target.share_batch(None)
            if message is None:
                break
            op, seqs = message[0], message[1:]
            if torch.equal(op, GENERATE):  # every TP rank decodes in step with rank 0 (same tokens drawn)
                _regenerate(target, seqs, spec.regeneration)
            else:
                target.forward(seqs)
            item += 1
        target.close()
    except BaseException as err:
        if report is not None:
            report.put(ProducerFailed(stage, f"{type(err).__name__}: {err}\n{traceback.format_exc()}", rank=tp_rank))
        raise


class Rendezvous:
    """Where the TP ranks of a one-node target meet: a TCPStore this (the trainer's) process serves,
    bound to a port the kernel picks (port 0) and kept until the ranks are gone. Picking a free port,
    releasing it and letting rank 0 bind it would race with any other process; a store that is
    already listening cannot be taken. The ranks reach it through torch's env:// rendezvous as
    clients (TORCHELASTIC_USE_AGENT_STORE), and SGLang 0.5.23 uses env:// when
    SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE says so (distributed/bootstrap.py _resolve_dist_init_method)."""

    def __init__(self, timeout_s: float):
        import datetime

        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))

    def env(self) -> dict[str, str]:
        """What a rank's environment needs to join (set in the parent around process start)."""
        return {"SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": "env://", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _start_quietly(process, env: dict[str, str] | None = None) -> None:
    """Start a target process with PYTHONDONTWRITEBYTECODE (it writes nothing to disk, not even
    bytecode caches, so its I/O counter measures hidden-state bytes on disk: expected 0) and `env`
    added to the environment it inherits."""
    added = {"PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    previous = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        process.start()
    finally:
        for k, v in previous.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _stop(processes) -> None:
    """Terminate processes and anything they started (no orphans)."""
    children = []
    for process in processes:
        if process.is_alive():
            try:
                children += psutil.Process(process.pid).children(recursive=True)
            except psutil.Error:
                pass
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
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
    processes = [ctx.Process(target=_tp_rank_main, args=(spec, r, None, os.getpid()), name=f"specforge-target-tp{r}",
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
        for msg, aux, final in stream:   # aux [N, 3Ht], final [N, Ht] views into shared memory
            ...use them...
            stream.release(msg)          # hand the slot back (do this as early as possible)
    """

    def __init__(self, spec: TargetSpec, sequences: list[torch.Tensor], batches: list[list[int]], *,
                 hidden_size: int, slots: int = 3, timeout_s: float = 600.0, start_timeout_s: float = 3600.0,
                 poll_s: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.spec, self.batches, self.poll_s = spec, batches, poll_s
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s  # between batches / until the first
        self._received_any = False
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.tokens = torch.cat(sequences) if sequences else torch.zeros(0, dtype=torch.int64)
        room = [_room(spec, int(n)) for n in lengths]  # regeneration: prompt + its answer budget
        max_tokens = max((sum(room[i] for i in b) for b in batches), default=1)
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.ring = SlotRing(self.ctx, slots, max_tokens, hidden_size, dtype, device)
        self.process = None  # TP rank 0: the one that fills the ring
        self.tp_processes: dict[int, object] = {}  # every TP rank started on this node, rank 0 included
        self.wait_s = 0.0  # trainer time spent waiting for the target
        self.target_io: EndOfStream | None = None  # the target's own write counters, sent at its end
        self.should_stop = lambda: False  # polled while waiting; True -> StreamInterrupted
        self.rendezvous: Rendezvous | None = None  # one-node TP > 1: where the ranks meet

    def start(self) -> "TargetStream":
        """Start this node's TP ranks: rank 0 (fills the ring) and, with tp_size > 1, the others."""
        spec = self.spec
        check_tp_layout(spec)
        ranks = spec.local_tp_ranks()
        if 0 not in ranks:
            raise ValueError(f"target node rank {spec.node_rank} does not hold TP rank 0: the trainer runs on "
                             f"node 0; this node runs `python -m specforge_k25.train.tp_node` instead")
        env = None
        if spec.tp_size > 1 and spec.nnodes == 1:  # several nodes meet at hw.target_dist_init_addr instead
            self.rendezvous = Rendezvous(self.start_timeout_s)
            env = self.rendezvous.env()
        for rank in ranks:
            if rank == 0:
                process = self.ctx.Process(
                    target=_producer_main, args=(spec, self.tokens, self.offsets, self.batches, self.ring, os.getpid()),
                    name="specforge-target", daemon=True)
                self.process = process
            else:
                process = self.ctx.Process(target=_tp_rank_main, args=(spec, rank, self.ring.ready, os.getpid()),
                                           name=f"specforge-target-tp{rank}", daemon=True)
            self.tp_processes[rank] = process
            _start_quietly(process, env)
        return self

    def _describe(self, rank: int) -> str:
        process = self.tp_processes[rank]
        tp = f"TP rank {rank} of {self.spec.tp_size}, " if self.spec.tp_size > 1 else ""
        return f"target process {process.name} ({tp}pid {process.pid})"

    def _dead_ranks(self) -> list[str]:
        """Ranks that are gone before their time: rank 0 ends only after its end message, the others
        end with exit code 0 once rank 0 has told them the batches are done."""
        return [f"{self._describe(rank)} died with exit code {p.exitcode}"
                for rank, p in self.tp_processes.items() if not p.is_alive() and (rank == 0 or p.exitcode != 0)]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        for expected in range(len(self.batches)):
            msg = self._next()
            if isinstance(msg, EndOfStream):
                raise StreamError(f"target process ended after {msg.produced} of {len(self.batches)} batches")
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
                    msg = self.ring.get(timeout=self.poll_s)
                except Exception:  # queue.Empty
                    waited += self.poll_s
                    if self.should_stop():
                        raise StreamInterrupted("stop requested while waiting for the target") from None
                    dead = self._dead_ranks()
                    if dead:
                        raise StreamError("; ".join(dead) + " and sent no error") from None
                    limit, knob = ((self.timeout_s, "train.stream_timeout_s") if self._received_any
                                   else (self.start_timeout_s, "train.engine_start_timeout_s"))
                    if waited >= limit:
                        raise StreamError(
                            f"{self._describe(0)} produced nothing for {waited:.0f} s ({knob})"
                        ) from None
                    continue
                self._received_any = True
                if isinstance(msg, ProducerFailed):
                    time.sleep(min(self.poll_s, 1.0))  # a peer that died first is the likely cause: name it too
                    dead = [d for d in self._dead_ranks() if f"TP rank {msg.rank} " not in d]
                    also = ("\n(" + "; ".join(dead) + ")") if dead and self.spec.tp_size > 1 else ""
                    name = self._describe(msg.rank) if msg.rank in self.tp_processes else f"target TP rank {msg.rank}"
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
        _stop(list(self.tp_processes.values()))
        self.rendezvous = None  # closes the store's port
