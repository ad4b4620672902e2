"""Which imports a package's code would run from some entry points, tried without running that code.

An import inside a function runs only when the function does, so importing a package's modules does
not show what its functions import. Here the functions reached from the roots are read (their source
parsed; names resolved against the live, imported modules) and every import in them is tried in this
process; one that fails is reported with the file:line of the import and the chain of calls that
reaches it. Reached: functions referenced by name, methods called on self (the overrides of every
class made so far included), on super() or on an object whose class the walked code made, and what
making an object runs (__init__, __post_init__, __call__, forward). Not followed: branches whose
guard this process can decide (platform probes named is_* / use_* and bool globals, `envs.X.get()`
switches, server arguments named enable_* outside `enabled`, TYPE_CHECKING), imports under `except
ImportError` (the package's own fallbacks), entries of a dict keyed by backend names other than the
chosen backend, and what `skipped` names. A call of an sgl_kernel stand-in op (specforge_k25's
sglang_cpu_compat, which raises when called) is reported too. `image_only` names packages the target
machine has and this one lacks: during the tried imports they are modules of MagicMocks, so that an
import goes on to what the target really lacks.
tests/benchmarks/sglang_cuda_path.py applies it to SGLang's CUDA path.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import textwrap
import time
import types
from unittest import mock

IMPLICIT = ("__init__", "__post_init__", "__call__", "forward")
_UNKNOWN = object()
GUARD_CALL_PREFIXES = ("is_", "_is_", "use_", "_use_")  # zero-argument platform probes, safe to call


class Reach:
    """From `roots` ("module:function", "module:Class.method" run; "module:Class" is made), the functions
    of `package` that run, walked as the module docstring says; `run()` returns what failed."""

    def __init__(self, package: str, roots, skipped: dict, enabled=(), backend: str = "", image_only=()):
        self.package, self.enabled, self.backend = package, set(enabled), backend
        self.on_the_image = _OnTheImage(image_only)
        self.skipped, self.failed, self.done, self.todo = dict(skipped), [], {}, []
        self.attr_types: dict[tuple[type, str], type] = {}
        self.instantiated: set[type] = set()
        self.self_calls: dict[tuple[type, str], tuple] = {}
        for root in roots:
            obj = _resolve(root)
            if isinstance(obj, type):
                self.instantiate(obj, ("root", root))
            else:
                self.function(obj, ("root", root), owner=_owner(root))
        for key in self.skipped:
            if not _exists(key):
                self.failed.append({"module": key, "error": "a skipped key that names nothing (any more)",
                                    "where": "", "chain": []})

    # ------------------------------------------------------------------ what is reached
    def function(self, obj, via, owner: type | None = None):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset):
                self.function(f, via, owner)
            return
        if not isinstance(obj, types.FunctionType):
            return
        obj = inspect.unwrap(obj)
        module = getattr(obj, "__module__", "") or ""
        key = f"{module}:{obj.__qualname__}"
        if not _inside(module, self.package) or key in self.done or self.is_skipped(module, key):
            return
        self.done[key] = via
        self.todo.append((obj, owner, key))

    def is_skipped(self, module: str, key: str) -> bool:
        return key in self.skipped or any(module == k or module.startswith(k + ".") for k in self.skipped
                                          if ":" not in k)

    def instantiate(self, cls: type, via):
        if (not isinstance(cls, type) or cls in self.instantiated or not _inside(cls.__module__, self.package)
                or self.is_skipped(cls.__module__, f"{cls.__module__}:{cls.__qualname__}")):
            return
        self.instantiated.add(cls)
        for name in IMPLICIT:
            self.method(cls, name, via)
        for base, name in list(self.self_calls):  # calls on self made before this class was
            if issubclass(cls, base):
                self.method(cls, name, self.self_calls[(base, name)])

    def method(self, cls: type, name: str, via, on_self=False, on_super=False):
        """cls.name as Python finds it (past cls for super()); for a call on self in cls, also as each
        class made so far that derives from cls finds it (an override)."""
        for klass in cls.__mro__[1:] if on_super else cls.__mro__:
            if name in vars(klass):
                self.function(vars(klass)[name], via, klass)
                break
        if on_self and (cls, name) not in self.self_calls:
            self.self_calls[(cls, name)] = via
            for made in list(self.instantiated):
                if made is not cls and issubclass(made, cls):
                    self.method(made, name, via)

    def run(self) -> dict:
        t0 = time.perf_counter()
        while self.todo:
            self.walk(*self.todo.pop())
        return {"failed": self.failed, "functions": len(self.done), "seconds": round(time.perf_counter() - t0, 1)}

    # ------------------------------------------------------------------ one function's body
    def walk(self, fn, owner, key):
        try:
            lines, first = inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            return
        node, ctx = tree.body[0], _Ctx(self, fn, owner, key, first - 1)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ctx.stmts(node.body)
        else:  # a lambda: its source is the statement that holds it
            ctx.expr(next((n.body for n in ast.walk(node) if isinstance(n, ast.Lambda)), node))


class _Ctx:
    """Walks one function: its imports are tried, the code it calls is queued."""

    def __init__(self, scan: Reach, fn, owner, key, offset):
        self.scan, self.fn, self.owner, self.key, self.offset = scan, fn, owner, key, offset
        self.globals, self.locals, self.types, self.known = fn.__globals__, {}, {}, {}
        self.file = inspect.getsourcefile(fn) or "?"

    def where(self, node) -> str:
        path = self.file.replace("\\", "/")
        return f"{path[path.rfind(f'/{self.scan.package}/') + 1:]}:{self.offset + node.lineno}"

    def via(self, node):
        return (self.key, self.where(node))

    # statements
    def stmts(self, body):
        for s in body:
            if isinstance(s, ast.If):
                taken = self.guard(s.test)
                self.expr(s.test)
                if taken is not False:
                    self.stmts(s.body)
                if taken is not True:
                    self.stmts(s.orelse)
                branch = s.body if taken else s.orelse if taken is False else None
                if branch and isinstance(branch[-1], (ast.Return, ast.Raise)):
                    return  # the rest of this block does not run here
            elif isinstance(s, ast.Try):
                if not _catches_import_error(s):
                    self.stmts(s.body)
                for h in s.handlers:
                    self.stmts(h.body)
                self.stmts(s.orelse + s.finalbody)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                self.import_(s)
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for e in s.decorator_list:
                    self.expr(e)
                self.stmts(s.body)
            elif isinstance(s, ast.ClassDef):
                for e in s.decorator_list + s.bases:
                    self.expr(e)
                self.stmts(s.body)
            else:
                if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                    known = self.guard(s.value)
                    if known is not None:
                        self.known[s.targets[0].id] = known
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call):
                    made = self.value(s.value.func)
                    if isinstance(made, type):
                        for t in s.targets:
                            self.bind_type(t, made)
                for _, value in ast.iter_fields(s):
                    for item in value if isinstance(value, list) else [value]:
                        if isinstance(item, ast.stmt):
                            self.stmts([item])
                        elif isinstance(item, (ast.ExceptHandler, ast.match_case)):
                            self.stmts(item.body)
                        elif isinstance(item, ast.AST):
                            self.expr(item)

    def bind_type(self, target, cls):
        if isinstance(target, ast.Name):
            self.types[target.id] = cls
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
              and self.owner is not None):
            self.scan.attr_types[(self.owner, target.attr)] = cls

    def import_(self, s):
        if isinstance(s, ast.Import):
            for alias in s.names:
                module = self.try_import(alias.name, s)
                if module is not None:
                    self.locals[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else sys.modules[alias.name.split(".")[0]])
            return
        base = s.module or ""
        if s.level:
            package = (self.globals.get("__package__") or "").split(".")
            base = ".".join(package[: len(package) - (s.level - 1)] + ([base] if base else []))
        module = self.try_import(base, s)
        if module is None:
            return
        for alias in s.names:
            if alias.name == "*":
                continue
            value = getattr(module, alias.name, None)
            if value is None:
                value = self.try_import(f"{base}.{alias.name}", s)
            if value is not None:
                self.locals[alias.asname or alias.name] = value

    def try_import(self, name: str, node):
        if f"{self.key} -> {name}" in self.scan.skipped:
            return None
        sys.meta_path.append(self.scan.on_the_image)  # only here: other libraries probe these names on import
        try:
            return importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - ImportError above all; any failure is reported
            self.scan.failed.append({"module": name, "error": f"{type(err).__name__}: {err}"[:300],
                                     "where": self.where(node), "chain": self.chain()})
            return None
        finally:
            sys.meta_path.remove(self.scan.on_the_image)

    def chain(self) -> list[str]:
        out, key = [], self.key
        while key is not None and len(out) < 12:
            via = self.scan.done.get(key)
            if via is None or via[0] == "root":
                out.append(f"{key} (root)")
                break
            out.append(f"{key} ({via[1]})")
            key = via[0]
        return out

    # expressions
    def guard(self, test):
        """True/False where this process knows a branch's platform condition, else None."""
        if isinstance(test, ast.BoolOp):
            values = [self.guard(v) for v in test.values]
            if isinstance(test.op, ast.And):
                return False if False in values else (True if all(v is True for v in values) else None)
            return True if True in values else (False if all(v is False for v in values) else None)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            value = self.guard(test.operand)
            return None if value is None else not value
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
            return False
        if isinstance(test, ast.Name) and test.id in self.known:
            return self.known[test.id]
        if (isinstance(test, ast.Attribute) and test.attr.startswith("enable_") and test.attr not in self.scan.enabled
                and not isinstance(self.value(test), bool)):
            return False  # a server argument: the run turns on none but `enabled`
        value = self.env_value(test)
        if value is not _UNKNOWN:
            return value if isinstance(value, bool) else None
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant)
                and isinstance(test.ops[0], (ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq))):
            value = self.env_value(test.left)
            if value is not _UNKNOWN:
                ops = {ast.Gt: "__gt__", ast.GtE: "__ge__", ast.Lt: "__lt__", ast.LtE: "__le__", ast.Eq: "__eq__",
                       ast.NotEq: "__ne__"}
                result = getattr(value, ops[type(test.ops[0])])(test.comparators[0].value)
                return result if isinstance(result, bool) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
            inner = self.guard(test.left)
            return None if inner is None else (inner if isinstance(test.ops[0], ast.IsNot) else not inner)
        if isinstance(test, ast.Name) and test.id.startswith(GUARD_CALL_PREFIXES):
            value = self.globals.get(test.id)
            return value if isinstance(value, bool) else None
        if (isinstance(test, ast.Call) and not test.args and not test.keywords and isinstance(test.func, ast.Name)
                and test.func.id.startswith(GUARD_CALL_PREFIXES)):
            probe = self.globals.get(test.func.id)
            try:
                value = probe() if callable(probe) else None
            except Exception:  # noqa: BLE001 - unknown: both branches are walked
                return None
            return value if isinstance(value, bool) else None
        return None

    def env_value(self, node):
        """`envs.NAME.get()`: SGLang's environment switch as this process (apply_gpu's settings) has it."""
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and not node.args and isinstance(node.func.value, ast.Attribute)
                and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "envs"):
            try:
                return getattr(self.globals["envs"], node.func.value.attr).get()
            except Exception:  # noqa: BLE001
                return _UNKNOWN
        return _UNKNOWN

    def value(self, node):
        """The live object an expression names, where it is a name or attribute path."""
        if isinstance(node, ast.Name):
            for space in (self.locals, self.globals, vars(builtins)):
                if node.id in space:
                    return space[node.id]
            return None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in self.types:
                return None
            base = self.value(node.value)
            if isinstance(base, (types.ModuleType, type)):
                return getattr(base, node.attr, None) if not isinstance(base, types.ModuleType) else \
                    getattr(base, node.attr, None) or sys.modules.get(f"{base.__name__}.{node.attr}")
        return None

    def receiver(self, node) -> tuple[type | None, str]:
        """The class of `self` (a virtual call), `super()`, a local made here, or `self.x` made by the
        owner."""
        if isinstance(node, ast.Name):
            if node.id in ("self", "cls") and self.owner is not None:
                return self.owner, "self"
            return self.types.get(node.id), "made"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and self.owner:
            return self.owner, "super"
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and self.owner is not None):
            for klass in self.owner.__mro__:
                if (klass, node.attr) in self.scan.attr_types:
                    return self.scan.attr_types[(klass, node.attr)], "made"
        return None, ""

    def expr(self, node):
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Dict) and _backend_table(n, self.scan.backend):
                stack += [v for k, v in zip(n.keys, n.values) if k.value == self.scan.backend]
                continue
            if isinstance(n, ast.Call):
                made = self.value(n.func)
                if isinstance(made, type):
                    self.scan.instantiate(made, self.via(n))
                elif _stand_in_op(made):
                    self.scan.failed.append({"module": made.__name__, "error": "calls an op that the sgl_kernel "
                                             "stand-in lacks (it raises)", "where": self.where(n), "chain": self.chain()})
            if isinstance(n, ast.Attribute):
                cls, kind = self.receiver(n.value)
                if cls is not None:
                    self.scan.method(cls, n.attr, self.via(n), on_self=kind == "self", on_super=kind == "super")
            if isinstance(n, (ast.Name, ast.Attribute)):
                target = self.value(n)
                if isinstance(target, (types.FunctionType, staticmethod, classmethod)):
                    self.scan.function(target, self.via(n))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.stmts([n])
                continue
            if isinstance(n, ast.Lambda):
                stack.append(n.body)
                continue
            if isinstance(n, ast.Compare):  # `backend is some_function` names it without calling it
                stack += [x for x in (n.left, *n.comparators) if not isinstance(x, (ast.Name, ast.Attribute))]
                continue
            stack += list(ast.iter_child_nodes(n))


def _backend_table(n: ast.Dict, backend: str) -> bool:
    """A dict keyed by backend names (three or more string keys, the chosen backend among them)."""
    keys = [k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return bool(backend) and len(keys) == len(n.keys) and backend in keys and len(keys) >= 3


def _catches_import_error(t: ast.Try) -> bool:
    for handler in t.handlers:
        types_ = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(x, ast.Name) and x.id in ("ImportError", "ModuleNotFoundError",
                                                                              "Exception") for x in types_):
            return True
    return False


def _resolve(path: str):
    module, _, qual = path.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _exists(key: str) -> bool:
    """A skipped key still names a module, a function, or an import inside a function."""
    target, _, imported = key.partition(" -> ")
    try:
        obj = _resolve(target) if ":" in target else importlib.import_module(target)
    except ImportError:
        return False
    if obj is None or not imported:
        return obj is not None
    try:
        return imported in inspect.getsource(obj)
    except (OSError, TypeError):
        return False


def _stand_in_op(obj) -> bool:
    """An attribute of specforge_k25's sgl_kernel stand-in: an op that raises when called."""
    return isinstance(obj, types.FunctionType) and "_MissingKernelModule" in obj.__qualname__


class _OnTheImage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Packages the target machine has but this one lacks: modules whose every attribute is a
    MagicMock, so that an import goes on to what that machine really lacks."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__getattr__ = [], lambda name: mock.MagicMock(name=f"{spec.name}.{name}")
        return module

    def exec_module(self, module):
        pass


def _owner(path: str) -> type | None:
    owner = _resolve(path.rpartition(".")[0]) if "." in path.partition(":")[2] else None
    return owner if isinstance(owner, type) else None
