"""The SGLang engine's side of the memory plan, counted as SGLang 0.5.23 counts it: the tokens of
one extend (its chunked prefill), the KV pages of its attention backend, the activations that grow
with an extend's tokens; and the trainer's NCCL buffers, which no SGLang setting covers.

Sources (SGLang's paths relative to `sglang/` in the venv's site-packages):
- chunk: SGLang's server never runs an extend longer than `chunked_prefill_size`, which it sets from
  the GPU's memory when unset (srt/arg_groups/memory_hook.py:88-170: < 20 GiB 2048, < 60 GiB 4096,
  < 160 GiB 8192, else 16384; the memory is nvidia-smi's total in MiB, srt/utils/common.py:990-1017).
  RTX PRO 6000 (97,887 MiB): 8192; B300 (275,040 MiB): 16384 (tests/plan/test_engine_memory.py
  resolves SGLang's ServerArgs with those memories).
- pages: target_engine/pages.py (trtllm_mla on sm100/sm103 pages by 64).
- activations: one DeepSeek-V3 decoder layer of SGLang's (srt/models/deepseek_v2.py) at a time: the
  residual stream (hidden + residual, fused add-RMSNorm), then either MLA attention's projections
  (q_a latent, q per head, kv_a latent + rope key, kv_b's k_nope/v per head, the prefill's k and v
  per head, the attention output, o_proj's output before its all-reduce) or the MoE's (router
  logits fp32, top-k ids and weights, the experts' gate/up and down intermediates, the output): the
  larger of the two counts. Marlin's intermediates are their own item (plan/kernels.py).
"""
from __future__ import annotations

from typing import Optional

from ..target_engine.pages import PAGED_BACKENDS
from .facts import MiB, TargetFacts
from .kernels import MARLIN, SM100_FAMILY, int4_moe_backend


def sglang_chunked_prefill_size(gpu_memory_mib: int) -> int:
    """SGLang's chunked_prefill_size for a GPU of `gpu_memory_mib` (memory_hook.py:88-170)."""
    for below, chunk in ((20 * 1024, 2048), (60 * 1024, 4096), (160 * 1024, 8192)):
        if gpu_memory_mib < below:
            return chunk
    return 16384


def prefill_chunk(hw) -> Optional[int]:
    """Tokens of one target extend: hw.target_prefill_chunk, else on cuda SGLang's own
    chunked_prefill_size for the GPU (hw.gpu_memory_mib), else (cpu) the whole batch in one."""
    if hw.target_prefill_chunk is not None:
        return hw.target_prefill_chunk
    if hw.device == "cuda" and hw.gpu_memory_mib > 0:
        return sglang_chunked_prefill_size(hw.gpu_memory_mib)
    return None


def attention_backend(hw, facts: TargetFacts) -> Optional[str]:
    """The target's attention backend: hw.target_attention_backend, else SGLang's choice where the
    plan depends on it (trtllm_mla for MLA on sm100/sm103: model_overrides/deepseek_v2.py:179-185)."""
    if hw.target_attention_backend:
        return hw.target_attention_backend
    if hw.device == "cuda" and facts.is_mla and (hw.gpu_arch or "").lower() in SM100_FAMILY:
        return "trtllm_mla"
    return None


def kv_page_size(hw, facts: TargetFacts) -> int:
    """Tokens per KV page of the target's engine (1: unpaged)."""
    return PAGED_BACKENDS.get(attention_backend(hw, facts) or "", 1) if hw.device == "cuda" else 1


def run_page_size(hw, model_path) -> int:
    """`kv_page_size` of a run's target folder (cpu: 1, nothing read)."""
    if hw.device != "cuda":
        return 1
    from .facts import facts_from_folder

    return kv_page_size(hw, facts_from_folder(model_path))


def extend_tokens(hw, batch_tokens: int) -> int:
    """Tokens of the largest extend a target batch of `batch_tokens` runs (one chunk, at most)."""
    chunk = prefill_chunk(hw)
    return batch_tokens if chunk is None else min(batch_tokens, chunk)


def activation_parts(facts: TargetFacts, tokens: int, tp: int, elem: int = 2, moe: Optional[str] = None
                     ) -> dict[str, int]:
    """Bytes one TP rank's forward of `tokens` holds at its peak layer, by part (module docstring):
    {"residual stream", "attention", "moe"}; the peak is the residual stream + the larger of the other
    two. `moe`: the INT4 experts' kernels (plan/kernels.py); Marlin's intermediates are counted apart."""
    H = facts.hidden_size
    heads = max(1, facts.num_attention_heads // tp)
    if facts.is_mla:
        nope, rope, v = facts.qk_nope_head_dim or 128, facts.qk_rope_head_dim, facts.v_head_dim or 128
        per_token = ((facts.q_lora_rank or 0) + heads * (nope + rope)  # q_a latent, q
                     + facts.kv_lora_rank + rope  # kv_a: latent + rope key
                     + heads * (nope + v)  # kv_b: k_nope, v
                     + heads * (nope + rope) + heads * v  # the prefill's k and v
                     + heads * v + H)  # attention output, o_proj output
    else:
        kv_heads = max(1, -(-facts.num_key_value_heads // tp))
        per_token = heads * facts.head_dim * 2 + 2 * kv_heads * facts.head_dim + H  # q, out; k, v; o_proj
    attention = tokens * per_token * elem
    if facts.num_moe_layers and facts.n_routed_experts:
        n = -(-facts.moe_intermediate_size // tp)
        k = facts.num_experts_per_tok
        experts = 0 if moe == MARLIN else tokens * k * 3 * n * elem  # gate/up [2N] + down input [N] per choice
        shared = tokens * 3 * n * facts.n_shared_experts * elem
        moe_bytes = tokens * (facts.n_routed_experts * 4 + k * 8 + H * elem) + experts + shared
    else:
        moe_bytes = tokens * 3 * -(-facts.intermediate_size // tp) * elem + tokens * H * elem
    return {"residual stream": 2 * tokens * H * elem, "attention": attention, "moe": moe_bytes}


def extend_activation_bytes(hw, facts: TargetFacts, tokens: int) -> int:
    """The peak of `activation_parts` for an extend of `tokens` on one TP rank of `hw`."""
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4
    parts = activation_parts(facts, tokens, hw.target_tp, elem, int4_moe_backend(hw, facts))
    return parts["residual stream"] + max(parts["attention"], parts["moe"])


def activation_note(hw, facts: TargetFacts, tokens: int) -> str:
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4
    parts = activation_parts(facts, tokens, hw.target_tp, elem, int4_moe_backend(hw, facts))
    shown = ", ".join(f"{name} {b / MiB:,.0f} MiB" for name, b in parts.items())
    return f"{tokens} tokens per extend: {shown} (residual + the larger of attention and MoE)"


# NCCL's default NCCL_BUFFSIZE (4 MiB, docs.nvidia.com/deeplearning/nccl, "Environment Variables"):
# the SIMPLE protocol's buffer of each connection of each channel
NCCL_BUFFSIZE = 4 * MiB
P2P_CHANNELS_PER_PEER = 2


def nccl_buffer_bytes(channels: int, peers: int, communicators: int = 1) -> int:
    """The model of a trainer rank's NCCL buffers: per communicator, `channels` x `peers` connections
    (a ring's send and receive neighbours: 2) x NCCL_BUFFSIZE. LL/LL128 buffers and NVLS multicast
    memory are not counted (NVLS is what SGLang turns off in its own process: NCCL_NVLS_ENABLE=0,
    srt/entrypoints/engine.py:1908-1915)."""
    return communicators * channels * peers * NCCL_BUFFSIZE


def trainer_nccl_bytes(hw, ranks: int, context_parallel: int) -> tuple[int, str]:
    """(bytes, note) of one trainer rank's NCCL buffers on its GPU: none with one rank or off cuda;
    the world group's communicator (FSDP2's all-gathers and reduce-scatters, the vocab split); with
    context parallelism its group's communicator, whose all-to-all connects every peer."""
    if hw.device != "cuda" or ranks <= 1:
        return 0, ""
    ch = hw.trainer_nccl_channels
    world = nccl_buffer_bytes(ch, 2)
    # all-to-all connects every peer, over NCCL's point-to-point channels: assumed 2 per peer
    # (NCCL_NCHANNELS_PER_NET_PEER's default), a send and a receive buffer each
    cp = nccl_buffer_bytes(P2P_CHANNELS_PER_PEER, 2 * (context_parallel - 1)) if context_parallel > 1 else 0
    note = (f"{ch} channels (hw.trainer_nccl_channels) x 2 ring connections x NCCL_BUFFSIZE 4 MiB"
            + (f" + the context-parallel group's all-to-all: {P2P_CHANNELS_PER_PEER} x 2 x {context_parallel - 1} "
               f"peers x 4 MiB" if cp else ""))
    return world + cp, note


def nccl_note(hw) -> str:
    """What the plan says about NCCL in the trainer's processes."""
    return ("trainer NCCL: NCCL's defaults in the trainer's processes (SGLang sets NCCL_CUMEM_ENABLE=0 and "
            "NCCL_NVLS_ENABLE=0 in its own process only: sglang/srt/entrypoints/engine.py:1898-1915); the plan counts "
            "each communicator's NCCL_BUFFSIZE buffers; on NVSwitch (B300) export NCCL_NVLS_ENABLE=0 for the trainer "
            "too, or NVLS multicast buffers come on top")


def engine_notes(hw, facts: TargetFacts, batch_tokens: int, page: int) -> list[str]:
    """The plan's lines on the engine's extend and pages."""
    chunk = prefill_chunk(hw)
    source = ("hw.target_prefill_chunk" if hw.target_prefill_chunk is not None else
              f"SGLang's chunked_prefill_size for {hw.gpu_memory_mib} MiB GPUs")
    lines = []
    if hw.device == "cuda":
        lines.append(f"target prefill: {batch_tokens}-token batches in extends of at most {chunk} tokens ({source}); "
                     + activation_note(hw, facts, extend_tokens(hw, batch_tokens)))
        backend = attention_backend(hw, facts) or "SGLang's choice"
        lines.append(f"KV pages: {page} token(s) per page ({backend}); a sequence takes whole pages, the pool is "
                     f"whole pages, a chunk ends on a page boundary (target_engine/pages.py)")
    return lines
