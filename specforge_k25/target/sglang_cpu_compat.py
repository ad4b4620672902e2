"""Workarounds that let stock SGLang run on a CPU-only machine (tests + embedded default).

Applies to **sglang==0.5.23** with torch 2.13.0 (CPU build), `attention_backend="torch_native"`.
Nothing here is used on GPU machines. Each workaround states why it exists; the test
`tests/test_sglang_cpu_compat.py` fails if one stops being needed or stops working, so a
version bump forces a review of this file.

1. `sgl_kernel` stand-in. CPU mode (`SGLANG_USE_CPU_ENGINE=1`) imports `sgl_kernel`, whose
   PyPI wheels are CUDA-only. With torch_native attention and no AMX only a handful of names
   are imported at module load and none is called, so a module whose attributes are
   functions that raise (naming the op) if ever called is enough.
2. DeepSeek MLA prefill on torch_native computes wrong numbers: SGLang 0.5.23 registers no
   DeepSeek attention handler for `torch_native`; prefill falls back to the MHA path whose
   k/v torch_native ignores (it reads the latent cache). We register torch_native -> MLA in
   `AttentionBackendRegistry` (exact in fp32 against HF).
3. DeepSeek configs on CPU: the CPU rope path only supports YaRN and the config needs
   `moe_layer_freq`; `check_deepseek_config` turns a violation into a clear error instead of
   a crash deep inside SGLang.

Call `apply()` in every process that builds an SGLang model, before importing sglang.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import importlib.machinery
import logging
import os
import sys
import types
import warnings

SGLANG_VERSION = "0.5.23"
_applied = False


class _MissingKernelModule(types.ModuleType):
    """`sgl_kernel` whose every attribute is an op that raises if called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualified = f"{self.__name__}.{name}"

        def missing_op(*args, **kwargs):
            raise NotImplementedError(
                f"{qualified} was called, but specforge_k25's CPU stand-in for sgl_kernel has no "
                f"implementation (sglang {SGLANG_VERSION}, torch_native backend expected)"
            )

        missing_op.__name__ = name
        return missing_op


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        # Only the top-level name: SGLang guards its `sgl_kernel.<submodule>` imports with
        # `except ImportError` fallbacks (e.g. scalar_type), which must keep failing.
        if fullname == "sgl_kernel":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _MissingKernelModule(spec.name)
        module.__path__ = []  # a package with no submodules
        module.__version__ = "0.0.0+specforge-cpu-stand-in"
        return module

    def exec_module(self, module):
        pass


class _MlaRoutingFinder(importlib.abc.MetaPathFinder):
    """Registers torch_native -> MLA right after SGLang's handler module is executed."""

    TARGET = "sglang.srt.models.deepseek_common.attention_backend_handler"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            register_mla_for_torch_native(module)

        spec.loader.exec_module = exec_module
        return spec


def register_mla_for_torch_native(handler_module) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    handler_module.AttentionBackendRegistry.register("torch_native", lambda attn, batch: AttnForwardMethod.MLA)


def apply(mla_fix: bool = True) -> None:
    """Install the workarounds in this process (idempotent). `mla_fix=False` only for tests."""
    global _applied
    if _applied:
        return
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

    if importlib.util.find_spec("sgl_kernel") is None or os.environ.get("SPECFORGE_FORCE_SGL_KERNEL_STAND_IN"):
        sys.meta_path.insert(0, _StandInFinder())
        # With the stand-in, model files that need kernels absent on CPU fail to import, which
        # SGLang already skips -- but with one WARNING line per model (~20 lines of noise).
        for name in ("sglang.srt.models.registry", "sglang.srt.managers.multimodal_processor"):
            logging.getLogger(name).setLevel(logging.ERROR)
        # ...and import-time UserWarnings that only say "this GPU feature is not on CPU".
        for text in ("Only CUDA", "Triton is not supported on current platform"):
            warnings.filterwarnings("ignore", message=text, category=UserWarning)
    if mla_fix:
        handler = sys.modules.get(_MlaRoutingFinder.TARGET)
        if handler is not None:
            register_mla_for_torch_native(handler)
        else:
            sys.meta_path.insert(0, _MlaRoutingFinder())
    _applied = True


def check_deepseek_config(config) -> None:
    """Reject DeepSeek/Kimi text configs the SGLang CPU path cannot run correctly."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type != "yarn":
        raise ValueError(
            f"sglang {SGLANG_VERSION} on CPU runs DeepSeek models only with YaRN rope "
            f"(rope_scaling.type=yarn, as DeepSeek-V3/Kimi configs have); got {rope_type!r}"
        )
    if getattr(config, "moe_layer_freq", None) is None:
        raise ValueError(f"sglang {SGLANG_VERSION} on CPU needs `moe_layer_freq` in the DeepSeek config (use 1)")
