"""The run's setup (setup/run.py, setup/target.py): what the trainer's node and the TP-only nodes build the target from."""
from __future__ import annotations

import pytest

from specforge_k25.config import compose_job
from specforge_k25.setup.target import target_spec
from specforge_k25.target_engine import factory


class _Recorder:
    """Stands in for SGLangTarget: records the keyword arguments the factory passes."""

    seen: dict = {}

    def __init__(self, *args, **kwargs):
        _Recorder.seen = kwargs


@pytest.mark.parametrize("backend", [None, "triton", "fa3"])
def test_attention_backend_reaches_the_engine(backend, monkeypatch, smollm2_path):
    """hw.target_attention_backend goes from the config through TargetSpec to SGLang's ServerArgs
    argument (null: SGLang's choice per GPU; the CPU engine itself falls back to torch_native)."""
    import specforge_k25.target_engine.sglang_engine as engine

    monkeypatch.setattr(engine, "SGLangTarget", _Recorder)
    overrides = [] if backend is None else [f"hw.target_attention_backend={backend}"]
    spec = target_spec(compose_job(overrides))
    assert spec.attention_backend == backend
    factory.build_target(spec)
    assert _Recorder.seen["attention_backend"] == backend


def test_eval_engines_get_the_same_attention_backend():
    """Eval's engines are built from the training run's TargetSpec (setup/target.py target_spec)."""
    from specforge_k25.config import EvalJobConfig
    from specforge_k25.target_engine.sglang_spec import engine_kwargs

    job = compose_job(["hw.target_attention_backend=triton"], config_name="eval")
    assert isinstance(job, EvalJobConfig) and engine_kwargs(target_spec(job))["attention_backend"] == "triton"


def test_the_tp_node_cli_builds_the_trainers_spec(monkeypatch, smollm2_path):
    """`python -m specforge_k25.train.tp_node` composes the same overrides into the same TargetSpec."""
    import specforge_k25.stream.target_stream as producer
    from specforge_k25.train import tp_node

    overrides = ["hw.target_tp=2", "hw.target_nnodes=2", "hw.target_dist_init_addr=h:1", "hw.target_node_rank=1"]
    seen = []
    monkeypatch.setattr(producer, "run_tp_node", lambda spec: seen.append(spec) or 0)
    assert tp_node.main(overrides) == 0
    assert seen == [target_spec(compose_job(overrides))]


def test_regeneration_note_only_for_a_method_without_a_teacher_on_the_datasets_answers():
    from specforge_k25.draft.registry import get_method
    from specforge_k25.setup.data_checks import regeneration_note
    said = {(m, r): regeneration_note(get_method(m), r) is not None
            for m in ("eagle3", "dflash") for r in (False, True)}
    assert said == {("eagle3", False): False, ("eagle3", True): False, ("dflash", False): True, ("dflash", True): False}


def test_regeneration_budget_null_reaches_max_length():
    """data.regen_max_new_tokens=null: a thinking-mode answer may fill the room below max_length;
    a number caps it; below 1 is refused."""
    from types import SimpleNamespace

    from specforge_k25.setup.target import regeneration

    tokenizer = SimpleNamespace(eos_token_id=2, convert_tokens_to_ids=lambda t: 7, unk_token_id=0)
    job = compose_job(["data.regenerate=true", "data.max_length=4096", "data.regen_max_new_tokens=null"])
    assert regeneration(job, tokenizer).budget(1000) == 3096
    capped = compose_job(["data.regenerate=true", "data.max_length=4096"])
    assert regeneration(capped, tokenizer).budget(1000) == 128
    with pytest.raises(ValueError, match="regen_max_new_tokens must be >= 1"):
        regeneration(compose_job(["data.regenerate=true", "data.regen_max_new_tokens=0"]), tokenizer)
    # saved answers without regenerating: refused by name (the eval, which never regenerates, clears both)
    with pytest.raises(ValueError, match="data.regen_source=runs/a needs data.regenerate=true"):
        regeneration(compose_job(["data.regen_source=runs/a"]), tokenizer)
    assert regeneration(compose_job(["data.regen_source=runs/a", "data.regenerate=true"]), tokenizer) is not None


def test_empty_aux_layers_reach_the_run_as_zero_capture_points(monkeypatch, smollm2_path):
    """target.aux_layers=[] is K = 0 everywhere a run reads it (the plan's K, the run's capture points,
    the target spec, hence the engine and the ring), not the default that null means: the EAGLE-3 head
    refuses zero points by name, and a method that takes them gets K = 0."""
    import specforge_k25.setup.target as run
    from specforge_k25.plan.facts import facts_from_folder, num_capture_points
    from specforge_k25.target_engine.hf_config import read_target_info

    empty, default = compose_job(["target.aux_layers=[]"]), compose_job([])
    facts, info = facts_from_folder(smollm2_path), read_target_info(smollm2_path)
    assert empty.target.aux_layers == [] and default.target.aux_layers is None
    assert num_capture_points(empty, facts) == 0 and num_capture_points(default, facts) == 3
    with pytest.raises(ValueError, match=r"^0 capture points \(target.aux_layers\), but the EAGLE-3 head"):
        run.capture_points(empty, info)
    asked = []
    monkeypatch.setattr(run, "resolve_draft", lambda spec, facts, k: asked.append(k))  # a head of K = 0
    spec = target_spec(empty)
    assert spec.capture_points == [] and spec.num_aux == 0 and asked == [0]
