"""End to end: the CLI through Hydra, the real SGLang engine in its own process, the stream,
training, checkpoint and export, on the tiny DeepSeek-V3 (Kimi's code path)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specforge_k25.config import JobConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _compose(overrides):
    import specforge_k25.train.__main__  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def test_hydra_composition_and_overrides():
    job = _compose([])
    assert isinstance(job, JobConfig) and job.hw.name == "cpu" and job.target.builtin == "smollm2"
    job = _compose(["+hw=cpu", "target=tiny_deepseek", "train.lr=2e-4", "data.max_length=64"])
    assert job.target.builtin == "tiny_deepseek" and job.train.lr == 2e-4 and job.data.max_length == 64
    with pytest.raises(Exception):  # typo in a key: the structured schema rejects it
        _compose(["train.learning_rate=1e-4"])
    with pytest.raises(Exception):  # wrong type
        _compose(["draft.ttt_length=seven"])


def test_help_lists_documented_fields():
    out = subprocess.run([sys.executable, "-m", "specforge_k25.train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    assert "draft.ttt_length" in out.stdout and "TTT unroll steps" in out.stdout and "draft=dflash" in out.stdout


@pytest.mark.e2e
@pytest.mark.engine
def test_cli_trains_through_sglang_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "specforge_k25.train", "target=tiny_deepseek", "data.num_samples=12",
           "data.heldout_samples=4", "data.max_length=96", "draft.vocab_size=2048", "train.batch_size=2",
           "draft.ttt_length=3", "train.checkpoint_every=2", "train.progress=false", "train.logger=wandb",
           "train.activation_checkpointing=true",  # the RTX PRO 6000 profile's setting, through the real loop
           f"train.out_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "run plan" in out.stdout and "run summary" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["samples_trained"] == 12
    (row,) = [line for line in out.stdout.splitlines() if "padding in the trainer's batches" in line]
    assert f" {100 * summary['padding_share']:.1f}% " in row
    assert summary["tokens_trained"] > 0 and summary["tokens_per_s"] > 0
    assert summary["disk"]["hidden_state_bytes_on_disk"] == 0
    assert summary["disk"]["hidden_state_bytes_streamed_in_memory"] > 0
    for tag in ("start", "end"):
        ev = summary["eval"][tag]
        assert {"acc_0", "acc_2", "tau_sim", "alpha_0", "ploss_0"} <= set(ev) and ev["positions"] > 0
    # checkpoint kept (periodic at 2 and 4, final at 6; keep 2) and the export loads into our class
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006"]
    from specforge_k25.export.serving import load_exported_draft
    from specforge_k25.target_engine.hf_config import load_embedding_and_head

    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    embed, _ = load_embedding_and_head(summary_target_path(out.stdout))
    draft = load_exported_draft(run_dir / "export", embed)
    assert draft.cfg.draft_vocab_size == 2048 and int(draft.t2d.sum()) == 2048
    assert any((run_dir / "wandb").glob("offline-run-*"))


def summary_target_path(stdout: str) -> str:
    line = next(l for l in stdout.splitlines() if l.startswith("target "))
    return line.rsplit("(", 1)[1].rstrip(")")
