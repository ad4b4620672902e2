"""A training run whose target is two SGLang pipeline stages (hw.target_pp=2, tiny DeepSeek, CLI):
a killed stage is named with progress saved, the resumed run finishes, and every step's loss
equals the one-process target's run, bit for bit (the stages run the same kernels on the same
layers and hand the residual stream over exactly). Layout rules refuse what does not run yet."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from specforge_k25.config import HwConfig
from specforge_k25.setup.layout import World, check_layout

from test_reliability import BASE, _env, _losses, _steps_logged, _wait_for


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specforge_k25.train", *BASE, f"train.out_dir={run_dir}",
            f"hydra.run.dir={run_dir / 'hydra'}", *extra]


def test_pipeline_layout_rules():
    check_layout(HwConfig(target_pp=2), World())
    check_layout(HwConfig(target_pp=2, target_tp=2, trainer_layout="colocated"), World(size=4, local_size=4))
    with pytest.raises(ValueError, match=r"1 replica\(s\) x TP 2 x 2 stages = 4 trainer ranks"):
        check_layout(HwConfig(target_pp=2, target_tp=2, trainer_layout="colocated"), World(size=2, local_size=2))
    with pytest.raises(ValueError, match="one replica"):
        check_layout(HwConfig(target_pp=2, target_replicas=2), World(size=2, local_size=2))
    with pytest.raises(ValueError, match="at least one pipeline stage"):
        check_layout(HwConfig(target_pp=0), World())


def test_pipeline_refuses_regeneration():
    from specforge_k25.config import compose_job
    from specforge_k25.setup.target import target_spec

    job = compose_job(["target=tiny_deepseek", "hw.target_pp=2", "data.regenerate=true"])
    with pytest.raises(ValueError, match="pipeline-parallel target does not decode yet"):
        target_spec(job)


@pytest.mark.engine
@pytest.mark.e2e
def test_pipeline_target_run_killed_stage_resume_equals_one_stage(tmp_path, base_reference_run):
    run_dir = tmp_path / "pp"
    ref_losses = _losses(base_reference_run)
    assert sorted(ref_losses) == list(range(1, 9))

    pp = ["hw.target_pp=2", "train.stream_timeout_s=30"]
    proc = subprocess.Popen(_cmd(run_dir, *pp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    _wait_for(lambda: _steps_logged(run_dir) >= 3, proc)  # past the step-2 checkpoint
    stages = sorted((c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())),
                    key=lambda c: c.pid)
    assert len(stages) == 2, [c.cmdline() for c in stages]
    stages[0].kill()  # stage 0 (started first): the last stage is left waiting for its proxies
    killed = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert time.monotonic() - killed < 30
    assert "pipeline stage 0 of 2" in err and "progress saved" in err, err[-3000:]
    assert "x 2 pipeline stages" in out  # the run plan names the layout
    gone, alive = psutil.wait_procs(stages, timeout=10)
    assert not alive, f"orphans: {[p.pid for p in alive]}"

    resumed = subprocess.run(_cmd(run_dir, *pp, "train.resume=auto"), capture_output=True, text=True, timeout=900,
                             env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):  # before the kill and after the resume alike
        assert got[step] == ref_losses[step], (step, got[step], ref_losses[step])


DFLASH = ["target=tiny_deepseek", "draft=dflash", "draft.block_size=4", "draft.num_anchors=16", "data.num_samples=8",
          "data.heldout_samples=2", "data.max_length=64", "train.batch_size=2", "train.max_steps=3",
          "train.log_every=1", "hw.target_prefill_chunk=48", "train.progress=false", "train.logger=none"]


@pytest.mark.e2e
def test_dflash_beside_two_pipeline_stages_equals_one_stage(tmp_path):
    """DFlash (its capture points spread over both stages, and the final states its distillation
    reads) trains on a two-stage target as on one process: the same loss at every step, bit for bit."""
    losses = []
    for name, extra in (("one", []), ("pp", ["hw.target_pp=2"])):
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "specforge_k25.train", *DFLASH, f"train.out_dir={run_dir}",
               f"hydra.run.dir={run_dir / 'hydra'}", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
        assert out.returncode == 0, out.stderr[-3000:]
        losses.append(_losses(run_dir))
    assert sorted(losses[0]) == [1, 2, 3] and losses[1] == losses[0], losses
