"""Faults during a real run (CLI, SGLang target on the tiny DeepSeek, chunked prefill): kill -9 and resume exactly,
SIGTERM saves and leaves no processes behind, a dead engine is reported and progress saved, and a
checkpoint from another run is refused."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.e2e]

# batch 2 grouped by length (train.group_by_length), and a batch of up to 128 tokens prefilled in chunks of
# 48 (hw.target_prefill_chunk): a resume must reproduce both
BASE = ["target=tiny_deepseek", "data.num_samples=16", "data.heldout_samples=2", "data.max_length=64",
        "draft.vocab_size=1024", "train.batch_size=2", "draft.ttt_length=3", "train.log_every=1",
        "hw.target_prefill_chunk=48", "train.checkpoint_every=2", "train.progress=false", "train.logger=none"]


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specforge_k25.train", *BASE, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir / 'hydra'}", *extra]


def _env():
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def _losses(run_dir: Path) -> dict[int, float]:
    """optimizer step -> train/loss, the last record of each step wins (a resumed run re-logs)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["optimizer_step"]] = rec["train/loss"]
    return out


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(_losses(run_dir)) if path.is_file() else 0


def test_kill9_then_resume_gives_identical_losses(tmp_path, base_reference_run):
    ref_dir, run_dir = base_reference_run, tmp_path / "run"
    ref_losses = _losses(ref_dir)
    assert sorted(ref_losses) == list(range(1, 9))

    proc = subprocess.Popen(_cmd(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for(lambda: _steps_logged(run_dir) >= 5, proc)  # past the step-4 checkpoint
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(timeout=30)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert "step_00000004" in ckpts

    resumed = subprocess.run(_cmd(run_dir, "train.resume=auto"), capture_output=True, text=True, timeout=900,
                             env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "prefill in chunks of 48 tokens" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["samples_trained"] == 16
    got = _losses(run_dir)
    last_ckpt = int(summary["resumed_from"].rsplit("_", 1)[1])
    assert last_ckpt in (4, 6)
    for step in range(last_ckpt + 1, 9):  # every step after the checkpoint, recomputed after the kill
        assert got[step] == ref_losses[step], (step, got[step], ref_losses[step])  # bit-identical
    # and the final weights too
    from safetensors.torch import load_file

    a = load_file(ref_dir / "export" / "model.safetensors")
    b = load_file(run_dir / "export" / "model.safetensors")
    assert all(bool((a[k] == b[k]).all()) for k in a)


def test_sigterm_saves_and_leaves_no_processes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for(lambda: _steps_logged(run_dir) >= 1, proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the target process should be running"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM" in err and "train.resume=auto" in err
    assert any(p.name.startswith("step_") for p in (run_dir / "checkpoints").iterdir())
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans: {[p.pid for p in alive]}"


def test_killed_engine_is_reported_and_progress_saved(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "train.stream_timeout_s=30"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for(lambda: _steps_logged(run_dir) >= 1, proc)
    # the target is the spawned worker (not multiprocessing's resource tracker)
    target = next(c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline()))
    target.kill()
    killed = time.monotonic()
    proc.wait(timeout=120)
    err = proc.stderr.read()
    assert proc.returncode == 1, err[-3000:]
    assert time.monotonic() - killed < 30
    assert "specforge-target" in err and "progress saved" in err
    assert any(p.name.startswith("step_") for p in (run_dir / "checkpoints").iterdir())


def test_resume_from_a_different_draft_is_refused(tmp_path, base_reference_run):
    """A checkpoint of the reference run, resumed by a run with another draft vocabulary."""
    run_dir = tmp_path / "run"
    ckpt = sorted((base_reference_run / "checkpoints").glob("step_*"))[0]
    shutil.copytree(ckpt, run_dir / "checkpoints" / ckpt.name)
    other = subprocess.run(_cmd(run_dir, "train.resume=auto", "draft.vocab_size=512"), capture_output=True, text=True,
                           timeout=900, env=_env())
    assert other.returncode != 0
    assert "different run" in other.stderr and "draft" in other.stderr
