"""Which MoE kernels SGLang 0.5.23 runs a target's INT4 experts with on a GPU profile, what they add
to a TP rank's memory, and what they need installed on the node.

SGLang's choice for compressed-tensors INT4 experts (layers/quantization/compressed_tensors/
compressed_tensors.py, `get_moe_scheme`): on sm100/sm103 (B200, B300) the DeepSeek-family override
(arg_groups/overrides.py, `_deepseek_moe_quant_resolution`) sets moe_runner_backend=flashinfer_trtllm
for Kimi's group-32 INT4, so the experts run FlashInfer's trtllm MxInt4 MoE (bf16 activations only;
prebuilt kernel binaries, fetched from NVIDIA at first use unless installed); on every other arch
(sm80/sm90, sm120 RTX PRO 6000) the Marlin WNA16 MoE (`CompressedTensorsWNA16MoE`), whose kernels
are compiled at run time with nvcc (sglang.kernels.jit) and which calls `sgl_kernel.moe_sum_reduce`
and `sgl_kernel.scalar_type` from the prebuilt sglang-kernel wheel.
"""
from __future__ import annotations

import os
from typing import Optional

from ..target_engine.node_probe import NodeProbe, nvcc_problem
from .facts import TargetFacts

MARLIN = "marlin"
TRTLLM = "flashinfer_trtllm"
SM100_FAMILY = ("sm100", "sm103")


def int4_moe_backend(hw, facts: TargetFacts) -> Optional[str]:
    """The MoE kernels SGLang runs `facts`' INT4 experts with on `hw` (None: no INT4 experts, or
    not on CUDA). An unknown hw.gpu_arch counts as Marlin: every arch but sm100/sm103 runs it."""
    if hw.device != "cuda" or not facts.int4_experts:
        return None
    return TRTLLM if (hw.gpu_arch or "").lower() in SM100_FAMILY and facts.quant_group_size == 32 else MARLIN


def marlin_scratch_bytes(facts: TargetFacts, tokens: int, tp: int, elem: int = 2) -> int:
    """What `fused_marlin_moe` (layers/moe/fused_moe_triton/fused_marlin_moe.py) allocates per MoE
    layer call for a batch of `tokens` not chunked: intermediate_cache13, M x topk x max(2N, H), and
    intermediate_cache2, M x topk x N, in the activation dtype (N = the expert width on one TP rank,
    H = hidden size). Kimi-K2.5 at TP8: 16,384 x 8 x (7168 + 256) x 2 B = 1.95 GB."""
    n = -(-facts.moe_intermediate_size // tp)
    return tokens * facts.num_experts_per_tok * (max(2 * n, facts.hidden_size) + n) * elem


def kernel_notes(hw, facts: TargetFacts) -> list[str]:
    """What the plan says about the INT4 experts' kernels on `hw` (nothing probed)."""
    backend = int4_moe_backend(hw, facts)
    if backend is None:
        return []
    arch = hw.gpu_arch or "an unknown arch (hw.gpu_arch unset: assumed not sm100/sm103)"
    if backend == MARLIN:
        needs = ("a CUDA toolkit with nvcc on the node (SGLang compiles the Marlin MoE kernels at run time) and "
                 "the sglang-kernel wheel (sgl_kernel.moe_sum_reduce, sgl_kernel.scalar_type)")
    else:
        needs = ("bf16 and flashinfer's trtllm MoE kernel binaries (flashinfer-cubin of flashinfer's version, "
                 "or FLASHINFER_CUBIN_DIR; else downloaded at first use, which an offline node cannot)")
    return [f"INT4 experts on {arch}: SGLang runs {backend} MoE; needs {needs}; checked on the node at start"]


def kernel_problems(hw, facts: TargetFacts, probe: NodeProbe | None = None) -> list[str]:
    """Why SGLang could not run the INT4 experts on this node: the target dtype always; what is
    installed only when this runs on a CUDA machine (the node itself; a plan printed elsewhere says
    what to install in `kernel_notes`)."""
    backend = int4_moe_backend(hw, facts)
    if backend is None:
        return []
    probe = probe or NodeProbe()
    problems = []
    dtypes = ("bfloat16",) if backend == TRTLLM else ("bfloat16", "float16")
    if hw.target_dtype not in dtypes:
        problems.append(f"hw.target_dtype={hw.target_dtype}: SGLang runs INT4 experts ({backend}) in "
                        f"{' or '.join(dtypes)} only: set hw.target_dtype=bfloat16")
    if not probe.cuda_available():
        return problems
    if backend == MARLIN:
        nvcc = nvcc_problem(probe, hw.gpu_arch)
        if nvcc is not None:
            problems.append(f"{nvcc}: SGLang compiles its Marlin MoE kernels for the INT4 experts at run time; "
                            f"install a CUDA toolkit that has it")
        try:
            names = probe.sgl_kernel_names()
        except Exception as err:  # the wheel is there but does not load
            names, why = set(), f"sgl_kernel does not import ({type(err).__name__}: {err})"
        else:
            why = "the sglang-kernel wheel is not installed" if names is None else "not the sglang-kernel wheel"
        missing = [n for n in ("moe_sum_reduce", "scalar_type") if n not in (names or set())]
        if missing:
            problems.append(f"sgl_kernel.{', sgl_kernel.'.join(missing)} missing ({why}): the Marlin MoE of the "
                            f"INT4 experts calls them; pip install sglang-kernel")
    else:
        if not probe.has_module("flashinfer"):
            problems.append("flashinfer is not installed: SGLang's trtllm MxInt4 MoE of the INT4 experts needs it")
        status = probe.cubin_status()
        if status != "installed" and os.environ.get("FLASHINFER_NO_DOWNLOAD"):
            problems.append(f"flashinfer kernel binaries: {status}, and FLASHINFER_NO_DOWNLOAD is set: "
                            f"pip install flashinfer-cubin==<flashinfer's version>")
    return problems
