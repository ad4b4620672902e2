"""The registry takes a method only when it meets the contract (draft/contract.py `method_problems`):
the core, what shared code reads of its config and model, and each capability it opts into."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mtp_method import MTPConfig, MTPHead, MTPMethod, MTPPlan  # tests/fixtures: a complete plug-in method
from specforge_k25.draft.eagle3.method import Eagle3Method
from specforge_k25.draft.contract import CORE, capabilities, method_problems
from specforge_k25.draft.method import DraftMethod
from specforge_k25.draft.registry import METHODS, register


def test_every_registered_method_is_complete():
    assert set(METHODS) >= {"eagle3", "eagle3_mla", "dflash"}
    for method in METHODS.values():
        assert method_problems(method) == [], method.name
    assert method_problems(MTPMethod()) == [] and capabilities(MTPMethod()) == ["replay"]
    assert len(CORE) == 13  # name, served_architecture, spec_class, config_class, model_class, plan + 7 methods


def test_an_incomplete_method_is_refused_naming_what_it_lacks():
    class Half(DraftMethod):
        name = "half"
        model_class = nn.Linear
        plan = SimpleNamespace(param_counts=lambda cfg: {})

        def loss(self, model, batch, spec, *, depth, normalizer, checkpoint):
            raise NotImplementedError

    with pytest.raises(TypeError) as err:
        register(Half())
    message = str(err.value)
    for lacking in ("served_architecture is not set", "spec_class must be its own dataclass", "config_class",
                    "resolve_config() is not defined", "load_export() is not defined", "plan.draft_step_flops is missing",
                    "model_class Linear has no trainable_parameters()"):
        assert lacking in message, lacking
    assert "loss() is not defined" not in message and "plan.param_counts" not in message
    assert "describe()" not in message and "fsdp_units()" not in message  # defaults of the base
    assert "half" not in METHODS


@dataclasses.dataclass
class NoDraftVocab:  # a config without a field the plan and setup read of every method
    hidden_size: int
    vocab_size: int
    target_hidden_size: int


class NoSplitPlan(MTPPlan):
    pass


class CPPlan(MTPPlan):
    @staticmethod
    def context_parallel_values(cfg, size, depth):
        return 0.0


def _variant(**members) -> DraftMethod:
    return type("Variant", (MTPMethod,), {"name": "variant", **members})()


@pytest.mark.parametrize("members, named", [
    # a member of the core
    ({"loss_positions": DraftMethod.loss_positions}, "loss_positions() is not defined"),
    ({"plan": None}, "plan (its DraftPlan"),
    ({"plan": SimpleNamespace(**{k: v for k, v in vars(MTPPlan).items() if k != "saved_bytes"})},
     "plan.saved_bytes is missing"),
    # what shared code reads of every config
    ({"config_class": NoDraftVocab}, "config_class NoDraftVocab has no draft_vocab_size"),
    # the vocabulary-split head: its plan's exchange buffers, the lm_head handed to the model
    ({"shards_target_head": True, "plan": NoSplitPlan()}, "plan.split_head_bytes is missing (vocabulary-split head)"),
    ({"shards_target_head": True, "attach_target": DraftMethod.attach_target,
      "plan": type("SplitPlan", (MTPPlan,), {"split_head_bytes": staticmethod(lambda cfg, shards, bf16: 0)})()},
     "attach_target() is not defined (vocabulary-split head)"),
    # context parallelism: its plan's exchange, the heads setup splits over the group
    ({"context_parallel": True}, "plan.context_parallel_values is missing (context parallelism)"),
    ({"context_parallel": True, "plan": CPPlan()}, "config_class MTPConfig has no num_attention_heads"),
])
def test_a_method_missing_a_member_of_what_it_claims_is_refused_naming_it(members, named):
    with pytest.raises(TypeError) as err:
        register(_variant(**members))
    assert named in str(err.value), str(err.value)
    assert "variant" not in METHODS


def test_a_model_without_what_training_reads_is_refused_when_built():
    class Bare(MTPHead):
        def __init__(self, cfg):
            super().__init__(cfg)
            del self.d2t

    method = _variant(model_class=Bare)
    assert method_problems(method) == []  # an instance attribute: known once a model exists
    with pytest.raises(TypeError, match=r"draft=variant: its model Bare lacks d2t"):
        method.build(MTPConfig(8, 16, 8))
    assert type(MTPMethod().build(MTPConfig(8, 16, 8), embed=torch.zeros(16, 8))) is MTPHead


def test_a_second_method_of_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        register(Eagle3Method())


@pytest.fixture
def plugin():
    from mtp_method import NAME, register_plugin

    yield register_plugin()
    METHODS.pop(NAME, None)


def test_target_aux_layers_null_means_the_methods_default_capture_points(plugin):
    """A method states its default capture points (the plug-in: none); the built-ins keep the target's
    default, SGLang's [2, L//2, L-3]; an explicit target.aux_layers wins."""
    from specforge_k25.config import compose_job
    from specforge_k25.plan import KIMI_K25, num_capture_points, resolve_draft
    from specforge_k25.plan.facts import run_capture_points
    from specforge_k25.target_engine.layers import default_capture_points

    for name in ("eagle3", "eagle3_mla", "dflash", "kimi_dflash"):
        job = compose_job([f"draft={name}"])
        assert run_capture_points(job, 61) == default_capture_points(61) == [2, 30, 58], name
        assert num_capture_points(job, KIMI_K25) == 3 and METHODS[name if name != "kimi_dflash" else "dflash"].num_aux(
            resolve_draft(job.draft, KIMI_K25)) == 3, name
    job = compose_job([f"draft={plugin.name}"])
    assert run_capture_points(job, 61) == [] and num_capture_points(job, KIMI_K25) == 0
    assert resolve_draft(job.draft, KIMI_K25).hidden_size == KIMI_K25.hidden_size
    assert run_capture_points(compose_job([f"draft={plugin.name}", "target.aux_layers=[2,5]"]), 61) == [2, 5]


def test_the_mla_head_refuses_zero_capture_points_when_configured():
    from specforge_k25.draft.eagle3_mla.config import Eagle3MLASpec
    from specforge_k25.plan import KIMI_K25, PlanError, resolve_draft

    with pytest.raises(PlanError, match=r"^0 capture points \(target.aux_layers\), but the MLA EAGLE-3 head reads at least one"):
        resolve_draft(Eagle3MLASpec(), KIMI_K25, 0)
    assert resolve_draft(Eagle3MLASpec(), KIMI_K25, 1).num_aux_hidden_states == 1


def test_method_lists_come_from_the_registry_and_a_profile_named_after_its_method_is_refused(plugin, tmp_path):
    from specforge_k25.config import MOVED_KEYS, check_profile_names, draft_options

    assert all(name in draft_options() for name in ("eagle3", "dflash", plugin.name, "kimi_dflash"))
    assert plugin.name in str(MOVED_KEYS["draft.method"])
    check_profile_names()  # the project's own profiles
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "kimi_mtp.yaml").write_text(f"defaults:\n  - {plugin.name}\n  - _self_\n")
    check_profile_names(str(tmp_path))
    (tmp_path / "draft" / f"{plugin.name}.yaml").write_text(f"defaults:\n  - {plugin.name}\n  - _self_\n")
    with pytest.raises(ValueError, match=rf"conf/draft/{plugin.name}.yaml: a draft profile named after its method"):
        check_profile_names(str(tmp_path))
