"""One run per run folder: an advisory lock (`fcntl.flock` on `<run>/run.lock`) held by rank 0 for
the run's life, with the holder's pid, host and start time written in it. A second run into the
folder is refused naming the holder; the kernel drops the lock when its holder ends however it
ends (kill -9 included), so a lock file left by a dead run is taken over, and said so. Holding it,
a run's saves and exports may clear the temporaries they find: no other live run writes there.
flock is not shared between hosts on every network filesystem: two hosts sharing a folder rely
on different train.out_dir."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = "run.lock"


class RunFolderLocked(ValueError):
    """Another live run holds the run folder."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.previous: dict | None = None  # what a lock file left by an ended run said

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('started')}"
                   if holder else "a process that has not written its name yet")
            raise RunFolderLocked(f"train.out_dir={self.path.parent} is in use by another run ({who}; lock "
                                  f"{self.path}): wait for it to end, or choose another train.out_dir") from None
        self.previous = _read(fd) or None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def takeover_note(self) -> str | None:
        """A line saying whose ended run left the lock file this run took over, if any."""
        p = self.previous
        return (f"note: took over {self.path} left by pid {p.get('pid')} on host {p.get('host')} (no longer "
                f"running)" if p else None)

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # emptied: a file that still names a holder was left by a run that died
            os.close(self.fd)  # drops the lock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def lock_default_folder(folder: str | Path) -> tuple[RunLock, str]:
    """The lock on Hydra's default run folder (outputs/<date>/<time>, to the second), taken before
    the run prepares: a second run started in the same second did not choose that folder, so it
    runs in `<folder>-<pid>` instead of being refused."""
    try:
        return RunLock(Path(folder)).acquire(), str(folder)
    except RunFolderLocked:
        other = f"{folder}-{os.getpid()}"
        return RunLock(Path(other)).acquire(), other


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
