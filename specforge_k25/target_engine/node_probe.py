"""What a GPU node has installed, looked up as SGLang and FlashInfer look for it: CUDA, nvcc, the
sglang-kernel wheel's ops, FlashInfer's kernel binaries. Lives in the target package because only
it may import SGLang's kernels (tests/test_architecture.py); the plan asks it (plan/kernels.py)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional

# The oldest nvcc that compiles an arch's target as SGLang's JIT names it (kernels/jit/utils/arch.py
# 75-99: "a" on sm90 and sm100+; sm120 "f" from nvcc 12.9, else "a", never plain): sm_90a came with
# CUDA 12.0, sm_100a and sm_120a with 12.8, sm_103a with 12.9 (an older nvcc stops with "Unsupported
# gpu architecture 'compute_103a'").
NVCC_FOR_ARCH = {"sm90": (12, 0), "sm100": (12, 8), "sm103": (12, 9), "sm120": (12, 8)}


@dataclass
class NodeProbe:
    """What the node has installed, as SGLang and FlashInfer look for it (replaceable in tests)."""

    cuda_available: Callable[[], bool] = lambda: _cuda_available()
    nvcc: Callable[[], Optional[str]] = lambda: _nvcc()
    nvcc_version: Callable[[str], Optional[tuple]] = lambda path: nvcc_release(path)
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


def parse_nvcc_release(output: str) -> Optional[tuple[int, int]]:
    """(major, minor) of `nvcc --version`'s "release X.Y", as SGLang reads it (kernels/jit/utils/arch.py:60)."""
    match = re.search(r"release (\d+)\.(\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else None


def nvcc_release(path: str) -> Optional[tuple[int, int]]:
    """The CUDA release of the nvcc at `path` (None: it does not run or says no release)."""
    try:
        return parse_nvcc_release(subprocess.run([path, "--version"], capture_output=True, text=True,
                                                 timeout=60).stdout)
    except (OSError, subprocess.SubprocessError):
        return None


def nvcc_problem(probe: "NodeProbe", arch: Optional[str]) -> Optional[str]:
    """Why the node's nvcc cannot compile SGLang's JIT kernels for `arch` (hw.gpu_arch): missing, or
    older than NVCC_FOR_ARCH asks. An arch not in the table, or an nvcc whose release cannot be
    read, is not refused (SGLang then takes torch's CUDA version)."""
    path = probe.nvcc()
    if path is None:
        return "no nvcc on this node (CUDA_HOME, PATH, /usr/local/cuda)"
    need = NVCC_FOR_ARCH.get((arch or "").lower())
    have = probe.nvcc_version(path) if need else None
    if have is not None and have < need:
        return (f"{path} is CUDA {have[0]}.{have[1]}: compiling for {arch} needs nvcc >= {need[0]}.{need[1]} "
                f"(SGLang compiles for sm_{arch[2:]}a/f)")
    return None


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
