"""Where Hydra puts an eval's run folder (.hydra/ and its log): eval.output when one is given, so
an eval told where to write (as the tests do, into their temporary folders) leaves nothing in the
working directory; else outputs/eval/<date>/<time>/, beside the results it then holds."""
from __future__ import annotations

import re


def _run_dir(overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specforge_k25.config import CONF_DIR, register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="eval", overrides=overrides, return_hydra_config=True)
        return str(OmegaConf.select(cfg, "hydra.run.dir"))


def test_an_eval_with_an_output_folder_keeps_hydra_there(tmp_path):
    assert _run_dir([f"eval.output={tmp_path / 'eval'}"]) == str(tmp_path / "eval")


def test_an_eval_without_one_writes_into_a_dated_folder():
    assert re.fullmatch(r"outputs/eval/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", _run_dir([]))
