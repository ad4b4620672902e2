"""Where specforge_k25 keeps what it builds once (embedded targets, the local Kimi tokenizer):
`$SPECFORGE_CACHE`, default `~/.cache/specforge_k25`, outside git; how each of them is built once
when several processes ask at the same time (the torchrun ranks of one run, two runs, test
sessions): `build_once`; and how files that others read (checkpoints, the serving export, cached
files) are written: atomically, with the mode any plainly created file gets under the process's
umask."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    root = os.environ.get("SPECFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specforge_k25")
    return Path(root)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only be
    read by setting it, and a file another thread creates meanwhile would get the wrong mode)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write `path` whole or not at all: `write(tmp)` writes a temporary sibling file, which is
    given the mode of a plainly created file (0o666 less the umask), flushed to disk and renamed
    into place. The mode is set explicitly because temporary files (tempfile, and safetensors'
    save_file, which writes through one) are created 0o600: a server running as another user
    (a container, a shared model store) could not read them."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


@contextmanager
def build_lock(dest: Path):
    """Hold the exclusive lock on building `dest` (fcntl.flock on `.<name>.lock` beside it). The
    kernel drops it when its holder exits, however it exits, so a killed build never blocks the next."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest.parent / f".{dest.name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_once(dest: Path, build: Callable[[Path], None],
               complete: Callable[[Path], bool] = Path.exists) -> Path:
    """`dest` (a file or a folder), built by `build(path)` unless it is already `complete`.

    One process builds while the others wait on the lock; `build` writes a fresh path beside `dest`
    that is renamed to `dest` only once written, so no process ever reads a half-written artefact.
    What a killed build left (its staging folder, an incomplete `dest`) is removed by the next one."""
    if complete(dest):
        return dest
    with build_lock(dest):
        if complete(dest):  # another process built it while this one waited
            return dest
        prefix = f".{dest.name}.build-"
        for stale in dest.parent.glob(prefix + "*"):  # the lock is ours: no live build owns these
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
        try:
            build(staging / dest.name)
            if dest.is_dir():
                shutil.rmtree(dest)
            elif dest.exists():
                dest.unlink()
            os.replace(staging / dest.name, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest
