"""Every config error is one line and exit code 2: an unknown key (`+key=value` included, which
Hydra adds and nothing reads) names the closest field; Hydra's own errors (an unknown group
option, a value of the wrong type) are reduced to one line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specforge_k25.config import JobConfig, check_moved_keys, compose_job


@pytest.mark.parametrize("override,closest", [
    ("+train.lrr=1e-3", "train.lr"), ("train.lrr=1e-3", "train.lr"), ("++data.num_sample=3", "data.num_samples"),
    ("trian.lr=1", "train.lr"), ("hw.target_tpp=2", "hw.target_tp")])
def test_an_unknown_key_is_refused_naming_the_closest_field(override, closest):
    with pytest.raises(ValueError) as err:
        check_moved_keys([override], JobConfig)
    assert f"did you mean {closest}?" in str(err.value) and "\n" not in str(err.value)


def test_known_keys_group_choices_hydras_own_and_a_dicts_keys_pass():
    check_moved_keys(["train.lr=1e-4", "+hw=cpu", "target=tiny_deepseek", "draft=dflash", "draft.block_size=4",
                      "hydra.run.dir=x", "target.kimi.default_system=null", "--cfg", "+eval.heads.mine=/x"])


def test_a_key_of_another_draft_method_than_the_composed_one_is_refused():
    with pytest.raises(ValueError, match=r"draft.block_size is not a config field of this run"):
        compose_job(["+draft.block_size=4"])  # draft=small is EAGLE-3's: block_size is DFlash's
    assert compose_job(["draft=dflash", "draft.block_size=4"]).draft.block_size == 4


def test_hydras_errors_are_one_line():
    with pytest.raises(ValueError) as err:
        compose_job(["target=no_such_target"])
    assert str(err.value) == "In 'config': Could not find 'target/no_such_target'"


def test_the_train_cli_refuses_an_appended_typo_in_one_line_with_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specforge_k25.train", "+train.lrr=1e-3", f"train.out_dir={tmp_path}",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == "error: +train.lrr is not a config field (did you mean train.lr?); --help lists every field"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_train_entry_reduces_hydras_own_error_to_one_line_and_exit_code_2(monkeypatch, capsys, tmp_path):
    from specforge_k25.config import run_hydra_main
    from specforge_k25.train.__main__ import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored after the test: run_hydra_main sets it
    monkeypatch.setattr(sys, "argv", ["specforge_k25.train", "train.lr=fast", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as code:
        run_hydra_main(main)
    assert code.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: Error merging override train.lr=fast (Value 'fast' of type "
                                               "'str' could not be converted to Float)")


def test_the_eval_cli_refuses_a_bad_value_in_one_line_with_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specforge_k25.eval", "eval.num_prompts=many",
                          f"hydra.run.dir={tmp_path / 'hydra'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == ("error: Error merging override eval.num_prompts=many (Value 'many' of type 'str' "
                                  "could not be converted to Integer)")
