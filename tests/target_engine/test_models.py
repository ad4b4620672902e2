"""Artefacts built into the cache once, however many processes ask at the same time.

The torchrun ranks of one run all resolve the target before training (setup/run.py prepare), so
on an empty cache they all asked for the same model folder at once: each built it and renamed it
into place, removing the folder another rank was already reading ("Couldn't instantiate the
backend tokenizer" on a fresh machine). paths.build_once serialises the builds on a file lock; the
tests race several forked processes on one artefact and check that one built it and every one of
them read it whole.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from specforge_k25 import paths
from specforge_k25.target_engine import models

PROCESSES = 4
PARTS = 5


def _slow_folder(log: Path):
    """A builder that writes PARTS files slowly (as save_pretrained writes shards), logging each build."""

    def build(out: Path):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        out.mkdir(exist_ok=True)
        for i in range(PARTS):
            (out / f"part{i}.txt").write_text(f"part {i}\n" * 100)
            time.sleep(0.05)
        (out / "config.json").write_text("{}\n")

    return build


def _race(target, args, n: int = PROCESSES) -> list:
    """Run target(*args, queue) in n forked processes started together; their results."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=target, args=(*args, barrier, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def _build_model_and_read(dest: Path, log: Path, barrier, queue):
    barrier.wait()
    try:
        folder = models._build_model_once(dest, _slow_folder(log))
        time.sleep(0.3)  # a slower builder, if there were one, would now replace the folder being read
        texts = {p.name: p.read_text() for p in sorted(folder.iterdir())}
        queue.put(("ok", texts))
    except Exception as err:  # noqa: BLE001 (reported to the test process)
        queue.put(("error", repr(err)))


def test_concurrent_model_builds_build_once_and_read_whole(tmp_path):
    dest, log = tmp_path / "models" / "tiny", tmp_path / "builds.log"
    results = _race(_build_model_and_read, (dest, log))
    assert [r[0] for r in results] == ["ok"] * PROCESSES, results
    assert len(log.read_text().split()) == 1, "the folder was built by more than one process"
    expected = {f"part{i}.txt": f"part {i}\n" * 100 for i in range(PARTS)} | {"config.json": "{}\n",
                                                                               ".complete": "ok\n"}
    assert all(texts == expected for _, texts in results)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".tiny.lock", "tiny"]  # no staging left


def _build_file_and_read(dest: Path, log: Path, barrier, queue):
    def build(out: Path):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        with open(out, "w") as fh:
            for i in range(PARTS):
                fh.write(f"line {i}\n")
                fh.flush()
                time.sleep(0.05)

    barrier.wait()
    queue.put(paths.build_once(dest, build).read_text())


def test_concurrent_file_builds_build_once(tmp_path):
    """A single cached file (the local Kimi tokenizer's ranks) the same way."""
    dest, log = tmp_path / "cache" / "ranks.tiktoken", tmp_path / "builds.log"
    texts = _race(_build_file_and_read, (dest, log))
    assert texts == ["".join(f"line {i}\n" for i in range(PARTS))] * PROCESSES
    assert len(log.read_text().split()) == 1


def _kimi_tokenizer(barrier, queue):
    from specforge_k25.data import kimi_tokenizer

    barrier.wait()
    queue.put(kimi_tokenizer.build_kimi_local_tokenizer(vocab_size=300, corpus_chars=20_000).n_vocab)


def test_kimi_local_tokenizer_is_trained_once(tmp_path, monkeypatch):
    from specforge_k25.data import kimi_tokenizer

    monkeypatch.setenv("SPECFORGE_CACHE", str(tmp_path))
    log = tmp_path / "trained.log"
    real = kimi_tokenizer.train_ranks

    def counted(*args):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return real(*args)

    monkeypatch.setattr(kimi_tokenizer, "train_ranks", counted)  # inherited by the forked processes
    assert _race(_kimi_tokenizer, (), n=3) == [kimi_tokenizer.VOCAB_END] * 3
    assert len(log.read_text().split()) == 1


def test_a_killed_build_leaves_nothing_in_the_way(tmp_path):
    """A builder killed mid-build (lock held, staging folder half written) does not block or leak
    into the next build: the kernel drops its lock and the next builder removes its staging."""
    dest = tmp_path / "models" / "tiny"
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()

    def hang(out: Path):
        (out / "part0.txt").write_text("half")
        started.set()
        time.sleep(600)

    victim = ctx.Process(target=models._build_model_once, args=(dest, hang))
    victim.start()
    assert started.wait(60)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    assert list(dest.parent.glob(".tiny.build-*"))  # what it left
    log = tmp_path / "builds.log"
    assert models._build_model_once(dest, _slow_folder(log)) == dest
    assert (dest / ".complete").is_file() and not list(dest.parent.glob(".tiny.build-*"))


def test_an_incomplete_folder_is_rebuilt(tmp_path):
    dest = tmp_path / "models" / "tiny"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}\n")  # no .complete: not written by a finished build
    models._build_model_once(dest, _slow_folder(tmp_path / "builds.log"))
    assert (dest / ".complete").is_file() and (dest / "part0.txt").is_file()


def test_the_real_builder_marks_its_folder_complete(smollm2_path):
    """The real builder's output passes the completeness check the lock relies on."""
    assert models._model_complete(Path(smollm2_path))
