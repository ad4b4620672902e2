"""One-way message channels between the trainer and its target processes, over a pipe.

A multiprocessing Queue holds three named POSIX semaphores (/dev/shm/sem.mp-*) that only a clean
interpreter exit or Python's resource tracker unlinks; `kill -9` of a run's whole process group
(Slurm's escalation after its grace period) kills both, and every ring left six in /dev/shm. Each
channel here has one writing and one reading process, so it needs no lock: a pipe carries the
pickled messages and nothing named is created. Messages are small (slot numbers, lengths, an error's
traceback), so a writer never waits long on the pipe's buffer.
"""
from __future__ import annotations

import queue
from multiprocessing.connection import wait


class Channel:
    """One writer process (`put`), one reader process (`get`); picklable into a spawned process."""

    def __init__(self, ctx):
        self._reader, self._writer = ctx.Pipe(duplex=False)

    def put(self, message) -> None:
        self._writer.send(message)

    def get(self, timeout: float | None = None):
        """The next message; raises queue.Empty when none arrives within `timeout` seconds (None: wait)."""
        if not self._reader.poll(timeout):
            raise queue.Empty
        return self._reader.recv()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


def first_ready(channels: list[Channel], timeout: float) -> Channel:
    """The first of `channels` (in their order) holding a message, waiting up to `timeout` seconds
    for any of them; raises queue.Empty when none has one."""
    ready = {id(r) for r in wait([c._reader for c in channels], timeout)}
    for channel in channels:
        if id(channel._reader) in ready:
            return channel
    raise queue.Empty


def bars_with_a_thread_lock() -> None:
    """tqdm guards its bars with a multiprocessing RLock by default: a named POSIX semaphore the
    first bar of a process creates (SGLang's weight loading in a target process, tokenizing in the
    trainer), left in /dev/shm by the same `kill -9` of the process group. The bars of one process
    need only a thread lock."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
