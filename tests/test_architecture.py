"""The package's import walls (docs/ARCHITECTURE.md, "Import rules"), read from the source with
`ast`: every import statement, those inside functions included, named by file:line on failure."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specforge_k25"

# What each part of the package may import of ours, along the data path
# data -> target_engine -> stream -> draft -> export -> plan -> serving / setup -> train / eval.
# The top-level modules `fields` (config fields with help and bounds) and `paths` (the cache
# folder, atomic file writes) are leaves; `config` (the typed config) reads the draft methods'
# own configs from the registry.
ALLOWED = {
    "fields": set(),
    "config": {"fields", "draft"},
    "paths": set(),
    "data": {"paths"},
    "target_engine": {"data", "paths"},
    "stream": {"target_engine"},
    "draft": {"paths", "fields"},  # torch only, the atomic file writes of its exports, its config's fields
    "export": {"draft", "target_engine", "paths"},  # the layer-id rules of the servers (target_engine/layers.py)
    "plan": {"config", "target_engine", "draft"},  # reads facts; builds nothing
    "serving": {"config", "fields", "target_engine", "draft", "plan"},  # predicts from facts and a run's figures
    "setup": {"config", "data", "target_engine", "stream", "draft", "plan"},
    "train": {"config", "setup", "data", "target_engine", "stream", "draft", "export", "plan", "serving", "paths"},
    "eval": {"config", "setup", "data", "target_engine", "stream", "draft", "export", "serving"},
}
ONLY_UNDER = {"sglang": "target_engine", "sgl_kernel": "target_engine"}  # third-party packages one part alone may import
NEVER_IN = {"data": ["torch.distributed"], "draft": ["torch.distributed"]}


def imports(root: Path = PACKAGE):
    """(part, imported module, 'file:line') for every import statement of the package."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = list(rel.with_suffix("").parts)
        package = module[:-1] if module[-1] != "__init__" else module[:-1]
        if module[-1] == "__init__":
            module = module[:-1]
        part = module[1] if len(module) > 1 else "__init__"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = package[: len(package) - (node.level - 1)]
                    names = [".".join(base + ([node.module] if node.module else []))]
                else:
                    names = [node.module or ""]
            else:
                continue
            for name in names:
                yield part, name, f"{rel}:{node.lineno}"


def _ours(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "specforge_k25":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def violations(root: Path = PACKAGE) -> list[str]:
    out = []
    for part, name, where in imports(root):
        if part == "__init__":
            continue
        target = _ours(name)
        if target is not None:
            if target != part and target not in ALLOWED.get(part, set()):
                out.append(f"{where}: {part} imports {name} ({part} may import {sorted(ALLOWED.get(part, ()))})")
            continue
        top = name.split(".")[0]
        if top in ONLY_UNDER and part != ONLY_UNDER[top]:
            out.append(f"{where}: {part} imports {name} (only {ONLY_UNDER[top]}/ may)")
        for banned in NEVER_IN.get(part, ()):
            if name == banned or name.startswith(banned + "."):
                out.append(f"{where}: {part} imports {name}")
    return out


def cycles(root: Path = PACKAGE) -> list[str]:
    """Import cycles between parts of the package, each as 'a -> b -> a' with the lines."""
    edges: dict[str, dict[str, str]] = {}
    for part, name, where in imports(root):
        target = _ours(name)
        if target is not None and target != part and part != "__init__":
            edges.setdefault(part, {}).setdefault(target, where)
    found = []

    def visit(node, path):
        for nxt, where in edges.get(node, {}).items():
            if nxt == path[0][0]:
                found.append(" -> ".join(f"{a} ({w})" for a, w in path + [(nxt, where)]))
            elif nxt not in [p for p, _ in path] and nxt > path[0][0]:  # each cycle once, from its smallest part
                visit(nxt, path + [(nxt, where)])

    for start in sorted(edges):
        visit(start, [(start, "")])
    return found


def test_every_part_is_known():
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert parts == set(ALLOWED), f"add new parts to ALLOWED (and docs/ARCHITECTURE.md): {parts ^ set(ALLOWED)}"


def test_imports_run_one_way():
    assert violations() == []


def test_no_cycle_between_parts():
    assert cycles() == []


def test_allowed_map_itself_has_no_cycle():
    """The rules are a layering: following ALLOWED never leads back to where it started."""
    def reach(part, seen=()):
        for nxt in ALLOWED[part]:
            assert nxt not in seen + (part,), f"ALLOWED has a cycle through {part} -> {nxt}"
            reach(nxt, seen + (part,))

    for part in ALLOWED:
        reach(part)


@pytest.mark.parametrize("source,expect", [
    ("data/x.py", "from ..train.trainer import Trainer\n"),  # backwards
    ("draft/x.py", "def f():\n    from ..config import JobConfig\n"),  # inside a function
    ("eval/x.py", "import sglang\n"),  # sglang outside target_engine/
    ("data/x.py", "import torch.distributed as dist\n"),
])
def test_a_planted_violation_is_named_with_its_line(tmp_path, source, expect):
    """The walker sees what it must: a copy of the package plus one bad import fails, naming it."""
    import shutil

    copy = tmp_path / "specforge_k25"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / source).write_text(expect)
    found = violations(copy)
    line = expect.count("\n")
    assert any(f.startswith(f"specforge_k25/{source}:{line}:") for f in found), found


def test_a_planted_cycle_is_found(tmp_path):
    import shutil

    copy = tmp_path / "specforge_k25"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "stream" / "x.py").write_text("from ..setup.run import prepare\n")
    found = cycles(copy)
    assert any("setup" in c and "stream/x.py:1" in c for c in found), found


# ------------------------------------------------------------------------- module cycles
# Within a part too, modules import one way: no module reaches itself again through the imports of
# others, at module level or inside a function (a lazy import hides a circle, it does not remove it).
def module_imports(root: Path = PACKAGE):
    """(module, imported module of the package, 'file:line') for every import statement, read as
    `imports` reads them (ast.walk: those inside functions too), module names without the package
    prefix ('plan.pipeline'; a package's __init__ is the package's own name, 'plan'). `from .x
    import y` is module x, or x.y where that is a module; `from . import x` is the sibling module x
    (the package itself when x is a name it defines)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for module, path in modules.items():
        rel = path.relative_to(root.parent)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for name in dict.fromkeys(names):
                while name not in modules and "." in name:  # a name inside a module: the module
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    yield module.split(".", 1)[-1], name.split(".", 1)[-1], f"{rel}:{node.lineno}"


def module_cycles(root: Path = PACKAGE) -> list[str]:
    """Import circles between modules of the package: one per strongly connected set of modules,
    as its shortest circle from its first module, 'a -> b (file:line) -> a (file:line)'."""
    edges: dict[str, dict[str, str]] = {}
    for module, target, where in module_imports(root):
        edges.setdefault(module, {}).setdefault(target, where)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    found = []
    for group in groups:
        start = min(group)
        came: dict[str, tuple[str, str]] = {}
        frontier = [start]
        while frontier and start not in came:  # breadth first, inside the group, back to start
            nxt = []
            for v in frontier:
                for w, where in sorted(edges.get(v, {}).items()):
                    if w in group and w not in came:
                        came[w] = (v, where)
                        nxt.append(w)
            frontier = nxt
        hops, v = [], start
        while True:
            prev, where = came[v]
            hops.append(f"{v} ({where})")
            v = prev
            if v == start:
                break
        found.append(" -> ".join([start] + hops[::-1]) + (f"; {len(group)} modules in the circle: "
                                                         f"{', '.join(sorted(group))}" if len(group) > 2 else ""))
    return sorted(found)


def test_no_import_cycle_between_modules():
    assert any(m == "plan.choose" and t == "plan.pipeline" for m, t, _ in module_imports())  # it reads our imports
    found = module_cycles()
    assert not found, "import circles between modules:\n" + "\n".join(found)


@pytest.mark.parametrize("source,expect", [
    ("plan/x.py", "def f():\n    from .budget import plan_memory\n"),  # a lazy import back: plan.budget -> plan.x
    ("plan/x.py", "from . import budget\n"),
])
def test_a_planted_module_cycle_is_named(tmp_path, source, expect):
    import shutil

    copy = tmp_path / "specforge_k25"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / source).write_text(expect)
    budget = copy / "plan" / "budget.py"
    budget.write_text(budget.read_text() + "\n\ndef _planted():\n    from .x import f\n")
    found = module_cycles(copy)
    assert any("plan.budget" in c and f"specforge_k25/{source}:{expect.count(chr(10))}" in c for c in found), found


# ------------------------------------------------------------------------- draft methods
# Outside draft/ the package reaches a draft method only through these modules of draft/ (the
# interface, the registry, and what every method shares: the teacher and loss counters, the vocab
# maps, the folder publisher); it never names a method, its model classes or its served names.
DRAFT_SHARED = {"method", "registry", "objective", "layers", "vocab", "export_folder", "spec"}


def method_vocabulary(root: Path = PACKAGE) -> set[str]:
    """Every method's registry name, and the classes and constants its folder defines: what must not
    appear outside draft/. (The servers' class names may: the SGLang CPU workarounds patch SGLang's
    own draft classes.)"""
    words = set()
    for path in (root / "draft").glob("*/*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                words.add(node.name)
                for stmt in node.body:  # the registry name: name = "..."
                    if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                            and isinstance(stmt.value.value, str) and stmt.value.value
                            and any(isinstance(t, ast.Name) and t.id == "name" for t in stmt.targets)):
                        words.add(stmt.value.value)
            elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
                words |= {t.id for t in node.targets}
    return words


def method_mentions(root: Path = PACKAGE) -> list[str]:
    """'file:line: what' for each place outside draft/ that names a method: an import of a draft
    module other than DRAFT_SHARED, a name or attribute from `method_vocabulary`, or a string
    (docstrings aside) equal to one. config.py is the one exception: the default draft config and
    the message naming the draft group's options."""
    words = method_vocabulary(root)
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] in ("draft", "config.py"):  # config: the default draft and the group's options
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                what = next((f"imports {a.name}" for a in node.names if a.name.split(".")[:2] == ["specforge_k25", "draft"]
                             and (len(a.name.split(".")) < 3 or a.name.split(".")[2] not in DRAFT_SHARED)), None)
            elif isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module.split(".")
                if node.level == 2 and mod[0] == "draft" and (len(mod) < 2 or mod[1] not in DRAFT_SHARED):
                    what = f"imports draft.{'.'.join(mod[1:])}"
                elif node.level == 0 and mod[:2] == ["specforge_k25", "draft"] and (len(mod) < 3 or mod[2] not in DRAFT_SHARED):
                    what = f"imports {node.module}"
                else:
                    what = next((f"imports {a.name}" for a in node.names if a.name in words), None)
            elif isinstance(node, ast.Name) and node.id in words:
                what = node.id
            elif isinstance(node, ast.Attribute) and node.attr in words:
                what = node.attr
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words
                  and id(node) not in docstrings):
                what = repr(node.value)
            if what:
                out.append(f"{rel}:{node.lineno}: {what}")
    return out


def test_no_module_outside_draft_names_a_draft_method():
    assert "eagle3" in method_vocabulary() and "Eagle3MLADraft" in method_vocabulary()  # the walker reads the methods
    assert method_mentions() == []


@pytest.mark.parametrize("source", [
    "from ..draft.model import Eagle3Draft\n",
    "def f(m):\n    return m == 'eagle3_mla'\n",
    "import specforge_k25.draft.eagle3_mla.model\n",
])
def test_a_planted_method_mention_is_named(tmp_path, source):
    import shutil

    copy = tmp_path / "specforge_k25"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "train" / "x.py").write_text(source)
    found = method_mentions(copy)
    assert any(f.startswith(f"specforge_k25/train/x.py:{source.count(chr(10))}") for f in found), found


# ------------------------------------------------------------------ method knobs stay in the method
def method_knobs() -> set[str]:
    """The draft.* fields one method or another has beyond the shared DraftSpec ones."""
    from dataclasses import fields

    from specforge_k25.draft.registry import METHODS
    from specforge_k25.draft.spec import DraftSpec

    shared = {f.name for f in fields(DraftSpec)}
    return {f.name for m in METHODS.values() for f in fields(m.spec_class)} - shared


def knob_reads(root: Path = PACKAGE) -> list[str]:
    """'file:line: draft.<knob>' for each read of a method's own draft.* field outside draft/
    (`job.draft.ttt_length`, `spec.block_size` where spec is a method config): the shared code
    asks the method (DraftMethod.depth, ...) instead."""
    knobs, out = method_knobs(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] == "draft":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in knobs and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "draft"):
                out.append(f"{rel}:{node.lineno}: draft.{node.attr}")
    return out


def test_shared_code_config_and_profiles_hold_no_method_knob():
    """A method's knobs live in its config (draft/<method>/config.py) and the draft group's
    profiles (conf/draft/): no other config dataclass has one, no other YAML sets one, no shared
    module reads one."""
    import dataclasses

    import yaml

    import specforge_k25.config as config

    knobs = method_knobs()
    assert {"ttt_length", "loss_decay", "block_size", "num_anchors", "fc_norm"} <= knobs
    for cls in vars(config).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__:
            assert not {f.name for f in dataclasses.fields(cls)} & knobs, cls.__name__
    conf = PACKAGE.parent / "conf"
    for path in conf.rglob("*.yaml"):
        if path.parent.name == "draft":
            continue
        text = yaml.safe_load(path.read_text()) or {}
        at_root = path.parent == conf or "@package _global_" in path.read_text()  # keys of the whole job
        keys = set(text.get("draft") or {}) if at_root else set()
        keys |= {k for k in text if isinstance(k, str) and k.startswith("draft.")}
        assert not keys, f"{path.relative_to(conf)} sets draft.* keys {sorted(keys)}: a profile of conf/draft/ holds them"
    assert knob_reads() == []


def test_a_planted_knob_read_is_named(tmp_path):
    import shutil

    copy = tmp_path / "specforge_k25"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "train" / "x.py").write_text("def f(job):\n    return job.draft.ttt_length\n")
    assert knob_reads(copy) == ["specforge_k25/train/x.py:2: draft.ttt_length"]
