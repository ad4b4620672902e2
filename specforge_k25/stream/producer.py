"""The target process: runs the frozen target over a fixed plan of batches and streams the
hidden states into a `SlotRing`. The trainer side (`TargetStream`) starts it, iterates the
batches, and notices within `poll_s` + `timeout_s` if the process dies or stalls.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import psutil
import torch

from .ring import EndOfStream, ProducerFailed, SlotMessage, SlotRing


@dataclass
class TargetSpec:
    """Everything the target process needs to build its engine (picklable, no weights)."""

    engine: str  # "sglang" | "hf" (the HF reference, for tests and comparisons)
    model_path: str
    architecture: str
    capture_points: list
    device: str = "cpu"
    dtype: str = "float32"
    tp_size: int = 1
    gpu_id: int = 0
    max_total_tokens: int = 16384
    mem_fraction_static: float = 0.05
    num_threads: int = 1
    trust_remote_code: bool = False


def build_target(spec: TargetSpec):
    if spec.engine == "sglang":
        from ..target.sglang_engine import SGLangTarget

        return SGLangTarget(
            spec.model_path, spec.architecture, spec.capture_points, device=spec.device, dtype=spec.dtype,
            tp_size=spec.tp_size, gpu_id=spec.gpu_id, max_total_tokens=spec.max_total_tokens,
            mem_fraction_static=spec.mem_fraction_static, num_threads=spec.num_threads,
            trust_remote_code=spec.trust_remote_code,
        )
    if spec.engine == "hf":
        from ..target.hf_reference import HFTarget

        return HFTarget(spec.model_path, spec.capture_points, getattr(torch, spec.dtype))
    raise ValueError(f"target engine {spec.engine!r}: expected sglang or hf")


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the trainer dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _producer_main(spec: TargetSpec, tokens: torch.Tensor, offsets: torch.Tensor, plan: list, ring: SlotRing,
                   parent_pid: int):
    """Entry point of the target process. tokens: all sequences concatenated; offsets [N+1]."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the trainer decides
    torch.set_num_threads(spec.num_threads)
    stage = "engine start"
    try:
        target = build_target(spec)
        torch.set_num_threads(spec.num_threads)
        pool = getattr(target, "max_total_tokens", None)  # SGLang sizes its KV pool from free memory at start
        largest = max((int(sum(offsets[i + 1] - offsets[i] for i in b)) for b in plan), default=0)
        if pool is not None and largest > pool:
            raise ValueError(f"the largest batch has {largest} tokens but the engine's KV pool holds {pool}: "
                             f"lower train.batch_size or data.max_length, or raise hw.mem_fraction_static")
        stage = "engine warmup"
        target.warmup()
        io = psutil.Process().io_counters
        ready_bytes = io().write_bytes
        for item, batch in enumerate(plan):
            stage = f"target forward of plan item {item}"
            seqs = [tokens[offsets[i]:offsets[i + 1]] for i in batch]
            out = target.forward(seqs)
            ring.put(item, out.aux_hidden, out.final_hidden, out.lengths)
        target.close()
        ring.ready.put(EndOfStream(len(plan), ready_bytes, io().write_bytes - ready_bytes))
    except BaseException as err:  # report, never hang the trainer
        ring.ready.put(ProducerFailed(stage, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise


class StreamError(RuntimeError):
    """The target process failed, died or stalled."""


class StreamInterrupted(RuntimeError):
    """`should_stop()` turned true while waiting for the target (e.g. a SIGTERM flag)."""


class TargetStream:
    """Trainer-side handle: starts the target process and yields its batches in plan order.

    with TargetStream(spec, sequences, plan, ...) as stream:
        for msg, aux, final in stream:   # aux [N, 3Ht], final [N, Ht] views into shared memory
            ...use them...
            stream.release(msg)          # hand the slot back (do this as early as possible)
    """

    def __init__(self, spec: TargetSpec, sequences: list[torch.Tensor], plan: list[list[int]], *,
                 hidden_size: int, slots: int = 3, timeout_s: float = 600.0, start_timeout_s: float = 3600.0,
                 poll_s: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.spec, self.plan, self.poll_s = spec, plan, poll_s
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s  # between batches / until the first
        self._received_any = False
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.tokens = torch.cat(sequences) if sequences else torch.zeros(0, dtype=torch.int64)
        max_tokens = max((int(lengths[b].sum()) for b in plan), default=1)
        self.ctx = torch.multiprocessing.get_context("spawn")
        self.ring = SlotRing(self.ctx, slots, max_tokens, hidden_size, dtype, device)
        self.process = None
        self.wait_s = 0.0  # trainer time spent waiting for the target
        self.target_io: EndOfStream | None = None  # the target's own write counters, sent at its end
        self.should_stop = lambda: False  # polled while waiting; True -> StreamInterrupted

    def start(self) -> "TargetStream":
        self.process = self.ctx.Process(
            target=_producer_main, args=(self.spec, self.tokens, self.offsets, self.plan, self.ring, os.getpid()),
            name="specforge-target", daemon=True,
        )
        # The target process writes nothing to disk, not even bytecode caches, so its I/O
        # counter is a direct measure of hidden-state bytes on disk (expected: 0).
        previous = os.environ.get("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        try:
            self.process.start()
        finally:
            if previous is None:
                del os.environ["PYTHONDONTWRITEBYTECODE"]
            else:
                os.environ["PYTHONDONTWRITEBYTECODE"] = previous
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        for expected in range(len(self.plan)):
            msg = self._next()
            if isinstance(msg, EndOfStream):
                raise StreamError(f"target process ended after {msg.produced} of {len(self.plan)} batches")
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
                    if not self.process.is_alive():
                        raise StreamError(
                            f"target process {self.process.name} (pid {self.process.pid}) died with exit code "
                            f"{self.process.exitcode} and sent no error"
                        ) from None
                    limit, knob = ((self.timeout_s, "train.stream_timeout_s") if self._received_any
                                   else (self.start_timeout_s, "train.engine_start_timeout_s"))
                    if waited >= limit:
                        raise StreamError(
                            f"target process {self.process.name} (pid {self.process.pid}) produced nothing "
                            f"for {waited:.0f} s ({knob})"
                        ) from None
                    continue
                self._received_any = True
                if isinstance(msg, ProducerFailed):
                    raise StreamError(f"target process {self.process.name} failed during {msg.where}:\n{msg.error}")
                return msg
        finally:
            self.wait_s += time.perf_counter() - t0

    def release(self, msg: SlotMessage) -> None:
        self.ring.release(msg)

    def depth(self) -> int:
        return self.ring.depth()

    def close(self) -> None:
        """Stop the target process and anything it started (no orphans)."""
        if self.process is None or not self.process.is_alive():
            return
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        self.process.terminate()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=5)
