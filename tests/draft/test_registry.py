"""The registry takes a method only when it is complete (draft/method.py `method_problems`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.nn as nn

from specforge_k25.draft.eagle3.method import Eagle3Method
from specforge_k25.draft.method import DraftMethod, method_problems
from specforge_k25.draft.registry import METHODS, register


def test_every_registered_method_is_complete():
    assert set(METHODS) >= {"eagle3", "eagle3_mla", "dflash"}
    for method in METHODS.values():
        assert method_problems(method) == [], method.name


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
                    "resolve_config() is not defined", "load_export() is not defined", "plan.draft_step_flops is missing"):
        assert lacking in message, lacking
    assert "loss() is not defined" not in message and "plan.param_counts" not in message
    assert "half" not in METHODS


def test_a_second_method_of_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        register(Eagle3Method())
