"""A training run on the cheap HF-transformers target (engine="hf"), for tests that launch it under
torchrun or plain python: `python tests/dp_train_worker.py RUN_DIR [group.key=value ...]`.

It calls the same `run_training` as `python -m specforge_k25.train`; only the target engine differs
(the CLI always uses SGLang).
"""
from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def main(run_dir: str, overrides: list[str]) -> None:
    import specforge_k25.train.__main__  # noqa: F401  (registers the schema)
    from specforge_k25.train.loop import run_training

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        job = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    run_training(job, run_dir, engine="hf")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
