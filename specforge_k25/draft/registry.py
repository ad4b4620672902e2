"""The draft methods by name (the `draft` config group's option), by config, by model class and by
served architecture. Adding a method: a folder under draft/ with a `DraftMethod` subclass, and one
entry here (or `register` it from outside the package, as tests/fixtures/mtp_method.py does;
docs/NEW_METHOD.md). `register` refuses a method that misses a member of the contract
(draft/contract.py `method_problems`), naming each."""
from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

from .dflash.method import DFlashMethod
from .eagle3.method import Eagle3Method
from .eagle3_mla.method import Eagle3MLAMethod
from .contract import method_problems
from .method import DraftMethod

METHODS: dict[str, DraftMethod] = {}
FIRST_METHOD = Eagle3Method.name  # what runs that predate draft methods trained (their checkpoints name none)


def register(method: DraftMethod) -> DraftMethod:
    """Add a method (the package's, or one defined elsewhere: a test's, a user's) once it passes the
    interface check; the config group gets its option `draft=<name>` when the config is next
    composed (config.register_schemas)."""
    problems = method_problems(method)
    if problems:
        raise TypeError(f"{type(method).__name__} is not a complete draft method: " + "; ".join(problems))
    if method.name in METHODS and METHODS[method.name] is not method:
        raise ValueError(f"a draft method named {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


for _method in (Eagle3Method(), Eagle3MLAMethod(), DFlashMethod()):
    register(_method)


def get_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"draft method {name!r}: expected one of {', '.join(METHODS)}")
    return METHODS[name]


def method_of_spec(spec) -> DraftMethod:
    """The method whose `draft.*` config `spec` is (the option the `draft` group selected)."""
    for method in METHODS.values():
        if type(spec) is method.spec_class:
            return method
    raise TypeError(f"{type(spec).__name__} is the draft.* config of no draft method "
                    f"(expected one of {', '.join(m.spec_class.__name__ for m in METHODS.values())})")


def method_of(model: nn.Module) -> DraftMethod:
    """The method whose model `model` is (an unsharded or FSDP-sharded draft)."""
    for method in METHODS.values():
        if isinstance(model, method.model_class):
            return method
    raise TypeError(f"{type(model).__name__} is not the model of any draft method")


def method_of_config(cfg) -> DraftMethod:
    """The method whose model `cfg` configures (callers that hold only a config: the plan)."""
    for method in METHODS.values():
        if type(cfg) is method.config_class:
            return method
    raise TypeError(f"{type(cfg).__name__} is the config of no draft method")


def method_of_export(export_dir: str | Path) -> DraftMethod:
    """The method that wrote an export folder, by the architecture its config.json names."""
    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{export_dir}: not an export folder (no config.json)")
    archs = json.loads(path.read_text()).get("architectures")
    for method in METHODS.values():
        if archs == [method.served_architecture]:
            return method
    raise ValueError(f"{export_dir}: config.architectures={archs!r} names no draft method's export "
                     f"(expected one of {', '.join(repr([m.served_architecture]) for m in METHODS.values())})")
