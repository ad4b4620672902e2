"""Workarounds that let stock SGLang run on a CPU-only machine (tests + embedded default), and on
a CUDA machine that lacks the `sgl_kernel` wheel (workaround 5, `apply_gpu`).

Applies to the pinned sglang (`SGLANG_VERSION`, written in version.py only) with torch 2.13.0
(CPU build), `attention_backend="torch_native"`. Workarounds 1-4 and 6-8 are never used on GPU
machines. One module per workaround, each saying what SGLang lacks, why the workaround exists, what
it does and which test (tests/target_engine/sglang_cpu_compat/) fails when it stops being needed or
stops working, so a version bump forces a review of each:

1. sgl_kernel_stand_in.py  a stand-in `sgl_kernel` (CPU mode imports it; its wheels are CUDA-only).
2. mla_torch_native.py     torch_native -> MLA for DeepSeek attention (else prefill is silently wrong).
3. deepseek_config.py      `check_deepseek_config`: YaRN rope and `moe_layer_freq`, a clear error.
4. EAGLE-3 speculative decoding on CPU (specforge_k25.eval): spec_ops.py, pure-torch versions of the
   `sgl_kernel.*_cpu` ops it calls (carried by the stand-in); draft_backends.py, torch_native
   draft-decode backends for chain drafts; target_verify.py, TARGET_VERIFY through torch_native.
5. gpu_image.py            CUDA without the sgl_kernel wheel (a bare image): the stand-in, fused ops
   sent to torch, triton attention, and (a) no cutlass, (b) no flash_mla, (c) no prefill graph.
6. mla_draft_sync.py       the MLA draft's `set_embed*` without torch.cuda.synchronize on CPU.
7. dflash_on_cpu.py        DFLASH speculative decoding on CPU (four patches).
8. fork_subprocesses.py    an engine's scheduler and detokenizer forked, not spawned (CPU: ~26 CPU s
   less per engine).
version.py holds SGLANG_VERSION, hooks.py the import hooks they share.

Call `apply()` (CPU) or `apply_gpu()` (CUDA) in every process that builds an SGLang model,
before importing sglang.
"""
from __future__ import annotations

import importlib.util
import os

from . import (
    deepseek_config,
    dflash_on_cpu,
    draft_backends,
    fork_subprocesses,
    gpu_image,
    mla_draft_sync,
    mla_torch_native,
    sgl_kernel_stand_in,
    spec_ops,
    target_verify,
)
from .deepseek_config import check_deepseek_config  # noqa: F401  (specforge_k25.setup calls it)
from .gpu_image import GPU_ATTENTION_BACKEND  # noqa: F401
from .hooks import patch_when_imported  # noqa: F401
from .version import SGLANG_VERSION  # noqa: F401

_applied = False
_gpu_applied = False

# Every workaround module, and what puts it to use. apply() calls `install()` of each CPU entry in
# this order unless its switch (tests only) is False; apply_gpu() calls `install(...)` of the GPU one.
CPU_WORKAROUNDS = (
    (sgl_kernel_stand_in, None),  # 1, with the ops of 4 (spec_ops) as its attributes
    (mla_torch_native, "mla_fix"),  # 2
    (draft_backends, "spec_patches"),  # 4
    (target_verify, "spec_patches"),  # 4
    (mla_draft_sync, None),  # 6
    (dflash_on_cpu, "dflash_patches"),  # 7
    (fork_subprocesses, "fork_engines"),  # 8
)
GPU_WORKAROUNDS = (gpu_image,)  # 5
# installed by no apply: spec_ops through the stand-in, deepseek_config called by specforge_k25.setup
USED_THROUGH_OTHERS = (spec_ops, deepseek_config)


def apply(mla_fix: bool = True, spec_patches: bool = True, dflash_patches: bool = True,
          fork_engines: bool = True) -> None:
    """Install the workarounds in this process (idempotent). `False` switches are for tests."""
    global _applied
    if _applied:
        return
    if _gpu_applied:
        raise RuntimeError("sglang_cpu_compat.apply_gpu() already ran in this process (CUDA)")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    switches = {"mla_fix": mla_fix, "spec_patches": spec_patches, "dflash_patches": dflash_patches,
                "fork_engines": fork_engines}
    for module, switch in CPU_WORKAROUNDS:
        if switch is None or switches[switch]:
            module.install()
    _applied = True


def apply_gpu(dual_gemm: bool = True, flashmla: bool = True, prefill_graph: bool = True) -> bool:
    """Workaround 5 in this process, on CUDA, only when the real `sgl_kernel` is not installed
    (idempotent). Returns whether the stand-in is in use. Set before sglang is imported: the
    attention default is patched as its module loads, before others import the name. 5a and 5b
    apply only where their package is missing too. `False` switches are for tests."""
    global _gpu_applied
    if _applied:
        raise RuntimeError("sglang_cpu_compat.apply() (CPU) already ran in this process")
    if _gpu_applied:
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False  # a real GPU install: nothing to do
    for module in GPU_WORKAROUNDS:
        module.install(dual_gemm, flashmla, prefill_graph)
    _gpu_applied = True
    return True
