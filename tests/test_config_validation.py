"""Every size, count, interval and timeout is checked when the config is composed, before any
process starts, and a bad one is refused naming the field (a zero stream_slots used to block the
producer for engine_start_timeout_s; a zero log_every or grad_accum divided by zero after the engine
had started; a zero batch_size was a traceback inside the plan)."""
from __future__ import annotations

import dataclasses
from dataclasses import fields, is_dataclass

import pytest

from specforge_k25.config import EvalJobConfig, compose_job

# numeric fields with no bound: seeds (any integer is one)
UNBOUNDED = {"data.seed", "data.regen_seed", "train.seed", "eval.untrained_seed"}


def _numeric_fields(cls=EvalJobConfig, prefix: str = ""):
    """(dotted name, dataclass field) of every int / float field, nested configs walked."""
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            yield from _numeric_fields(type(default), prefix + f.name + ".")
        elif isinstance(f.type, str) and any(t in f.type for t in ("int", "float")) and f.type != "bool":
            yield prefix + f.name, f


NUMERIC = dict(_numeric_fields())


def _with(name: str, value) -> EvalJobConfig:
    """The default eval job (the training tree plus eval) with one field set: built as OmegaConf
    builds it, so the check runs as at composition."""
    group, key = name.split(".")
    job = EvalJobConfig()
    return dataclasses.replace(job, **{group: dataclasses.replace(getattr(job, group), **{key: value})})


def test_every_numeric_field_has_a_bound_or_is_a_seed():
    unbounded = {n for n, f in NUMERIC.items() if "at_least" not in f.metadata and "above" not in f.metadata}
    assert unbounded == UNBOUNDED


@pytest.mark.parametrize("name", sorted(set(NUMERIC) - UNBOUNDED))
def test_a_value_below_the_bound_is_refused_by_name_and_the_bound_itself_accepted(name):
    meta = NUMERIC[name].metadata
    if "at_least" in meta:
        low, bad = meta["at_least"], meta["at_least"] - 1
        expected = f"{name} must be >= {low} (got {bad})"
    else:
        low, bad = meta["above"] + 0.5, meta["above"]
        expected = f"{name} must be > {meta['above']} (got {bad})"
    with pytest.raises(ValueError, match="invalid configuration") as err:
        _with(name, bad)
    assert expected in str(err.value)
    assert [line for line in str(err.value).splitlines()[1:]] == [f"  {expected}: {meta['help']}"]  # only it
    _with(name, low)  # the bound itself passes


@pytest.mark.parametrize("override", ["train.stream_slots=0", "train.log_every=0", "train.grad_accum=0",
                                      "draft.ttt_length=0", "train.teacher_chunk=0", "train.batch_size=0",
                                      "train.checkpoint_every=-1", "train.eval_every=0", "train.keep_checkpoints=0",
                                      "train.stream_timeout_s=0", "draft=dflash draft.logits_chunk=0", "hw.target_tp=0"])
def test_composition_refuses_the_override_naming_it(override):
    *group, override = override.split()
    name, value = override.split("=")
    with pytest.raises(ValueError, match=rf"{name} must be >?=? ?-?\d.* \(got {value}(\.0)?\)"):
        compose_job([*group, override])


def test_several_bad_fields_are_all_named_and_null_stays_allowed():
    with pytest.raises(ValueError) as err:
        compose_job(["train.log_every=0", "train.grad_accum=0"])
    assert "train.log_every must be >= 1 (got 0)" in str(err.value)
    assert "train.grad_accum must be >= 1 (got 0)" in str(err.value)
    job = compose_job(["train.checkpoint_every=null", "train.eval_every=null", "train.max_steps=null"])
    assert (job.train.checkpoint_every, job.train.eval_every, job.train.max_steps) == (None, None, None)
    assert compose_job(["train.checkpoint_every=0"]).train.checkpoint_every == 0  # end only, as null


def test_the_plan_refuses_a_zero_batch_size_by_name(capsys):
    from specforge_k25.plan.__main__ import main

    assert main(["train.batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "refused: invalid configuration" in err and "train.batch_size must be >= 1 (got 0)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("override", ["eval.dflash_blocks=[4]", "+eval.dflash_blocks=[4]"])
def test_a_moved_key_is_refused_naming_its_new_home(override):
    from specforge_k25.config import MOVED_KEYS

    with pytest.raises(ValueError, match=r"eval\.dflash_blocks is no longer a config key; use eval\.chains"):
        compose_job([override], config_name="eval")
    for key in MOVED_KEYS:  # a moved key is really gone, so the check is not hiding a live one
        group, name = key.split(".")
        assert name not in {f.name for f in fields(type(getattr(EvalJobConfig(), group)))}


def test_the_eval_cli_names_the_moved_key_before_composing():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specforge_k25.eval", "eval.dflash_blocks=[4]"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "use eval.chains" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("override,new_home", [("draft.method=dflash", "the draft config group"),
                                               ("train.ttt_length=3", "draft.ttt_length"),
                                               ("train.loss_decay=0.5", "draft.loss_decay")])
def test_an_override_of_a_knob_that_moved_to_the_method_names_its_new_home(override, new_home):
    with pytest.raises(ValueError, match=rf"{override.split('=')[0]} is no longer a config key; use {new_home}"):
        compose_job([override])


def test_the_draft_group_selects_each_methods_own_config():
    """`draft=<method>` is that method's config at its defaults (one home: its dataclass); the
    profiles override fields of one method; a field another method lacks is refused at composition."""
    from specforge_k25.config import describe
    from specforge_k25.draft.registry import METHODS, method_of_spec

    for name, method in METHODS.items():
        job = compose_job([f"draft={name}"])
        assert type(job.draft) is method.spec_class and method_of_spec(job.draft) is method
        assert job.draft == method.spec_class()  # no YAML repeats a default
    profiles = {"small": ("eagle3", {"vocab_size": 4096, "ttt_length": 3}),
                "kimi": ("eagle3", {"intermediate_size": 18432, "num_attention_heads": 56, "num_key_value_heads": 8,
                                    "head_dim": 128}),
                "kimi_mla": ("eagle3_mla", {"intermediate_size": 18432, "num_attention_heads": 56, "head_dim": 128}),
                "kimi_dflash": ("dflash", {"num_layers": 6, "intermediate_size": 18432, "num_attention_heads": 56,
                                           "num_key_value_heads": 8, "head_dim": 128, "logits_chunk": 256})}
    for profile, (name, values) in profiles.items():
        spec = compose_job([f"draft={profile}"]).draft
        assert spec == METHODS[name].spec_class(**values), profile
    assert compose_job([]).draft == compose_job(["draft=small"]).draft  # the CPU default
    with pytest.raises(Exception, match="draft.ttt_length"):
        compose_job(["draft=dflash", "draft.ttt_length=3"])  # an EAGLE-3 knob: not DFlash's
    lines = describe()
    for method in METHODS.values():  # --help: each method's fields under the option that selects it
        at = lines.index(next(line for line in lines if line.startswith(f"draft={method.name}:")))
        own = [line.split()[0] for line in lines[at + 1: at + 1 + len(fields(method.spec_class))]]
        assert own == [f"draft.{f.name}" for f in fields(method.spec_class)]
