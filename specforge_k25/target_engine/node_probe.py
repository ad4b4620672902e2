"""What a GPU node has installed, looked up as SGLang and FlashInfer look for it: CUDA, nvcc, the
sglang-kernel wheel's ops, FlashInfer's kernel binaries. Lives in the target package because only
it may import SGLang's kernels (tests/test_architecture.py); the plan asks it (plan/kernels.py)."""
from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class NodeProbe:
    """What the node has installed, as SGLang and FlashInfer look for it (replaceable in tests)."""

    cuda_available: Callable[[], bool] = lambda: _cuda_available()
    nvcc: Callable[[], Optional[str]] = lambda: _nvcc()
    has_module: Callable[[str], bool] = lambda name: _has_module(name)
    sgl_kernel_names: Callable[[], Optional[set]] = lambda: _sgl_kernel_names()
    cubin_status: Callable[[], str] = lambda: _cubin_status()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _nvcc() -> Optional[str]:
    """nvcc as SGLang's JIT finds it (kernels/jit/utils/arch.py): CUDA_HOME / CUDA_PATH, else the one
    on PATH, else /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        path = os.path.join(home, "bin", "nvcc")
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None


def _sgl_kernel_names() -> Optional[set]:
    """Names the installed sgl_kernel offers (None: not installed). Our GPU stand-in for a bare image
    (target_engine/sglang_cpu_compat/gpu_image.py) is not on the path here, so this sees the real wheel only."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return None
    import sgl_kernel

    names = set(dir(sgl_kernel))
    if importlib.util.find_spec("sgl_kernel.scalar_type") is not None:
        names.add("scalar_type")
    return names


def _cubin_status() -> str:
    if os.environ.get("FLASHINFER_CUBIN_DIR"):
        return "installed"
    if importlib.util.find_spec("flashinfer_cubin") is None:
        return "flashinfer-cubin not installed"
    try:
        from importlib.metadata import version

        ours, theirs = version("flashinfer-cubin"), version("flashinfer-python")
    except Exception:
        return "installed"
    return "installed" if ours == theirs else f"flashinfer-cubin {ours} does not match flashinfer {theirs}"
