"""Workaround 5: SGLang `SGLANG_VERSION` on CUDA without the `sgl_kernel` wheel (a bare GPU image;
benchmarks/gpu_e2e.py). `apply_gpu()` installs it, only where the real package is absent.

What SGLang needs: on CUDA it imports `sgl_kernel` names at module load (layernorm.py, activation.py,
sampler.py) and three submodules: `quantization` (layers/quantization/gguf.py), `kvcacheio`
(mem_cache/memory_pool_host.py), `utils.is_arch_support_pdl` (layers/attention/triton_backend.py,
called in TritonAttnBackend.__init__: ours says False).
What it does: the stand-in of sgl_kernel_stand_in.py for those, whose ops raise, so nothing may call
them: SGLANG_FORCE_FUSED_OP_BACKEND=torch sends RMSNorm, SiluAndMul, rope and TopK to forward_native
(kernels/fused_op.py BaseFusedOp.forward); SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 skips the
`sglang-kernel` assertion (entrypoints/engine.py _set_envs_and_config -> utils/common.py
assert_pkg_version); the default attention backend becomes triton (arg_groups/model_override_base.py
get_default_attn_backend picks fa3 on Hopper, from sgl_kernel.flash_attn, trtllm or flashinfer).
Three more pieces, each reached only once an engine builds or captures (imports inside functions),
need what a bare image lacks:
a. `cutlass` (nvidia-cutlass-dsl): every LlamaMLP builds a DualGemm (srt/models/llama.py) whose mode
   selection on CUDA imports kernels/ops/gemm/cutedsl_dual_gemm.py (srt/layers/dual_gemm.py
   DualGemm._select_mode). That kernel runs on SM100 only (can_use_dual_gemm), so elsewhere SGLang
   takes the plain path (gate_up_proj, SiluAndMul, down_proj) anyway: without cutlass we select it
   directly (mode None) and the fused call, never allowed then, raises.
b. `flash_mla`: with CUDA graphs on, the EAGLE worker imports srt/layers/attention/
   flashmla_backend.py for isinstance checks (speculative/eagle_worker_v2.py), which imports
   flash_mla. Without it that module is a stand-in whose backend classes raise if built.
c. The prefill CUDA graph defaults to "breakable" on CUDA (model_executor/cuda_graph_config.py
   default_prefill_backend); its capture calls sgl_kernel.weak_ref_tensor (runner_backend_utils/
   weak_ref_tensor.py), which no stand-in can provide. The default becomes "disabled", as
   `disable_prefill_cuda_graph`; decode graphs and an explicit prefill backend are unaffected.

Checked by tests/target_engine/sglang_cpu_compat/test_compat_gpu_image.py, SGLang's CUDA import and
build paths run on this CPU machine with torch saying CUDA is there: `test_gpu_stand_in_needed`,
`test_gpu_stand_in_works`, `test_gpu_stand_in_only_without_the_real_package`, and for 5a-c
`test_gpu_lazy_imports_needed` and `test_gpu_lazy_imports_workarounds_work`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

from .version import SGLANG_VERSION
from .hooks import patch_when_imported
from .sgl_kernel_stand_in import _StandInFinder

GPU_STAND_IN_SUBMODULES = ("quantization", "kvcacheio", "utils")  # workaround 5
GPU_ATTENTION_BACKEND = "triton"  # the CUDA attention backend that needs no sgl_kernel op
FLASHMLA_MODULE = "sglang.srt.layers.attention.flashmla_backend"  # workaround 5b


def _default_attention_without_sgl_kernel(model_override_base) -> None:
    # only the default: an explicit attention_backend is still honoured by SGLang
    model_override_base.get_default_attn_backend = lambda server_args, use_mla, model_config: GPU_ATTENTION_BACKEND


def _plain_mlp_without_cutlass(dual_gemm_module) -> None:  # workaround 5a
    def fused_call(self, x, gate_up_proj):
        raise NotImplementedError(f"the cutlass dual GEMM was called without nvidia-cutlass-dsl (sglang "
                                  f"{SGLANG_VERSION}; specforge_k25 selects the plain MLP path)")

    dual_gemm_module.DualGemm._select_mode = lambda self, gate_up_proj, hidden_size: None
    dual_gemm_module.DualGemm.__call__ = fused_call


class _NeedsFlashMLA:  # workaround 5b
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} needs flash_mla (sglang {SGLANG_VERSION}); "
                                  f"specforge_k25's stand-in only answers isinstance checks")


def _flashmla_stand_in() -> types.ModuleType:
    module = types.ModuleType(FLASHMLA_MODULE, "specforge_k25 stand-in: flash_mla is not installed")
    for name in ("FlashMLABackend", "FlashMLAMultiStepDraftBackend"):
        setattr(module, name, type(name, (_NeedsFlashMLA,), {"__module__": __name__}))
    return module


def _no_prefill_graph_by_default(cuda_graph_config) -> None:  # workaround 5c
    cuda_graph_config.default_prefill_backend = lambda: cuda_graph_config.Backend.DISABLED


def install(dual_gemm: bool = True, flashmla: bool = True, prefill_graph: bool = True) -> None:
    """Workaround 5 in this process; `apply_gpu` has found no real `sgl_kernel`. 5a and 5b apply only
    where their package is missing too."""
    sys.meta_path.insert(0, _StandInFinder(  # is_arch_support_pdl: False (PDL only overlaps kernel launches)
        "gpu", "SGLANG_FORCE_FUSED_OP_BACKEND=torch and the triton attention backend expected",
        GPU_STAND_IN_SUBMODULES, {"sgl_kernel.utils": {"is_arch_support_pdl": lambda: False}}))
    os.environ["SGLANG_FORCE_FUSED_OP_BACKEND"] = "torch"
    os.environ["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] = "1"
    patch_when_imported("sglang.srt.arg_groups.model_override_base", _default_attention_without_sgl_kernel)
    if dual_gemm and importlib.util.find_spec("cutlass") is None:
        patch_when_imported("sglang.srt.layers.dual_gemm", _plain_mlp_without_cutlass)
    if flashmla and importlib.util.find_spec("flash_mla") is None:  # found before any finder runs
        sys.modules.setdefault(FLASHMLA_MODULE, _flashmla_stand_in())
    if prefill_graph:
        patch_when_imported("sglang.srt.model_executor.cuda_graph_config", _no_prefill_graph_by_default)
