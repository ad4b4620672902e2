"""The draft-method contract: the core every method defines itself (`CORE`), the capabilities a
method opts into (`CAPABILITIES`, each a typed Protocol: random draws, reserved tokens, a
vocabulary-split head, context parallelism, serving by SGLang / vLLM, replay), and
`method_problems`, the check the registry runs when it takes a method (draft/registry.py), which
names every missing member. The members themselves, and the defaults of all the others, are
draft/method.py `DraftMethod`'s."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from .method import (CONFIG_FIELDS, ContextParallelPlan, DraftBatch, DraftMethod, DraftPlan, Serving, SplitHeadPlan)
from .spec import DraftSpec


# ---------------------------------------------------------------------------------- capabilities
class RandomDraws(Protocol):
    def prepare_batch(self, cfg, batch: DraftBatch, generator: torch.Generator) -> DraftBatch: ...


class ReservedTokens(Protocol):
    def reserved_tokens(self, cfg) -> dict[str, int]: ...


class SplitTargetHead(Protocol):
    shards_target_head: bool
    plan: SplitHeadPlan

    def attach_target(self, model: nn.Module, lm_head: torch.Tensor) -> None: ...


class ContextParallel(Protocol):
    context_parallel: bool
    plan: ContextParallelPlan


class SGLangServing(Protocol):
    """`servings` has a default: a chain drafter's settings, one per eval chain."""

    sglang_algorithm: str


class VLLMServing(Protocol):
    vllm_method: str


class Replay(Protocol):
    def proposals(self, model: nn.Module, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                  servings: list[Serving], final_hidden: torch.Tensor | None = None) -> list[torch.Tensor] | None: ...


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The members a Protocol of this module declares (its functions and annotated attributes)."""
    return tuple(dict.fromkeys([*(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")),
                                *getattr(protocol, "__annotations__", {})]))


# The core every method defines itself: its identity and classes (config, model), capture points
# (num_aux), loss, export, and its plan (a DraftPlan). The base gives everything else a default.
CORE_ATTRIBUTES = ("name", "served_architecture", "spec_class", "config_class", "model_class", "plan")
CORE_METHODS = ("resolve_config", "num_aux", "loss", "loss_positions", "serving_config", "validate_export",
                "load_export")
CORE = CORE_ATTRIBUTES + CORE_METHODS


@dataclass(frozen=True)
class Capability:
    """What a method opts into beyond the core: `opted_in(method)` says whether it does; it must then
    define the `protocol`'s methods itself, its plan the `plan_protocol`'s functions, and its config
    class the `config_fields` shared code reads for it."""

    name: str
    protocol: type
    opted_in: Callable[[DraftMethod], bool]
    plan_protocol: type | None = None
    config_fields: tuple[str, ...] = ()


def _defines(method: DraftMethod, name: str) -> bool:
    return getattr(type(method), name) is not getattr(DraftMethod, name)


CAPABILITIES = (
    Capability("random draws", RandomDraws, lambda m: _defines(m, "prepare_batch")),
    Capability("reserved tokens", ReservedTokens, lambda m: _defines(m, "reserved_tokens")),
    Capability("vocabulary-split head", SplitTargetHead, lambda m: m.shards_target_head, SplitHeadPlan),
    Capability("context parallelism", ContextParallel, lambda m: m.context_parallel, ContextParallelPlan,
               ("num_attention_heads",)),
    Capability("SGLang serving", SGLangServing, lambda m: m.serves_sglang),
    Capability("vLLM serving", VLLMServing, lambda m: bool(m.vllm_method)),
    Capability("replay", Replay, lambda m: _defines(m, "proposals")),
)


def capabilities(method: DraftMethod) -> list[str]:
    """The capabilities `method` opts into, by name."""
    return [c.name for c in CAPABILITIES if c.opted_in(method)]


def _config_has(config_class: type, name: str) -> bool:
    return (dataclasses.is_dataclass(config_class) and name in {f.name for f in dataclasses.fields(config_class)}) \
        or hasattr(config_class, name)


def method_problems(method: DraftMethod) -> list[str]:
    """Every way `method` falls short of the contract: unset names and classes, core members it does
    not define, plan arithmetic it lacks, what shared code reads of its config and model class, and
    the same for each capability it opts into (empty: it plugs in)."""
    cls = type(method)
    problems = [f"{attr} is not set" for attr in ("name", "served_architecture") if not getattr(method, attr)]
    if not (isinstance(method.spec_class, type) and issubclass(method.spec_class, DraftSpec)
            and method.spec_class is not DraftSpec and dataclasses.is_dataclass(method.spec_class)):
        problems.append("spec_class must be its own dataclass extending draft/spec.py DraftSpec (its draft.* "
                        "config, by which the registry knows the method of a config)")
    model_ok = (isinstance(method.model_class, type) and issubclass(method.model_class, nn.Module)
                and method.model_class is not nn.Module)
    if not model_ok:
        problems.append("model_class must be its nn.Module subclass")
    elif not callable(getattr(method.model_class, "trainable_parameters", None)):
        problems.append(f"model_class {method.model_class.__name__} has no trainable_parameters()")
    config_ok = isinstance(method.config_class, type) and method.config_class is not object
    if not config_ok:
        problems.append("config_class (what resolve_config returns) is not set")
    problems += [f"{name}() is not defined" for name in CORE_METHODS if getattr(cls, name) is getattr(DraftMethod, name)]
    if method.plan is None:
        problems.append("plan (its DraftPlan: param_counts, step_bytes, ...) is not set")
    else:
        problems += [f"plan.{name} is missing" for name in protocol_members(DraftPlan)
                     if not callable(getattr(method.plan, name, None))]
    wanted_fields = list(CONFIG_FIELDS)
    for cap in CAPABILITIES:
        if not cap.opted_in(method):
            continue
        problems += [f"{name}() is not defined ({cap.name})" for name in protocol_members(cap.protocol)
                     if callable(getattr(DraftMethod, name, None)) and getattr(cls, name) is getattr(DraftMethod, name)]
        if cap.plan_protocol is not None and method.plan is not None:
            problems += [f"plan.{name} is missing ({cap.name})" for name in protocol_members(cap.plan_protocol)
                         if not callable(getattr(method.plan, name, None))]
        wanted_fields += cap.config_fields
    if config_ok:
        problems += [f"config_class {method.config_class.__name__} has no {name} (shared code reads it)"
                     for name in dict.fromkeys(wanted_fields) if not _config_has(method.config_class, name)]
    return problems
