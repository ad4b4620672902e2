"""The import-hook machinery the workarounds share (no workaround of its own).

SGLang's modules must be patched as they load, before other SGLang modules take names from them:
`patch_when_imported` runs a patch right after a module is executed (or at once if it already
was); `_run_inside` wraps methods of an SGLang class so that they run inside a context manager.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after SGLang's module `target` is executed (once)."""

    def __init__(self, target: str, patch):
        self.target, self.patch = target, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def patch_when_imported(target: str, patch) -> None:
    """Run `patch(module)` on SGLang's module `target` now if imported, else right after its import."""
    module = sys.modules.get(target)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _PostImportHook(target, patch))


def _run_inside(context, cls, *names) -> None:
    """Each named method of `cls` runs inside `context()` (SGLang's own stays reachable as `__wrapped__`)."""
    for name in names:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapped(self, *args, _original=original, **kwargs):
            with context():
                return _original(self, *args, **kwargs)

        setattr(cls, name, wrapped)
