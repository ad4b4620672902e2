"""Workarounds that let stock SGLang run on a CPU-only machine (tests + embedded default), and on
a CUDA machine that lacks the `sgl_kernel` wheel (workaround 5, `apply_gpu`).

Applies to **sglang==0.5.23** with torch 2.13.0 (CPU build), `attention_backend="torch_native"`.
Workarounds 1-4, 6 and 7 are never used on GPU machines. Each workaround states why it exists; the
test `tests/target_engine/test_sglang_cpu_compat.py` fails if one stops being needed or stops working,
so a version bump forces a review of this file.

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
4. EAGLE-3 speculative decoding (used by `specforge_k25.eval` to let SGLang itself measure the
   acceptance length). On CPU SGLang calls `sgl_kernel.*_cpu` ops where GPUs run Triton
   kernels; the stand-in gets pure-torch versions of the eight it calls (`SPEC_OPS`, tested
   against SGLang's own Triton kernels run by the Triton interpreter). Two patches make the
   `torch_native` attention backend usable for chain drafts (topk=1): the draft-decode backend
   factory knows no `torch_native` (`_patch_draft_backends`), and TARGET_VERIFY batches carry
   no `extend_*` lengths, which torch_native's extend path needs (`_patch_target_verify`).
5. `sgl_kernel` on CUDA without its wheel (a bare GPU image; benchmarks/gpu_e2e.py). On CUDA
   sglang 0.5.23 imports `sgl_kernel` names at module load (layernorm.py, activation.py,
   sampler.py) and three submodules: `quantization` (layers/quantization/gguf.py), `kvcacheio`
   (mem_cache/memory_pool_host.py), `utils.is_arch_support_pdl` (layers/attention/
   triton_backend.py, called in TritonAttnBackend.__init__: ours says False). The stand-in's
   ops raise, so nothing may call them: SGLANG_FORCE_FUSED_OP_BACKEND=torch sends RMSNorm,
   SiluAndMul, rope and TopK to forward_native (kernels/fused_op.py BaseFusedOp.forward);
   SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 skips the `sglang-kernel` assertion
   (entrypoints/engine.py _set_envs_and_config -> utils/common.py assert_pkg_version); the
   default attention backend becomes triton (arg_groups/model_override_base.py
   get_default_attn_backend picks fa3 on Hopper, from sgl_kernel.flash_attn, trtllm or flashinfer).
   Three more pieces, each reached only once an engine builds or captures (imports inside
   functions), need what a bare image lacks:
   a. `cutlass` (nvidia-cutlass-dsl): every LlamaMLP builds a DualGemm (srt/models/llama.py) whose
      mode selection on CUDA imports kernels/ops/gemm/cutedsl_dual_gemm.py (srt/layers/
      dual_gemm.py DualGemm._select_mode). That kernel runs on SM100 only (can_use_dual_gemm), so
      elsewhere SGLang takes the plain path (gate_up_proj, SiluAndMul, down_proj) anyway: without
      cutlass we select it directly (mode None) and the fused call, never allowed then, raises.
   b. `flash_mla`: with CUDA graphs on, the EAGLE worker imports srt/layers/attention/
      flashmla_backend.py for isinstance checks (speculative/eagle_worker_v2.py), which imports
      flash_mla. Without it that module is a stand-in whose backend classes raise if built.
   c. The prefill CUDA graph defaults to "breakable" on CUDA (model_executor/cuda_graph_config.py
      default_prefill_backend); its capture calls sgl_kernel.weak_ref_tensor (runner_backend_utils/
      weak_ref_tensor.py), which no stand-in can provide. The default becomes "disabled", as
      `disable_prefill_cuda_graph`; decode graphs and an explicit prefill backend are unaffected.

6. The MLA draft (`Eagle3DeepseekV2ForCausalLM`, srt/models/kimi_k25_eagle3.py): its `set_embed`
   and `set_embed_and_head`, through which the EAGLE worker hands the draft the target's
   embedding, end with torch.cuda.empty_cache(); torch.cuda.synchronize(), and the second
   raises on a CPU build of torch. Both run with those two calls as no-ops (`cuda_sync_on_cpu`).
7. DFLASH speculative decoding (eval of DFlash heads). (a) srt/arg_groups/speculative_hook.py
   `_handle_dflash` refuses device cpu: on CPU it sees a platform that serves DFLASH (the rest of
   the function unchanged). (b) DRAFT_ATTENTION_BACKEND_CHOICES lacks torch_native and DFLASH's
   draft worker falls back to flashinfer: torch_native joins the list (SGLang's own
   `add_draft_attention_backend_choices`). (c) DFlashWorkerV2.forward_batch_generation calls
   `record_stream` on `seq_lens`, which a CPU tensor refuses: a no-op there (one CPU stream).
   (d) ModelRunner._extend_forward_kwargs casts `input_embeds` to bf16, but the DFlash draft
   takes the block's embeddings as input_embeds and must stay fp32 on CPU (in bf16 it reaches a
   Triton qk-norm-rope kernel): the embeddings keep their dtype.

Call `apply()` (CPU) or `apply_gpu()` (CUDA) in every process that builds an SGLang model,
before importing sglang.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.abc
import importlib.util
import importlib.machinery
import logging
import os
import sys
import types
import warnings

import torch

SGLANG_VERSION = "0.5.23"
_applied = False
_gpu_applied = False
GPU_STAND_IN_SUBMODULES = ("quantization", "kvcacheio", "utils")  # workaround 5
GPU_ATTENTION_BACKEND = "triton"  # the CUDA attention backend that needs no sgl_kernel op
FLASHMLA_MODULE = "sglang.srt.layers.attention.flashmla_backend"  # workaround 5b


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


_MLA_HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"


def register_mla_for_torch_native(handler_module) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    handler_module.AttentionBackendRegistry.register("torch_native", lambda attn, batch: AttnForwardMethod.MLA)


def apply(mla_fix: bool = True, spec_patches: bool = True, dflash_patches: bool = True) -> None:
    """Install the workarounds in this process (idempotent). `False` switches are for tests."""
    global _applied
    if _applied:
        return
    if _gpu_applied:
        raise RuntimeError("sglang_cpu_compat.apply_gpu() already ran in this process (CUDA)")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
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
    if mla_fix:
        patch_when_imported(_MLA_HANDLER_MODULE, register_mla_for_torch_native)
    if spec_patches:
        patch_when_imported("sglang.srt.speculative.draft_utils", _patch_draft_backends)
        patch_when_imported("sglang.srt.layers.attention.torch_native_backend", _patch_target_verify)
    patch_when_imported(MLA_DRAFT_MODULE, _mla_draft_without_cuda_sync)  # workaround 6
    if dflash_patches:  # workaround 7
        patch_when_imported("sglang.srt.arg_groups.speculative_hook", _dflash_on_cpu)
        patch_when_imported("sglang.srt.arg_groups.choices", _torch_native_draft_choice)
        patch_when_imported("sglang.srt.speculative.dflash_worker_v2", _dflash_worker_record_stream)
        patch_when_imported("sglang.srt.model_executor.model_runner", _input_embeds_keep_dtype)
    _applied = True


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
    _gpu_applied = True
    return True


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


# ---------------------------------------------------------------------------------------------
# 4. EAGLE-3 speculative decoding on CPU: pure-torch versions of the `sgl_kernel.*_cpu` ops that
#    sglang 0.5.23 calls in place of its Triton kernels (kernels/ops/speculative/*.py,
#    kernels/ops/kvcache/cache_move.py, srt/mem_cache/allocation.py). Signatures follow the
#    call sites. Batch sizes are small on CPU, so clarity beats speed here.
# ---------------------------------------------------------------------------------------------


def _segments(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten segments [starts[i], ends[i]) into (segment id, column) pairs, segment-major."""
    lengths = (ends - starts).clamp(min=0).long()
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # packed offset of each segment
    cols = starts.long()[seg] + torch.arange(len(seg), device=starts.device) - first[seg]
    return seg, cols


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[rpi[i], start[i]:end[i]] = the i-th packed segment of out_cache_loc."""
    seg, cols = _segments(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[seg], cols] = out_cache_loc[: len(seg)].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse gather: i-th packed segment of out_cache_loc = req_to_token[rpi[i], start[i]:end[i]]."""
    seg, cols = _segments(start_offset, end_offset)
    out_cache_loc[: len(seg)] = req_to_token[req_pool_indices.long()[seg], cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps):
    """Request i's topk*num_steps draft slots, read from req_to_token after its seq_len."""
    n = topk * num_steps
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, seq_lens, seq_lens + n, out_cache_loc, pool_len)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    rows = torch.arange(len(accept_lens), device=accept_lens.device)
    bonus_tokens[:] = accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the KV slots of accepted tokens (accept_index != -1), keeping their order."""
    idx = accept_index.reshape(-1)
    kept = idx[idx != -1].long()
    accept_out_cache_loc[: len(kept)] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every KV buffer (raw address, bytes per row): rows[tgt] = rows[src], sources read first."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    n_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_rows * row_bytes)).from_address(address)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, row_bytes)
        rows[tgt] = rows[src].clone()


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling,
                                    topk, depth, draft_token_num, tree_mask_mode):
    """Builds each request's draft tree from the draft's top-k choices.

    Node 0 is the last verified token; node i >= 1 is the draft token `selected_index[b, i-1]`
    (an index into the draft's flattened top-k scores; `// topk` gives the entry of
    `parent_list` holding its parent's score index, 0 meaning the root). Outputs, in place:
    the children of a node as a linked list (`retrive_next_token`: first child,
    `retrive_next_sibling`: next one, in increasing node order), `retrive_index` (row in the
    flattened batch), each node's position (seq_len + its depth) and the tree attention mask
    (a node sees the root and its ancestors; mode 0 rows also span the verified prefix, left
    as allocated). -1 entries in the linked lists are expected to be pre-filled by the caller.
    """
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError("tree mask mode QLEN_ONLY_BITPACKING has no CPU version")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    parents = parent_list.reshape(len(seq_lens), -1).tolist() if parent_list.numel() else None
    mask, pos = tree_mask.view(-1), positions.view(-1)
    first_child, next_sibling = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    prefix = 0  # sum of earlier requests' verified lengths (full-mask layout)
    for b, seq_len in enumerate(seq_lens):
        sel = selected[b][: n - 1]

        def parent_node(node: int) -> int | None:  # node >= 1 -> parent node, None if not in tree
            parent_slot = sel[node - 1] // topk
            if parent_slot == 0:
                return 0
            parent_score_index = parents[b][parent_slot]
            return sel.index(parent_score_index) + 1 if parent_score_index in sel else None

        base = b * n
        for node in range(n - 1, 0, -1):  # prepend: children end up in increasing order
            retrive_index.view(-1)[base + node] = base + node
            parent = parent_node(node)
            if parent is not None:
                previous = int(first_child[base + parent])
                first_child[base + parent] = node
                if previous != -1:
                    next_sibling[base + node] = previous
        retrive_index.view(-1)[base] = base

        pos[base] = seq_len
        for row in range(n):
            if int(tree_mask_mode) == 0:  # rows of seq_len + n columns; the tree part after the prefix
                start = n * n * b + prefix * n + (seq_len + n) * row + seq_len
            else:  # rows of n columns
                start = n * n * b + n * row
            mask[start] = True
            mask[start + 1: start + n] = False
            node, level = row, 0
            while node != 0 and node is not None and level < depth:
                mask[start + node] = True
                level += 1
                node = parent_node(node)
            if row > 0:
                pos[base + row] = seq_len + level
        prefix += seq_len


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy verification: walk down the tree, at each level accept the child whose token
    equals the target's argmax after the last accepted node; stop when none does.

    `target_predict` and `predicts` are indexed by flattened node row (`retrive_index`);
    `accept_index[b, :k+1]` gets the rows of the root and the k accepted nodes,
    `accept_token_num[b] = k`, and `predicts[row]` the target token after each accepted row.
    """
    batch, n = candidates.shape
    levels = accept_index.shape[1]
    rows, first_child = retrive_index.tolist(), retrive_next_token.tolist()
    next_sibling, tokens = retrive_next_sibling.tolist(), candidates.tolist()
    target, out = target_predict.reshape(-1).tolist(), predicts.view(-1)
    for b in range(batch):
        last = rows[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, levels):
            child = first_child[b][node]
            while child != -1 and tokens[b][child] != target[last]:
                child = next_sibling[b][child]
            if child == -1:
                break
            out[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = rows[b][child]
            last, node = rows[b][child], child
        accept_token_num[b] = accepted
        out[last] = target[last]


SPEC_OPS = (
    assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu, assign_draft_cache_locs_contiguous_cpu,
    fill_bonus_tokens_cpu, fill_accept_out_cache_loc_cpu, copy_all_layer_kv_cache_cpu,
    build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu,
)


def _patch_draft_backends(draft_utils) -> None:
    """Let `DraftBackendFactory` build torch_native draft backends (chain drafts, topk=1)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DraftStepBackend(TorchNativeAttnBackend):
        """Draft decode step `step`: the query also sees the draft tokens of steps 0..step."""

        def __init__(self, model_runner, step: int):
            super().__init__(model_runner)
            self.step = step

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            verified = forward_batch.seq_lens
            forward_batch.seq_lens = verified + self.step + 1
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = verified

    class ChainDraftBackends:
        """One backend per draft decode step, the container shape EAGLE workers expect."""

        def __init__(self, model_runner, topk: int, num_steps: int):
            if topk != 1:
                raise NotImplementedError("torch_native speculative decoding on CPU supports chain drafts "
                                          "only (speculative_eagle_topk=1)")
            self.attn_backends = [DraftStepBackend(model_runner, i) for i in range(num_steps - 1)]
            for b in [self, *self.attn_backends]:
                b.prefill_attention_backend_str = b.decode_attention_backend_str = "torch_native"

        def init_forward_metadata(self, forward_batch):
            for b in self.attn_backends:
                b.init_forward_metadata(forward_batch)

    factory = draft_utils.DraftBackendFactory
    original_decode, original_extend = factory.create_decode_backend, factory.create_draft_extend_backend

    def uses_torch_native(self, decode: bool) -> bool:  # the choice SGLang's `_create_backend` makes
        return (self.draft_attn_backend or draft_utils.attention_backends()[1 if decode else 0]) == "torch_native"

    def create_decode_backend(self):
        if self.speculative_num_steps > 1 and uses_torch_native(self, decode=True):
            return ChainDraftBackends(self.draft_model_runner, self.topk, self.speculative_num_steps)
        return original_decode(self)

    def create_draft_extend_backend(self):
        if uses_torch_native(self, decode=False):
            backend = TorchNativeAttnBackend(self.draft_model_runner)
            backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
            return backend
        return original_extend(self)

    factory.create_decode_backend = create_decode_backend
    factory.create_draft_extend_backend = create_draft_extend_backend


def _patch_target_verify(torch_native_backend) -> None:
    """TARGET_VERIFY through torch_native's extend path: each request extends its verified
    prefix by the draft_token_num chain tokens, for which the causal mask is the chain mask."""
    backend = torch_native_backend.TorchNativeAttnBackend
    original_extend = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        spec = forward_batch.spec_info
        if getattr(spec, "topk", 1) != 1:
            raise NotImplementedError("torch_native target verify on CPU supports chain drafts only (topk=1)")
        saved = forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
        verified = forward_batch.seq_lens
        forward_batch.extend_prefix_lens = verified
        forward_batch.extend_seq_lens = torch.full_like(verified, spec.draft_token_num)
        forward_batch.seq_lens = verified + spec.draft_token_num
        try:
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        finally:
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved

    backend.forward_extend = forward_extend


# ---------------------------------------------------------------------------------------------
# 6. The MLA draft's embedding hand-over on CPU
# ---------------------------------------------------------------------------------------------
MLA_DRAFT_MODULE = "sglang.srt.models.kimi_k25_eagle3"


@contextlib.contextmanager
def cuda_sync_on_cpu():
    """torch.cuda.synchronize / empty_cache as no-ops where torch has no CUDA (a CPU build raises)."""
    saved = torch.cuda.synchronize, torch.cuda.empty_cache
    if not torch.cuda.is_available():
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.empty_cache = saved


def _run_inside(context, cls, *names) -> None:
    """Each named method of `cls` runs inside `context()` (SGLang's own stays reachable as `__wrapped__`)."""
    for name in names:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapped(self, *args, _original=original, **kwargs):
            with context():
                return _original(self, *args, **kwargs)

        setattr(cls, name, wrapped)


def _mla_draft_without_cuda_sync(module) -> None:
    _run_inside(cuda_sync_on_cpu, module.Eagle3DeepseekV2ForCausalLM, "set_embed", "set_embed_and_head")


# ---------------------------------------------------------------------------------------------
# 7. DFLASH on CPU
# ---------------------------------------------------------------------------------------------
class _DFlashServingPlatform:
    """`current_platform` as `_handle_dflash` sees it on CPU: an out-of-tree platform that serves
    DFLASH with the draft backends of DRAFT_ATTENTION_BACKEND_CHOICES, torch_native by default."""

    def __init__(self, real, choices):
        self._real, self._choices = real, choices

    def __getattr__(self, name):
        return getattr(self._real, name)

    is_out_of_tree = staticmethod(lambda: True)
    supports_speculative_algorithm = staticmethod(lambda algorithm: algorithm == "DFLASH")
    get_default_speculative_draft_attention_backend = staticmethod(lambda algorithm: "torch_native")

    def supports_speculative_draft_attention_backend(self, algorithm, backend):
        return backend in self._choices


def _dflash_on_cpu(hook) -> None:  # 7a
    original = hook._handle_dflash

    @functools.wraps(original)
    def handle_dflash(server_args):
        if hook.resolving_view(server_args).device != "cpu":
            return original(server_args)
        real = hook.current_platform
        hook.current_platform = _DFlashServingPlatform(real, hook.DRAFT_ATTENTION_BACKEND_CHOICES)
        try:
            return original(server_args)
        finally:
            hook.current_platform = real

    hook._handle_dflash = handle_dflash


def _torch_native_draft_choice(choices) -> None:  # 7b
    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices(["torch_native"])


@contextlib.contextmanager
def record_stream_on_cpu():
    """Tensor.record_stream a no-op on CPU tensors (torch raises there; CPU work has one stream)."""
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.device.type != "cpu":
            return original(self, stream)

    torch.Tensor.record_stream = record_stream
    try:
        yield
    finally:
        torch.Tensor.record_stream = original


def _dflash_worker_record_stream(worker_module) -> None:  # 7c
    _run_inside(record_stream_on_cpu, worker_module.DFlashWorkerV2, "forward_batch_generation")


def _input_embeds_keep_dtype(model_runner) -> None:  # 7d
    cls = model_runner.ModelRunner
    original = cls._extend_forward_kwargs

    @functools.wraps(original)
    def extend_forward_kwargs(self, forward_batch, pp_proxy_tensors):
        kwargs = original(self, forward_batch, pp_proxy_tensors)
        embeds = forward_batch.input_embeds
        if embeds is not None and forward_batch.replace_embeds is None:
            kwargs["input_embeds"] = embeds  # SGLang's cast to bf16 undone
        return kwargs

    cls._extend_forward_kwargs = extend_forward_kwargs
