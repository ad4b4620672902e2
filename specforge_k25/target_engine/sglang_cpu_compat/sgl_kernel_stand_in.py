"""Workaround 1: a stand-in for `sgl_kernel` (SGLang `SGLANG_VERSION`, CPU; its finder also serves
the GPU image, gpu_image.py).

What SGLang lacks: CPU mode (`SGLANG_USE_CPU_ENGINE=1`) imports `sgl_kernel`, whose PyPI wheels are
CUDA-only, so `sglang.srt.model_executor.model_runner` does not even import on CPU.
Why a stand-in is enough: with torch_native attention and no AMX only a handful of names are imported
at module load and none is called, so a module whose attributes are functions that raise (naming the
op) if ever called will do. On CPU it also carries the pure-torch ops EAGLE-3 decoding calls
(spec_ops.py, workaround 4) as real attributes.
What it does: `install()` puts a meta-path finder for `sgl_kernel` first on `sys.meta_path` (only
where no sgl_kernel is installed, or SPECFORGE_FORCE_SGL_KERNEL_STAND_IN is set), and quiets the
warnings SGLang then logs for model files it skips on CPU.

Checked by `test_sgl_kernel_stand_in_needed_and_working` in
tests/target_engine/sglang_cpu_compat/test_compat_sgl_kernel_stand_in.py
(fails when SGLang imports on CPU without it, or when the stand-in stops covering its imports).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
import warnings

from .version import SGLANG_VERSION
from .spec_ops import SPEC_OPS


class _MissingKernelModule(types.ModuleType):
    """`sgl_kernel` whose every attribute is an op that raises if called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualified, expected = f"{self.__name__}.{name}", getattr(self, "_expected", "")

        def missing_op(*args, **kwargs):
            raise NotImplementedError(
                f"{qualified} was called, but specforge_k25's stand-in for sgl_kernel has no "
                f"implementation (sglang {SGLANG_VERSION}, {expected})"
            )

        missing_op.__name__ = name
        return missing_op


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`sgl_kernel` and the named submodules only: SGLang guards its other `sgl_kernel.<submodule>`
    imports with `except ImportError` fallbacks (e.g. scalar_type), which must keep failing."""

    def __init__(self, kind: str, expected: str, submodules=(), attributes: dict | None = None):
        self.names = {"sgl_kernel", *(f"sgl_kernel.{m}" for m in submodules)}
        self.kind, self.expected, self.attributes = kind, expected, attributes or {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _MissingKernelModule(spec.name)
        module.__path__ = []  # a package with no submodules of its own
        module.__version__ = f"0.0.0+specforge-{self.kind}-stand-in"
        module._expected = self.expected
        for name, value in self.attributes.get(spec.name, {}).items():
            setattr(module, name, value)
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """The CPU stand-in, where the real `sgl_kernel` is not installed (or a test forces it)."""
    if importlib.util.find_spec("sgl_kernel") is None or os.environ.get("SPECFORGE_FORCE_SGL_KERNEL_STAND_IN"):
        # workaround 4: the ops speculative decoding calls
        sys.meta_path.insert(0, _StandInFinder("cpu", "torch_native backend expected",
                                               attributes={"sgl_kernel": {op.__name__: op for op in SPEC_OPS}}))
        # With the stand-in, model files that need kernels absent on CPU fail to import, which
        # SGLang already skips -- but with one WARNING line per model (~20 lines of noise).
        for name in ("sglang.srt.models.registry", "sglang.srt.managers.multimodal_processor"):
            logging.getLogger(name).setLevel(logging.ERROR)
        # ...and import-time UserWarnings that only say "this GPU feature is not on CPU".
        for text in ("Only CUDA", "Triton is not supported on current platform"):
            warnings.filterwarnings("ignore", message=text, category=UserWarning)
