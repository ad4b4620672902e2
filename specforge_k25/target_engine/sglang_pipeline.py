"""The frozen target as SGLang pipeline stages (pinned: sglang==0.5.23): one rank of a
pipeline-parallel target, stage `pp_rank` of `pp_size`, TP rank `tp_rank` of `tp_size` inside it
(world rank tp_size * pp_rank + tp_rank, SGLang's layout; world = pp_size * tp_size processes).

Each stage holds its own slice of the layers (SGLang's `make_pp_layers`, its default split or
SGLANG_PP_LAYER_PARTITION) and its own KV pool, and is driven like `SGLangTarget` (sglang_engine.py),
without SGLang's scheduler: every rank runs the same `forward` calls in the same order, each batch
prefilled in the same rounds (`prefill_rounds`, so chunked prefill cuts every stage alike). One
round: stage 0 embeds and runs its layers; every later stage receives the previous stage's proxy
tensors (`{hidden_states, residual}`, DeepSeek's DSA `topk_indices` when it has them) and runs its
layers; the last stage applies the final norm.

Route of the aux states: the aux states a stage captures travel on to the last stage with the
proxies, in the same tensor dict (`aux0`, `aux1`, ... in capture-point order), sent with SGLang's
own `send_tensor_dict` / received with `recv_tensor_dict` of the PP group (metadata over its gloo
cpu_group, tensors on its device group; with TP inside a stage each TP rank sends 1/tp of every
tensor to its peer in the next stage, which all-gathers it over its TP group, as SGLang's scheduler
does). So the last stage's ranks return the whole `TargetOutput` (aux [N, K*H], final [N, H]),
exactly as `SGLangTarget.forward` does; the other stages return None.

Capture without SGLang's EAGLE-3 flags, which its ServerArgs validation refuses with pp != 1
(validation_hook.py) and whose `set_eagle3_layers_to_capture` returns early on non-last stages:
each capture layer a stage owns gets a forward pre-hook that puts our collector into the capture
keyword SGLang's model passes that layer (None when the layer is not one of its own capture layers):
Llama's decoder layer `capture_output` (a callback), DeepSeek/Kimi's `captured_last_layer_outputs`
(an accumulator). SGLang's own capture code then runs (the layer boundary's `prepare`), so an aux
state is exactly what `SGLangTarget` captures: the residual stream entering that layer, also for a
layer that is the first of stage s > 0 (rebuilt from the proxy by `from_pp`). The layers are the
capture points as SGLangTarget's layer ids (`layers.sglang_layer_ids`) resolve them. The final state
is the text model's output (after the final norm) on the last stage, as SGLangTarget's forward hook
sees it.

No logits: the last stage's `logits_processor` is replaced by a module that returns None. The states
need no logits, and SmolLM2's tied lm_head is SGLang's `PPMissingLayer` on the last stage (the
embedding lives on stage 0), where logits would fail. Hence no regeneration under PP (`generate`
refuses it).

SGLang internals touched, beyond sglang_engine.py's: `ServerArgs(pp_size)`, `parallel_state.
{get_pp_group, get_world_group}`, `get_parallel().attn_tp_group`, `GroupCoordinator.{send_tensor_dict,
recv_tensor_dict, is_first_rank, is_last_rank}`, `PPProxyTensors`, `ModelRunner.forward(forward_batch,
pp_proxy_tensors=...)`, one_batch's extend preparation (`ScheduleBatch.init_new`, `prepare_for_extend`,
`ForwardBatch.init_new`), the text model's `layers`, `start_layer`, `end_layer`, the decoder layers'
capture keywords and the causal LM's `logits_processor`. Covered by tests/target_engine/test_target_pp.py.
"""
from __future__ import annotations

import inspect

import torch

from .base import CPU_MEM_FRACTION_STATIC, TargetOutput
from .layers import capture_points_of_sglang_ids, layer_id_rule, sglang_layer_ids
from .pages import batch_slots
from .sglang_engine import (
    _text_model,
    broadcast_batch,
    engine_server_args,
    load_runner,
    make_requests,
    packed_aux,
    prefill_rounds,
)
from .sglang_cpu_compat import SGLANG_VERSION

# The keyword through which each SGLang 0.5.23 decoder layer takes its capture target, and whether it
# wants a callback (Llama: `capture(value, owned=...)`) or the accumulator itself (DeepSeek/Kimi:
# `.capture(value, owned=...)` on it).
CAPTURE_KEYWORDS = {"capture_output": "callback", "captured_last_layer_outputs": "accumulator"}
AUX_KEY = "aux{}"  # the aux states' keys in the tensor dict sent between stages


class _NoLogits(torch.nn.Module):
    """Stands in for the last stage's LogitsProcessor: the stage returns states, never logits."""

    def forward(self, *args, **kwargs):
        return None


class SGLangPipelineStage:
    """One rank of a pipeline-parallel SGLang target (see the module doc). Every rank of the world
    builds one in its own process (a collective: SGLang forms its groups and agrees on the KV pool
    size); `gpu_id` = its GPU (on CPU, its index on the node: the thread group)."""

    def __init__(
        self,
        model_path: str,
        architecture: str,
        capture_points: list[int],
        *,
        pp_size: int,
        pp_rank: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        tp_size: int = 1,
        tp_rank: int = 0,
        gpu_id: int = 0,
        max_total_tokens: int = 16384,
        mem_fraction_static: float = CPU_MEM_FRACTION_STATIC,
        num_threads: int | None = None,
        attention_backend: str | None = None,
        trust_remote_code: bool = False,
        dist_timeout: int | None = None,
        load_threads: int = 8,
        prefill_chunk: int | None = None,
    ):
        if pp_size < 2 or not 0 <= pp_rank < pp_size:
            raise ValueError(f"pipeline stage {pp_rank} of {pp_size}: a pipeline has >= 2 stages "
                             f"(one stage is SGLangTarget)")
        prefill_rounds([1], prefill_chunk)  # refuse a bad chunk before SGLang's (slow) import and load
        rule = layer_id_rule(architecture)
        layer_ids = sglang_layer_ids(capture_points, rule)
        # the layers whose input SGLangTarget captures with these ids (= the capture points)
        self.capture_layers = capture_points_of_sglang_ids(layer_ids, rule)
        self.num_aux = len(capture_points)
        self.pp_size, self.pp_rank, self.tp_size, self.tp_rank = pp_size, pp_rank, tp_size, tp_rank
        self.prefill_chunk = prefill_chunk
        self._one_batch, self._runner = load_runner(engine_server_args(
            model_path, device=device, dtype=dtype, tp_size=tp_size, attention_backend=attention_backend,
            mem_fraction_static=mem_fraction_static, max_total_tokens=max_total_tokens,
            trust_remote_code=trust_remote_code, layer_ids=layer_ids, nnodes=1, node_rank=0,
            dist_init_addr=None, dist_timeout=dist_timeout, load_threads=load_threads, pp_size=pp_size),
            tp_rank=tp_rank, pp_rank=pp_rank, gpu_id=gpu_id, local_ranks=tp_size * pp_size, num_threads=num_threads)
        from sglang.srt.distributed.parallel_state import get_pp_group
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
        from sglang.srt.runtime_context import get_parallel

        self._PPProxyTensors = PPProxyTensors
        self._pp_group, self._tp_group = get_pp_group(), get_parallel().attn_tp_group
        self.is_first_stage, self.is_last_stage = self._pp_group.is_first_rank, self._pp_group.is_last_rank
        self.model = self._runner.torch_runner.model
        self.max_total_tokens = self._runner.torch_runner.max_total_num_tokens
        text = _text_model(self.model)
        self.layers = (text.start_layer, text.end_layer)  # this stage's decoder layers [start, end)
        self.own_capture_layers = [p for p in self.capture_layers if text.start_layer <= p < text.end_layer]
        self._keyword = None
        self._aux = None  # the collector of the forward in progress (SGLang's AuxHiddenStateList)
        for p in self.own_capture_layers:
            layer = text.layers[p]
            self._keyword = _capture_keyword(layer)
            layer.register_forward_pre_hook(self._hand_collector, with_kwargs=True)
        self._final = None
        if self.is_last_stage:
            text.register_forward_hook(self._capture_final)
            causal_lm = getattr(self.model, "language_model", None) or self.model  # Kimi-K2.5: its DeepseekV3
            if not hasattr(causal_lm, "logits_processor"):
                raise RuntimeError(f"{type(causal_lm).__name__} has no logits_processor (sglang {SGLANG_VERSION})")
            causal_lm.logits_processor = _NoLogits()
        self._next_rid = 0

    def _hand_collector(self, module, args, kwargs):
        if self._keyword not in kwargs:
            raise RuntimeError(f"SGLang called {type(module).__name__} without its capture keyword "
                               f"{self._keyword!r} (sglang {SGLANG_VERSION} passes it): cannot capture")
        collector = self._aux
        kwargs[self._keyword] = collector.capture if CAPTURE_KEYWORDS[self._keyword] == "callback" else collector
        return args, kwargs

    def _capture_final(self, module, args, output):
        self._final = output[0] if isinstance(output, tuple) else output

    def share_batch(self, sequences: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """World rank 0 (stage 0, TP rank 0) passes its next batch (None = no more batches) and every
        other rank of every stage passes None; all get rank 0's batch back (`broadcast_batch` over
        SGLang's world group). A collective over all pp_size * tp_size ranks, once per batch."""
        from sglang.srt.distributed.parallel_state import get_world_group

        return broadcast_batch(sequences, get_world_group())

    @torch.no_grad()
    def forward(self, sequences: list[torch.Tensor]) -> TargetOutput | None:
        """This stage's part of the prefill of `sequences` (every rank calls it with the same batch).
        The last stage returns the batch's states; the other stages None."""
        total = sum(len(s) for s in sequences)
        slots = batch_slots([len(s) for s in sequences], self.kv_page_size)
        if slots > self.max_total_tokens:
            raise ValueError(f"batch of {total} tokens ({slots} KV slots in pages of {self.kv_page_size}) exceeds the "
                             f"engine's KV pool ({self.max_total_tokens})")
        reqs = make_requests(sequences, self._next_rid)
        self._next_rid += len(reqs)
        rounds = prefill_rounds([len(s) for s in sequences], self.prefill_chunk, self.kv_page_size)
        aux = final = None
        done = 0
        try:
            for spans in rounds:
                for i, start, end in spans:  # as SGLangTarget.forward: continue the request's KV row
                    reqs[i].prefix_len, reqs[i].extend_end = start, end
                out = self._extend([reqs[i] for i, _, _ in spans])
                if out is None:
                    continue
                aux_hidden, final_hidden = out
                n = final_hidden.shape[0]
                if n != sum(end - start for _, start, end in spans):
                    raise RuntimeError(f"SGLang returned the states of {n} tokens for a forward of "
                                       f"{sum(end - start for _, start, end in spans)}")
                if len(rounds) == 1:
                    aux, final = aux_hidden, final_hidden
                    break
                if aux is None:
                    aux = aux_hidden.new_empty((total, aux_hidden.shape[-1]))
                    final = final_hidden.new_empty((total, final_hidden.shape[-1]))
                aux[done:done + n].copy_(aux_hidden)  # the spans are the batch's tokens in order
                final[done:done + n].copy_(final_hidden)
                done += n
        finally:
            self._runner.clear()  # free the KV cache: every batch is a fresh prefill
        return TargetOutput(aux, final, [len(s) for s in sequences]) if self.is_last_stage else None

    def _extend(self, reqs: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One prefill forward of `reqs` through this stage: the batch prepared as SGLang's
        `one_batch.extend` prepares it (every stage builds the same batch in its own pools), then
        `ModelRunner.forward` with the previous stage's proxies. Not one_batch.extend itself: it reads
        logits and samples, which a stage without the LM head has not. Last stage: (aux [n, K*H],
        final [n, H]); other stages send theirs on and return None."""
        ob, runner = self._one_batch, self._runner.torch_runner
        tree_cache = ob.TreeCacheNamespace(page_size=ob.get_schedule().page_size, device=runner.device,
                                           token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
        batch = ob.ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=tree_cache,
            model_config=runner.model_config, enable_overlap=False, spec_algorithm=ob.SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        ob._maybe_prepare_mlp_sync_batch(batch, runner)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ob.ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)

        carried, proxies = [], None
        if not self.is_first_stage:
            received = self._pp_group.recv_tensor_dict(all_gather_group=self._tp_group)
            while AUX_KEY.format(len(carried)) in received:  # the earlier stages' aux states, in order
                carried.append(received.pop(AUX_KEY.format(len(carried))))
            proxies = self._PPProxyTensors(received)
        from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList

        self._aux, self._final = AuxHiddenStateList(), None
        try:
            output = runner.forward(forward_batch, pp_proxy_tensors=proxies).logits_output
            captured = carried + list(self._aux)
        finally:
            self._aux = None
        if len(captured) != len(carried) + len(self.own_capture_layers):
            raise RuntimeError(f"stage {self.pp_rank} captured {len(captured) - len(carried)} aux states, its "
                               f"capture layers are {self.own_capture_layers}")
        if not self.is_last_stage:
            tensors = dict(output.tensors)
            tensors.update({AUX_KEY.format(k): a for k, a in enumerate(captured)})
            self._pp_group.send_tensor_dict(tensors, all_gather_group=self._tp_group)
            return None
        final, self._final = self._final, None
        if final is None:
            raise RuntimeError("the last stage's text model returned no final hidden state")
        return packed_aux(captured, final, self.num_aux), final

    def send_states(self, rank: int, tensors: list[torch.Tensor], tag: int) -> list:
        """Start sending `tensors` to world rank `rank` (the last stage hands a co-located trainer rank
        beside an earlier stage its share of a batch; stream/pipeline_shares.py). Point to point on
        SGLang's world device group (gloo on CPU, NCCL on GPU), apart from the PP group's proxies.
        Returns the pending works; the tensors must live until they complete."""
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_world_group

        group = get_world_group()
        # an empty tensor (aux [n, 0] without capture points) is not sent: the receiver skips it alike
        return [dist.isend(t, dst=group.ranks[rank], group=group.device_group, tag=tag) for t in tensors if t.numel()]

    def recv_states(self, rank: int, tensors: list[torch.Tensor], tag: int) -> list:
        """Start receiving into `tensors` what world rank `rank` sends with the same tag (`send_states`)."""
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_world_group

        group = get_world_group()
        return [dist.irecv(t, src=group.ranks[rank], group=group.device_group, tag=tag) for t in tensors if t.numel()]

    def generate(self, prompts, budgets, regen):
        raise NotImplementedError(
            "regeneration (data.regenerate) with a pipeline-parallel target is not supported yet: the "
            "stages compute no logits (the last stage's LM head is replaced, and a tied one is not there); "
            "regenerate with a TP-only target (hw.target_pp=1) or turn data.regenerate off")

    @property
    def kv_page_size(self) -> int:
        """Tokens per page of this stage's KV pool: SGLang gives each request whole pages."""
        return self._runner.torch_runner.token_to_kv_pool_allocator.page_size

    def warmup(self) -> None:
        """As SGLangTarget.warmup: two small forwards through all stages (every rank calls it)."""
        for n in (8, 24):
            self.forward([torch.arange(1, n + 1, dtype=torch.int64)])

    def close(self) -> None:
        """Free the KV pool and tear down SGLang's process groups (as SGLangTarget.close with TP > 1).
        Every rank calls it after the last batch."""
        self._runner.clear()
        from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


def _capture_keyword(layer: torch.nn.Module) -> str:
    """The capture keyword of this SGLang decoder layer's forward (CAPTURE_KEYWORDS)."""
    params = inspect.signature(type(layer).forward).parameters
    found = [k for k in CAPTURE_KEYWORDS if k in params]
    if len(found) != 1:
        raise RuntimeError(f"{type(layer).__name__}.forward takes none of the capture keywords "
                           f"{sorted(CAPTURE_KEYWORDS)} (sglang {SGLANG_VERSION}): cannot capture its input")
    return found[0]
