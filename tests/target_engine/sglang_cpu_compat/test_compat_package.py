"""The rules of the package target_engine/sglang_cpu_compat/ itself: every workaround module takes the
SGLang version from the package (version.py, the one place it is written), names in its docstring the
tests that check it, and is put to use by apply() / apply_gpu() in the registry's order (or through
another module, as the registry says)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest

from specforge_k25.target_engine import sglang_cpu_compat as compat

PACKAGE = Path(compat.__file__).parent
HERE = Path(__file__).parent
SHARED = {"__init__", "hooks", "version"}  # the package, its import hooks, the version: no workarounds
WORKAROUNDS = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in SHARED)
TEST_FILE = re.compile(r"tests/target_engine/sglang_cpu_compat/(test_\w+\.py)")
TEST_NAME = re.compile(r"`(test_\w+)`")


def _module(name: str):
    return importlib.import_module(f"{compat.__name__}.{name}")


def _tests_in(file: str) -> set[str]:
    tree = ast.parse((HERE / file).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_the_registry_holds_every_workaround_module_once():
    registered = [m for m, _ in compat.CPU_WORKAROUNDS] + list(compat.GPU_WORKAROUNDS) + list(compat.USED_THROUGH_OTHERS)
    names = [m.__name__.rsplit(".", 1)[-1] for m in registered]
    assert sorted(names) == WORKAROUNDS, "add the new module to a registry in sglang_cpu_compat/__init__.py"
    # the switches are apply()'s parameters, every one of them used
    assert {s for _, s in compat.CPU_WORKAROUNDS if s} == set(inspect.signature(compat.apply).parameters)
    # what the registry says of the two that nothing installs
    assert _module("sgl_kernel_stand_in").SPEC_OPS is _module("spec_ops").SPEC_OPS
    assert compat.check_deepseek_config is _module("deepseek_config").check_deepseek_config


def test_the_version_is_written_once():
    assert compat.SGLANG_VERSION == _module("version").SGLANG_VERSION
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem != "version":
            assert compat.SGLANG_VERSION not in path.read_text(), f"{path.name} writes the version: name SGLANG_VERSION"


@pytest.mark.parametrize("name", WORKAROUNDS)
def test_module_states_the_package_version(name):
    module = _module(name)
    tree = ast.parse(Path(module.__file__).read_text())
    from_package = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1
                    and node.module == "version" and any(a.name == "SGLANG_VERSION" for a in node.names)]
    own = [node for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
           and any(isinstance(t, ast.Name) and t.id == "SGLANG_VERSION"
                   for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    assert from_package and not own, f"{name}.py: `from .version import SGLANG_VERSION`, no copy of its own"
    assert module.SGLANG_VERSION is compat.SGLANG_VERSION
    assert "SGLANG_VERSION" in module.__doc__, f"{name}.py: the docstring names the version it is checked against"


@pytest.mark.parametrize("name", WORKAROUNDS)
def test_module_docstring_names_tests_that_exist(name):
    doc = _module(name).__doc__
    files = set(TEST_FILE.findall(doc))
    assert len(files) == 1, f"{name}.py: its docstring names one test file of {HERE}, not {sorted(files)}"
    (file,) = files
    assert (HERE / file).is_file(), f"{name}.py names {file}, which does not exist"
    named = set(TEST_NAME.findall(doc))
    assert named, f"{name}.py: its docstring names no test (`test_...`)"
    assert named <= _tests_in(file), f"{name}.py names tests {file} lacks: {sorted(named - _tests_in(file))}"


def test_every_workaround_test_is_named_by_its_module():
    named = {}
    for name in WORKAROUNDS:
        doc = _module(name).__doc__
        for test in TEST_NAME.findall(doc):
            named.setdefault(TEST_FILE.findall(doc)[0], set()).add(test)
    for path in sorted(HERE.glob("test_compat_*.py")):
        if path.name != Path(__file__).name:
            assert _tests_in(path.name) <= named.get(path.name, set()), f"{path.name}: name each test in its module"


@pytest.fixture
def fresh(monkeypatch):
    """The package as if no apply had run in this process, each workaround's install recorded, not run."""
    calls = []
    for module, _ in compat.CPU_WORKAROUNDS:
        monkeypatch.setattr(module, "install", lambda _name=module.__name__: calls.append(_name))
    for module in compat.GPU_WORKAROUNDS:
        monkeypatch.setattr(module, "install", lambda *args, _name=module.__name__: calls.append((_name, args)))
    monkeypatch.setattr(compat, "_applied", False)
    monkeypatch.setattr(compat, "_gpu_applied", False)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")  # apply() sets it; monkeypatch restores it
    return calls


def test_apply_installs_each_cpu_workaround_in_order(fresh):
    compat.apply()
    assert fresh == [m.__name__ for m, _ in compat.CPU_WORKAROUNDS]
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    compat.apply()  # idempotent
    assert len(fresh) == len(compat.CPU_WORKAROUNDS)
    with pytest.raises(RuntimeError, match="apply\\(\\) \\(CPU\\) already ran"):
        compat.apply_gpu()


def test_apply_switches_leave_their_workarounds_out(fresh):
    compat.apply(mla_fix=False, spec_patches=False, dflash_patches=False, fork_engines=False)
    assert fresh == [m.__name__ for m, switch in compat.CPU_WORKAROUNDS if switch is None]
    assert [m.__name__.rsplit(".", 1)[-1] for m, s in compat.CPU_WORKAROUNDS if s is None] == [
        "sgl_kernel_stand_in", "mla_draft_sync"]


def test_apply_gpu_installs_the_gpu_workaround_without_a_real_sgl_kernel(fresh, monkeypatch):
    found = {"sgl_kernel": None}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: found[name] if name in found else real_find_spec(name, *a))
    found["sgl_kernel"] = object()  # a real package: nothing installed
    assert compat.apply_gpu() is False and fresh == []
    found["sgl_kernel"] = None
    assert compat.apply_gpu(False, True, False) is True
    assert fresh == [(m.__name__, (False, True, False)) for m in compat.GPU_WORKAROUNDS]
    assert compat.apply_gpu() is True and len(fresh) == len(compat.GPU_WORKAROUNDS)  # idempotent
    with pytest.raises(RuntimeError, match="apply_gpu\\(\\) already ran"):
        compat.apply()
