"""SGLang's (pinned 0.5.23) CUDA path in benchmarks/gpu_e2e.py, for tests/benchmarks/import_reach.py.

Run as `python tests/benchmarks/sglang_cuda_path.py [switch=0 ...]` in a process that sees only the H200
image's packages and the carried wheels (tests/fixtures/gpu_image_site, SPECFORGE_GPU_IMAGE_ONLY=1):
torch reports CUDA as present (an H200), specforge_k25.target_engine.sglang_cpu_compat.apply_gpu() is in
place (switches turn parts of it off: `dual_gemm=0`), and the functions that the check's engines run
(ROOTS) are walked for imports the image lacks. Importing SGLang's modules runs their module-level
imports for real; the walk adds the imports inside functions, which only run on the GPU. Code the
workaround replaced is specforge_k25's, not SGLang's, and is not walked.
Prints one line `SCAN {json}`: the failed imports (module, error, SGLang file:line, the chain of calls
that reaches it), the number of functions walked and the seconds the walk took.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_reach import Reach  # noqa: E402

# SGLang modules imported before the walk (module level only): what the engines load at start
IMPORTS = ("sglang.srt.entrypoints.engine", "sglang.benchmark.one_batch", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
           "sglang.srt.function_call.function_call_parser", "sglang.kernels.ops.kvcache.kvcache")

ROOTS = (  # "module:Class" is made (its __init__, forward, ...), "module:function" or "module:Class.method" runs
    # d) sglang.Engine, through specforge_k25.target_engine.sglang_spec: its scheduler process and the batches it runs
    "sglang.srt.entrypoints.engine:Engine",
    "sglang.srt.entrypoints.engine:Engine.generate",
    "sglang.srt.managers.scheduler:run_scheduler_process",
    "sglang.srt.managers.scheduler:Scheduler.run_batch",
    "sglang.srt.managers.tp_worker:TpModelWorker",
    "sglang.srt.managers.tp_worker:TpModelWorker.forward_batch_generation",
    "sglang.srt.managers.tp_worker:TpModelWorker.init_cuda_graphs",
    "sglang.srt.model_executor.model_runner:ModelRunner",
    "sglang.srt.model_executor.model_runner:ModelRunner.forward",
    "sglang.srt.models.llama:LlamaForCausalLM",  # the random SmolLM2-shaped target
    "sglang.srt.models.llama:LlamaForCausalLM.load_weights",
    "sglang.srt.models.llama_eagle3:LlamaForCausalLMEagle3",  # the exported draft
    "sglang.srt.models.llama_eagle3:LlamaForCausalLMEagle3.load_weights",
    "sglang.srt.layers.attention.attention_registry:create_triton_backend",  # apply_gpu's default backend
    "sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2",
    "sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2.forward_batch_generation",
    "sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2.init_cuda_graphs",
    "sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker.init_cuda_graphs",
    # d) with CUDA graphs on: decode graphs of the target and of the draft (prefill graphs stay off)
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner:EAGLEDraftCudaGraphRunner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner:EAGLEDraftExtendCudaGraphRunner",
    # a), b), c): the stream's target, specforge_k25.target_engine.sglang_engine
    "sglang.benchmark.one_batch:load_model",
    "sglang.benchmark.one_batch:extend",
)
# On the image (benchmarks/gpu_image_packages.txt) but not in this venv, imported on the path: import
# name -> distribution. Imports of them go on with stand-ins whose attributes are MagicMocks.
IMAGE_ONLY = {"cuda": "cuda-bindings"}
BACKEND = "triton"  # sglang_cpu_compat.GPU_ATTENTION_BACKEND: tables keyed by backend follow this entry only
# What the check's settings keep off, each with the setting. Key: a module (nothing in it is walked),
# "module:function" (not walked), or "module:function -> imported.module" (that import there is not
# tried). A key SGLang no longer has fails the scan, so a version bump reviews the list.
SKIPPED = {
    "sglang.srt.connector:create_remote_connector": "remote model paths (s3://, redis://): a local folder here",
    "sglang.srt.model_executor.model_runner:ModelRunner._recapture_elastic_cuda_graphs": "elastic EP: off",
    "sglang.srt.model_executor.model_runner:ModelRunner._initialize_elastic_ep_joiner": "elastic EP: off",
    "sglang.srt.model_executor.model_runner:ModelRunner.maybe_join_ep_ranks": "elastic EP: off",
    "sglang.srt.model_executor.model_runner:ModelRunner._prepare_replicated_q_proj":
        "decode context parallelism (dcp_replicate_q_proj): off",
    "sglang.srt.model_executor.model_runner:ModelRunner.maybe_init_dwdp": "DWDP (dwdp_size > 1): MoE only",
    "sglang.srt.hardware_backend.npu": "Ascend NPUs",
    "sglang.srt.layers.attention.linear": "GDN / KDA linear attention: hybrid architectures, not Llama",
    "sglang.srt.layers.attention.minimax_sparse_backend": "MiniMax sparse attention: MiniMax models",
    "sglang.srt.distributed.parallel_state:GroupCoordinator.__init__ -> mooncake.pg":
        "torch distributed backend nccl, not mooncake",
    "sglang.srt.distributed.parallel_state:init_distributed_environment -> mooncake.pg":
        "torch distributed backend nccl, not mooncake",
    "sglang.srt.speculative.eagle_utils:eagle_sample -> sglang.srt.speculative.uno_utils": "UNO speculation: off",
    "sglang.srt.speculative.eagle_utils:_can_use_sparse_uno_tree_target_sampling": "UNO speculation: off",
    "sglang.srt.layers.attention.triton_backend:TritonAttnBackend.__init__ -> sglang.srt.dllm.attention":
        "dllm_fa4 (diffusion LLMs): False for create_triton_backend",
    "sglang.srt.model_executor.model_runner:ModelRunner.maybe_init_lora_manager": "LoRA and UNO: off",
    "sglang.srt.managers.multi_tokenizer_mixin:MultiTokenizerRouter": "one tokenizer worker (tokenizer_worker_num 1)",
    "sglang.srt.layers.sampler:Sampler._sample_from_probs": "sampling at temperature > 0: the check decodes greedily",
    "sglang.srt.layers.attention.qwen_sparse_attn_backend": "Qwen sparse attention: Qwen models",
    "sglang.srt.layers.layernorm_sp": "sequence parallelism (sp_active with tp_size > 1): TP 1 here",
    "sglang.srt.model_executor.runner.flashinfer_autotune:flashinfer_autotune_context":
        "flashinfer autotuning: only with a flashinfer MoE runner or flashinfer FP4/FP8 GEMMs",
    "sglang.kernels.jit.utils.arch:_init_jit_cuda_arch_once -> flashinfer.compilation_context":
        "compute capability 10.7 only; the H200 is 9.0",
}
# server arguments named enable_* that the check's engines turn on (specforge_k25.target_engine.sglang_spec and
# sglang_engine); the walk takes every other enable_* as off
ENABLED = {"enable_return_aux_hidden_states"}
PREFILL_GRAPH = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup:capture_prefill_graph"


def fake_cuda() -> None:
    """What SGLang reads to pick its CUDA paths (sglang.srt.utils.is_cuda and the device probes)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.device_count = lambda: 1


def scan(switches: dict) -> dict:
    from specforge_k25.target_engine import sglang_cpu_compat

    fake_cuda()
    assert sglang_cpu_compat.apply_gpu(**switches) and sglang_cpu_compat.GPU_ATTENTION_BACKEND == BACKEND
    for name in IMPORTS:
        __import__(name)
    from sglang.srt.model_executor import cuda_graph_config as graphs

    skipped = dict(SKIPPED)
    if graphs.CudaGraphConfig().prefill.backend == graphs.Backend.DISABLED:  # as this process has it
        skipped[PREFILL_GRAPH] = "prefill CUDA graphs: off by default (sglang_cpu_compat workaround 5c)"
    return Reach("sglang", ROOTS, skipped, ENABLED, BACKEND, IMAGE_ONLY).run()


if __name__ == "__main__":
    print("SCAN " + json.dumps(scan({k: v == "1" for k, v in (a.split("=") for a in sys.argv[1:])})), flush=True)
