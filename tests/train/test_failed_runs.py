"""Runs that go wrong end as failures, never as successes (docs/RELIABILITY.md): a diverged run
stops and exports nothing, a second run into a locked folder is refused, a damaged newest
checkpoint is skipped for the intact one before it, a full disk ends with the resume line and
no partial folder. The training loop of test_trainer.py over its stand-in stream, no engine."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import specforge_k25.draft.export_folder as export_mod
import specforge_k25.train.checkpoint as ckpt_mod
from specforge_k25.train.checkpoint import WriteFailed, list_checkpoints
from specforge_k25.train.distributed import Ranks
from specforge_k25.train.finite import NonFiniteError
from specforge_k25.train.manifest import manifest_problems
from specforge_k25.train.run_lock import RunFolderLocked, RunLock, lock_default_folder
from specforge_k25.train.trainer import Trainer
from test_trainer import FakeStream, _job, _run, tiny_setup  # noqa: F401 (tiny_setup: the module's fixture)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.learner.draft.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def full_run(tiny_setup, tmp_path_factory):  # noqa: F811
    """The uninterrupted run (3 optimizer steps, grad_accum 2): weights and the batches it asked for."""
    trainer, batches = _run(_job(tmp_path_factory.mktemp("full")), tiny_setup)
    assert trainer.progress.step == 3
    return _weights(trainer), batches


# ------------------------------------------------------------------------------ 1. divergence
def test_a_diverged_run_stops_at_the_step_naming_the_last_good_checkpoint_and_exports_nothing(
        tiny_setup, tmp_path):  # noqa: F811
    job = _job(tmp_path, lr=1e30, grad_accum=1, checkpoint_every=1)  # 6 steps; the weights blow up after the first
    trainer = Trainer(job, tiny_setup, tmp_path, Ranks(), lambda job_, setup_, samples, batches: FakeStream(samples, batches))
    with pytest.raises(NonFiniteError) as err:
        trainer.run()
    message = str(err.value)
    step = trainer.progress.step
    assert f"training diverged at optimizer step {step}:" in message and step < 6, message
    saved = list_checkpoints(tmp_path)
    assert saved and int(saved[-1].name.rsplit("_", 1)[1]) < step  # written before the step that diverged
    assert f"last good checkpoint: {saved[-1]}" in message and "nothing was exported" in message
    for path in saved:  # nothing non-finite was ever written
        tensors = {**load_file(path / "draft.safetensors"), **load_file(path / "optimizer.safetensors")}
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()), path
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.tmp").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["export"] is None
    assert summary["last_good_checkpoint"] == str(saved[-1])


def test_non_finite_tensors_are_never_published_or_checkpointed(tmp_path):
    tensors = {"fc.weight": torch.ones(2, 2), "norm.weight": torch.tensor([1.0, float("inf")])}
    with pytest.raises(ValueError, match=r"1 of 2 tensors hold NaN or inf \(norm.weight\)"):
        export_mod.publish_folder(tmp_path / "export", tensors, {}, lambda folder: None)
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(NonFiniteError, match="norm.weight"):
        ckpt_mod.save_checkpoint(tmp_path, 1, tensors, {"state": {}, "param_groups": []}, {}, {})
    assert list(tmp_path.rglob("*.safetensors")) == []


# ------------------------------------------------------------------------------------ 2. lock
def test_a_second_run_into_a_locked_folder_is_refused_while_the_first_finishes_untouched(
        tiny_setup, tmp_path, full_run):  # noqa: F811
    refusals = []

    class SecondRunMidway(FakeStream):
        def __iter__(self):
            for n, item in enumerate(super().__iter__()):
                if n == 3:  # the first run is mid-way: a second run into its folder
                    before = sorted(p.name for p in tmp_path.rglob("*"))
                    second = Trainer(_job(tmp_path, seed=1), tiny_setup, tmp_path, Ranks(),
                                     lambda job_, setup_, samples, batches: FakeStream(samples, batches))
                    with pytest.raises(RunFolderLocked) as err:
                        second.run()
                    refusals.append(str(err.value))
                    assert sorted(p.name for p in tmp_path.rglob("*")) == before
                yield item

    first = Trainer(_job(tmp_path), tiny_setup, tmp_path, Ranks(),
                    lambda job_, setup_, samples, batches: SecondRunMidway(samples, batches))
    first.run()
    (message,) = refusals
    assert f"train.out_dir={tmp_path} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in message
    _assert_same(_weights(first), full_run[0])  # the first run, untouched
    assert (tmp_path / "run.lock").read_text() == ""  # released at its end


def test_a_lock_left_by_a_killed_run_is_taken_over_and_a_live_one_refuses(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys; from specforge_k25.train.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); sys.stdin.read()"), str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderLocked, match=f"pid {holder.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    lock = RunLock(tmp_path).acquire()  # the kernel dropped the dead holder's lock; its file still names it
    try:
        assert f"left by pid {holder.pid} on host" in lock.takeover_note()
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    with RunLock(tmp_path) as again:  # a lock released cleanly leaves nothing to take over
        assert again.takeover_note() is None


def test_a_run_into_hydras_default_folder_held_by_another_gets_a_folder_of_its_own(tmp_path):
    """Hydra's default folder is a timestamp to the second: a run started in the same second as
    another did not choose it, so it runs beside it instead of being refused."""
    folder = tmp_path / "outputs" / "12-00-00"
    with RunLock(folder):
        lock, got = lock_default_folder(folder)
        lock.release()
    assert got == f"{folder}-{os.getpid()}"
    lock, got = lock_default_folder(folder)
    lock.release()
    assert got == str(folder)


# ------------------------------------------------------------------------------ 3. manifests
def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _scribble(path):  # same size, other bytes, in the middle of the tensors
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(255 - b for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _scribble], ids=["truncated", "same_size"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one_and_the_run_ends_as_uninterrupted(
        tiny_setup, tmp_path, full_run, damage, capsys):  # noqa: F811
    full_weights, full_batches = full_run
    broken, _ = _run(_job(tmp_path, checkpoint_every=1), tiny_setup, fail_at=6)  # saves steps 1, 2; dies in step 3
    step1, step2 = list_checkpoints(tmp_path)
    damage(step2 / "draft.safetensors")
    capsys.readouterr()
    resumed, batches = _run(_job(tmp_path, resume="auto"), tiny_setup)
    out = capsys.readouterr().out
    assert f"resume: skipped {step2}: {step2 / 'draft.safetensors'}" in out, out
    assert f"resuming from {step1} at optimizer step 1" in out
    assert batches == full_batches[3:]  # step 1 ended after item 2 (an eval, two micro-batches)
    _assert_same(_weights(resumed), full_weights)


def test_a_named_damaged_checkpoint_is_refused_with_the_file_and_the_way_on(tiny_setup, tmp_path):  # noqa: F811
    _run(_job(tmp_path, checkpoint_every=1, max_steps=1), tiny_setup)
    (path,) = list_checkpoints(tmp_path)
    assert manifest_problems(path) == []
    _scribble(path / "optimizer.safetensors")
    trainer = Trainer(_job(tmp_path, resume=str(path), max_steps=1), tiny_setup, tmp_path, Ranks(),
                      lambda job_, setup_, samples, batches: FakeStream(samples, batches))
    with pytest.raises(ValueError) as err:
        trainer.run()
    assert str(err.value) == (f"train.resume={path} is damaged: {path / 'optimizer.safetensors'} does not match its "
                              f"manifest's SHA-256 (damaged) (train.resume=auto resumes from the newest intact "
                              f"checkpoint of its run)")


def test_a_checkpoint_without_a_manifest_resumes_with_a_note(tiny_setup, tmp_path, capsys):  # noqa: F811
    _run(_job(tmp_path, checkpoint_every=1, max_steps=1), tiny_setup)
    (path,) = list_checkpoints(tmp_path)
    (path / "manifest.json").unlink()  # as checkpoints were written before manifests
    _run(_job(tmp_path, resume="auto", max_steps=1), tiny_setup)
    assert f"resume: {path} has no manifest (written before checkpoints carried one): not verified" in capsys.readouterr().out


# ------------------------------------------------------------------------------ 4. full disk
def _disk_full_at(monkeypatch, module, call: int):
    real, calls = module.save_file, []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "save_file", save_file)


@pytest.mark.parametrize("where", ["checkpoint", "export"])
def test_a_full_disk_at_a_save_or_the_export_ends_with_the_resume_line_and_no_partial_folder(
        tiny_setup, tmp_path, monkeypatch, where):  # noqa: F811
    if where == "checkpoint":  # the second periodic checkpoint's optimizer file
        _disk_full_at(monkeypatch, ckpt_mod, 4)
    else:
        _disk_full_at(monkeypatch, export_mod, 1)
    trainer = Trainer(_job(tmp_path, checkpoint_every=1), tiny_setup, tmp_path, Ranks(),
                      lambda job_, setup_, samples, batches: FakeStream(samples, batches))
    with pytest.raises(WriteFailed) as err:
        trainer.run()
    newest = list_checkpoints(tmp_path)[-1]
    assert newest.name == ("step_00000001" if where == "checkpoint" else "step_00000003")
    assert str(err.value).endswith(f"No space left on device\nprogress saved: {newest} (resume with "
                                   f"train.resume=auto train.out_dir={tmp_path})"), str(err.value)
    leftovers = [p.name for p in [*tmp_path.iterdir(), *(tmp_path / "checkpoints").iterdir()] if "tmp" in p.name]
    assert leftovers == [] and not (tmp_path / "export").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
