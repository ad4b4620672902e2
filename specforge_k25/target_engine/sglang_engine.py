"""The frozen target inside SGLang (pinned: sglang==0.5.23), returning hidden states as tensors.

We drive SGLang's `ModelRunner` in-process, the way SGLang's own `sglang.benchmark.one_batch`
does (`load_model` + `extend`), instead of going through `Engine.generate`, whose hidden
states come back as nested Python lists (~21.5k floats per token for Kimi: far too slow).

SGLang internals touched (all in this file, covered by tests/target_engine/test_target.py):
- `sglang.benchmark.one_batch.{load_model, extend, publish, SpawnRanks, spawn_world_rank,
  _init_process_global_configs}` and `entrypoints.engine._set_envs_and_config`;
- `ServerArgs(enable_return_aux_hidden_states, speculative_algorithm="EAGLE3",
  return_aux_hidden_state_layer_ids)`: makes the model capture the aux layers (not set with zero
  capture points: the plain engine's final state, aux [N, 0]);
- a forward hook on the text model (`model.model`, or `model.language_model.model` for
  Kimi-K2.5), whose output is `(final_hidden_after_norm, aux_hidden)`;
- `Req` fields the extend path reads; chunked prefill (`prefill_chunk`): `Req.prefix_len` /
  `extend_end` (the span one extend computes) and the request's KV row (`Req.kv.req_pool_idx`), which
  `ScheduleBatch.prepare_for_extend` keeps for a request that already holds one, so a later chunk
  attends to the KV its earlier chunks wrote (as SGLang's scheduler continues its chunked request);
- regeneration: `one_batch.decode`, `ScheduleBatch.filter_batch(keep_indices=...)` (finished
  requests leave the decode batch) and the KV allocator's `page_size`;
- TP > 1: `ServerArgs(nnodes, node_rank, dist_init_addr)`, `SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE`
  (one node: env:// to the trainer's TCPStore, stream/target_stream.py `Rendezvous`) and SGLang's TP group
  (`parallel_state.get_tp_group()`: `cpu_group`, `ranks`, `rank_in_group`), over which TP rank 0
  broadcasts each batch's token ids to the other ranks (`share_batch`), and its teardown
  (`parallel_state.destroy_model_parallel`, `destroy_distributed_environment`) in `close`.
The start-up (`load_runner`), the batch broadcast (`broadcast_batch`) and the requests
(`make_requests`) are shared with the pipeline-parallel stages (sglang_pipeline.py).
"""
from __future__ import annotations

import json
import os
from array import array

import torch

from .base import CPU_MEM_FRACTION_STATIC, TargetOutput
from .layers import layer_id_rule, sglang_layer_ids
from .routing import recorder_for
from .pages import batch_slots, chunk_end
from .sampling import Regeneration, generate_with, generation_slots
from .sglang_cpu_compat import SGLANG_VERSION


def _text_model(model: torch.nn.Module) -> torch.nn.Module:
    language_model = getattr(model, "language_model", None)  # KimiK25ForConditionalGeneration
    return (language_model if language_model is not None else model).model


def cpu_bind_groups(num_ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `num_ranks` TP ranks on this machine: its CPUs cut into
    contiguous groups ("0-7|8-15"), one per rank, shared round-robin if there are fewer CPUs.

    sglang 0.5.23 on CPU asserts tp_size <= NUMA nodes unless this is set (numa_utils.
    init_threads_binding); the groups are only applied on AMX / arm64 CPUs (sgl_kernel's thread
    binding), elsewhere they just satisfy that check."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cpus) // num_ranks)
    groups = []
    for r in range(num_ranks):
        start = (r * per) % len(cpus)
        chunk = cpus[start:start + per]
        if len(chunk) > 1 and chunk == list(range(chunk[0], chunk[-1] + 1)):
            groups.append(f"{chunk[0]}-{chunk[-1]}")  # the form SGLang documents
        else:
            groups.append(",".join(str(c) for c in chunk))
    return "|".join(groups)


def engine_server_args(model_path: str, *, device: str, dtype: str, tp_size: int, attention_backend: str | None,
                       mem_fraction_static: float, max_total_tokens: int, trust_remote_code: bool,
                       layer_ids: list[int], nnodes: int, node_rank: int, dist_init_addr: str | None,
                       dist_timeout: int | None, load_threads: int, pp_size: int = 1) -> dict:
    """The `ServerArgs` fields of one TP rank's engine (plain values: tests check them without SGLang).
    pp_size > 1 (a pipeline stage, sglang_pipeline.py): without the EAGLE-3 capture fields, which
    SGLang 0.5.23 refuses with pp != 1 (validation_hook.py); the stages capture through hooks.
    No layer ids (zero capture points): without them too. SGLang 0.5.23 refuses an empty
    `return_aux_hidden_state_layer_ids` ("must not be empty", validation_hook.py), and were the
    capture switched on with no layer (set_eagle3_layers_to_capture([])), the text model would return
    its plain final state (`len(aux_hidden_states) == 0`, llama.py / deepseek_v2.py) where the causal
    LM unpacks a (final, aux) pair; the plain engine returns the same final state."""
    capture = dict(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                   return_aux_hidden_state_layer_ids=layer_ids) if pp_size == 1 and layer_ids else {}
    return dict(
        model_path=model_path,
        device=device,
        dtype=dtype,
        tp_size=tp_size,
        pp_size=pp_size,
        attention_backend=attention_backend or ("torch_native" if device == "cpu" else None),
        # No CUDA graphs, regeneration's decode steps included: the capture fields set
        # speculative_algorithm=EAGLE3, under which SGLang captures its decode graphs as TARGET_VERIFY
        # batches of speculative_num_draft_tokens per request (model_executor/runner/
        # decode_cuda_graph_runner.py ~356-367), and model_runner.py ~1985-1995 would replay them for
        # this engine's plain DECODE batches too; the training forwards are prefills, which no graph serves.
        disable_cuda_graph=True,
        mem_fraction_static=mem_fraction_static,
        max_total_tokens=max_total_tokens,
        disable_radix_cache=True,
        disable_overlap_schedule=True,
        log_level="warning",
        trust_remote_code=trust_remote_code,
        **capture,
        # TP > 1: every rank must meet at the same rendezvous. One node: the TCPStore the trainer
        # process serves (env:// via the environment, stream/target_stream.py); several nodes:
        # dist_init_addr (host:port). dist_timeout bounds the TP group's setup and its collectives,
        # so a rank that never arrives or hangs fails the others instead of blocking them.
        nnodes=nnodes,
        node_rank=node_rank,
        dist_init_addr=dist_init_addr,
        dist_timeout=dist_timeout,
        # SGLang's multithreaded safetensors loader reads `load_threads` shards at a time (Kimi-K2.5:
        # 64 of ~9.3 GB; its own estimate of the host memory this takes: threads + 2 shards per rank).
        # Named explicitly because SGLang turns it off when weight_loader_prefetch_checkpoints is set.
        model_loader_extra_config=json.dumps({"enable_multithread_load": True, "num_threads": load_threads}),
    )


def load_runner(fields: dict, *, tp_rank: int, pp_rank: int, gpu_id: int, local_ranks: int,
                num_threads: int | None):
    """SGLang's model runner of one rank (TP rank `tp_rank` of pipeline stage `pp_rank`; world rank
    tp_size * pp_rank + tp_rank, SGLang's layout), started in this process as SGLang's own
    `sglang.benchmark.one_batch` starts it, from the `ServerArgs` fields `fields`
    (`engine_server_args`). `local_ranks`: the ranks this node runs (CPU thread groups).
    Returns (one_batch, its runner). With more than one rank this is a collective: every rank of the
    world calls it (SGLang forms its groups and agrees on the KV pool's size)."""
    device, world = fields["device"], fields["tp_size"] * fields.get("pp_size", 1)
    if device == "cpu":
        from . import sglang_cpu_compat

        sglang_cpu_compat.apply()
    elif device == "cuda":  # without the sgl_kernel wheel (a bare GPU image): its stand-in
        from . import sglang_cpu_compat

        sglang_cpu_compat.apply_gpu()
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"specforge_k25 is pinned to sglang=={SGLANG_VERSION}, found {sglang.__version__}")
    from sglang.benchmark import one_batch
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import PortArgs, ServerArgs

    if device == "cuda" and world > 1:
        # The trainer process puts the stream ring (and, when it shares the GPU, its own state) on
        # rank 0's GPU before the engine loads: SGLang's start-up check refuses a rank with
        # under 90% of another's free memory. The memory plan (plan/budget.py) sizes the KV
        # pool from the fullest rank instead.
        os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
    if device == "cpu" and world > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(local_ranks)
    server_args = ServerArgs(**fields)
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    world_rank = one_batch.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank)
    one_batch.publish(server_args, role="scheduler", ranks=one_batch.SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))
    one_batch._init_process_global_configs()
    runner, _ = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
    if num_threads and device == "cpu":  # hw.target_threads; SGLang sets its own thread count while loading
        torch.set_num_threads(num_threads)
    return one_batch, runner


def packed_aux(aux_hidden, final_hidden: torch.Tensor, num_aux: int) -> torch.Tensor:
    """What SGLang's capture hook saw -> aux [N, K*Ht]. Llama models hand a list of K [N, Ht],
    DeepSeek ones (Kimi-K2.5) one packed [N, K*Ht]; both in increasing layer order, which is the
    capture points' order. A count other than the `num_aux` points asked for is refused: the ring's
    slots and the draft are sized for that K. Nothing captured (None, or an empty list: a pipeline
    stage's collector with K = 0) is aux [N, 0]."""
    if aux_hidden is None or (isinstance(aux_hidden, (list, tuple)) and not aux_hidden):
        aux_hidden = final_hidden.new_empty((final_hidden.shape[0], 0))
    elif isinstance(aux_hidden, (list, tuple)):
        aux_hidden = torch.cat(list(aux_hidden), -1)
    ht = final_hidden.shape[-1]
    if aux_hidden.shape[-1] != num_aux * ht:
        raise RuntimeError(f"SGLang captured {aux_hidden.shape[-1] / ht:g} aux hidden states of width {ht}, "
                           f"the capture points ask for {num_aux}")
    return aux_hidden


def prefill_rounds(lengths: list[int], chunk: int | None, page_size: int = 1) -> list[list[tuple[int, int, int]]]:
    """The target forwards that prefill a batch of sequences of `lengths`: each forward a list of
    (sequence, start, end) token spans, at most `chunk` tokens in all (None: one forward of the
    whole batch). The batch is walked in order and a sequence is cut where a forward's budget runs
    out, its rest going to the next forwards: concatenated forward after forward the spans are the
    batch's tokens in order (what the trainer receives), and each later span of a sequence extends
    the KV its earlier spans wrote. One token budget per forward, as SGLang's chunked_prefill_size:
    it bounds the activations of one forward (a 32k-token MoE forward) whatever the batch size.
    A cut falls on a page boundary of the KV pool (`page_size`, target_engine/pages.py), as SGLang's
    scheduler cuts: the room a forward has left below one page goes unused."""
    if chunk is None:
        return [[(i, 0, n) for i, n in enumerate(lengths)]]
    if chunk < max(1, page_size):
        raise ValueError(f"prefill chunk of {chunk} tokens: must be >= 1 and at least one KV page ({page_size} "
                         f"tokens), or null")
    rounds, current, room = [], [], chunk
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            end = chunk_end(start, room, n, page_size)
            if end > start:
                current.append((i, start, end))
                room -= end - start
                start = end
            if end < n or room == 0:  # cut here (or full): the rest goes to the next forward
                if current:
                    rounds.append(current)
                current, room = [], chunk
    if current:
        rounds.append(current)
    return rounds


def broadcast_batch(sequences: list[torch.Tensor] | None, group) -> list[torch.Tensor] | None:
    """The first rank of SGLang's group `group` (a GroupCoordinator) passes its batch (None = no
    more batches), the others None; all get its batch back. Two broadcasts over the group's CPU
    (gloo) group: (count, tokens) then lengths + token ids."""
    import torch.distributed as dist

    src, is_src = group.ranks[0], group.rank_in_group == 0
    header = torch.tensor([-1, 0], dtype=torch.int64)
    if is_src and sequences is not None:
        header = torch.tensor([len(sequences), sum(len(s) for s in sequences)], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group.cpu_group)
    count, total = header.tolist()
    if count < 0:
        return None
    if is_src:
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        payload = torch.cat([lengths] + [s.to(torch.int64) for s in sequences])
    else:
        payload = torch.empty(count + total, dtype=torch.int64)
    dist.broadcast(payload, src=src, group=group.cpu_group)
    return list(torch.split(payload[count:], payload[:count].tolist()))


def make_requests(sequences: list[torch.Tensor], first_rid: int, new_tokens: list[int] | None = None) -> list:
    """SGLang `Req`s (ids sf<first_rid>, ...) that prefill `sequences` whole, greedy; `new_tokens`:
    each one's decoding budget (None: a prefill only, 1 token). The fields one_batch's extend reads."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i, ids in enumerate(sequences):
        sampling = SamplingParams(temperature=0, max_new_tokens=1 if new_tokens is None else max(1, new_tokens[i]))
        req = Req(rid=f"sf{first_rid + i}", origin_input_text="", origin_input_ids=array("q", ids.tolist()),
                  sampling_params=sampling)
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(ids)
        reqs.append(req)
    return reqs


class SGLangTarget:
    """One TP rank of the frozen target. With tp_size > 1 every rank of the TP group builds one
    (each in its own process, `gpu_id` = its GPU; on CPU its index on the node) and they all run
    the same `forward` calls in the same order; `share_batch` gives every rank TP rank 0's batch.
    `prefill_chunk` tokens: a longer batch is prefilled in several forwards (`prefill_rounds`); every
    rank cuts the same batch the same way, so the TP ranks' collectives stay in step."""

    is_last_stage = True  # one stage: it returns the states (a pipeline's other stages do not)

    def __init__(
        self,
        model_path: str,
        architecture: str,
        capture_points: list[int],
        *,
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
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        dist_timeout: int | None = None,
        load_threads: int = 8,
        prefill_chunk: int | None = None,
        routing_dir: str | None = None,
    ):
        prefill_rounds([1], prefill_chunk)  # refuse a bad chunk before SGLang's (slow) import and load
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.prefill_chunk = prefill_chunk
        self.num_aux = len(capture_points)
        self.layer_ids = sglang_layer_ids(capture_points, layer_id_rule(architecture))
        self._one_batch, self._runner = load_runner(engine_server_args(
            model_path, device=device, dtype=dtype, tp_size=tp_size, attention_backend=attention_backend,
            mem_fraction_static=mem_fraction_static, max_total_tokens=max_total_tokens,
            trust_remote_code=trust_remote_code, layer_ids=self.layer_ids, nnodes=nnodes, node_rank=node_rank,
            dist_init_addr=dist_init_addr, dist_timeout=dist_timeout, load_threads=load_threads),
            tp_rank=tp_rank, pp_rank=0, gpu_id=gpu_id, local_ranks=tp_size // nnodes, num_threads=num_threads)
        self.model = self._runner.torch_runner.model
        self.max_total_tokens = self._runner.torch_runner.max_total_num_tokens
        self._captured: tuple | None = None
        _text_model(self.model).register_forward_hook(self._capture)
        self._next_rid = 0
        # MoE routing counts of the prefilled batches, written to routing_dir at close (target_engine/routing.py)
        self.routing_dir, self.routing = routing_dir, (recorder_for(model_path) if routing_dir else None)

    def share_batch(self, sequences: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """TP > 1: TP rank 0 passes its next batch (None = no more batches) and every other rank
        passes None; all of them get rank 0's batch back (`broadcast_batch` over SGLang's TP group).
        A collective: every rank calls it once per batch, in the same order."""
        if self.tp_size == 1:
            return sequences
        from sglang.srt.distributed.parallel_state import get_tp_group

        return broadcast_batch(sequences, get_tp_group())

    def _capture(self, module, args, output):
        self._captured = output

    def _hook_output(self) -> tuple[torch.Tensor, object]:
        """(final state, aux as SGLang handed it) of the forward just run. With capture points the text
        model returns a (final, aux) pair; with none (K = 0: the engine runs without EAGLE-3 capture,
        `engine_server_args`) its plain final state, and the aux is None (`packed_aux`: [N, 0])."""
        captured, self._captured = self._captured, None
        if self.num_aux == 0:
            if not isinstance(captured, torch.Tensor):
                raise RuntimeError(f"SGLang's text model returned {type(captured).__name__} for an engine without "
                                   f"capture points, not its final hidden state")
            return captured, None
        if not isinstance(captured, tuple) or len(captured) != 2:
            raise RuntimeError("SGLang did not return aux hidden states (capture hook saw no (final, aux) pair)")
        return captured

    @torch.no_grad()
    def forward(self, sequences: list[torch.Tensor]) -> TargetOutput:
        total = sum(len(s) for s in sequences)
        slots = batch_slots([len(s) for s in sequences], self.kv_page_size)
        if slots > self.max_total_tokens:
            raise ValueError(f"batch of {total} tokens ({slots} KV slots in pages of {self.kv_page_size}) exceeds the "
                             f"engine's KV pool ({self.max_total_tokens})")
        reqs = self._requests(sequences)
        rounds = prefill_rounds([len(s) for s in sequences], self.prefill_chunk, self.kv_page_size)
        aux = final = None
        done = 0
        if self.routing:
            self.routing.start()
        try:
            for spans in rounds:
                batch = []
                for i, start, end in spans:
                    req = reqs[i]
                    # Tokens [0, start) are in the KV row this request took in an earlier forward
                    # (prepare_for_extend reuses the row of a request that holds one): this extend
                    # computes [start, end) at positions start.. attending to them, and writes their KV
                    # after it. SGLang's scheduler advances its chunked request the same way
                    # (prefix_len = the previous extend_end).
                    req.prefix_len, req.extend_end = start, end
                    batch.append(req)
                self._captured = None
                self._runner.extend(batch)
                final_hidden, aux_hidden = self._hook_output()
                aux_hidden = packed_aux(aux_hidden, final_hidden, self.num_aux)
                if len(rounds) == 1:
                    aux, final = aux_hidden, final_hidden
                    break
                n = final_hidden.shape[0]
                if n != sum(end - start for _, start, end in spans):
                    raise RuntimeError(f"SGLang returned the states of {n} tokens for a forward of "
                                       f"{sum(end - start for _, start, end in spans)}")
                if aux is None:  # filled in place: the batch's states once, not once more for a cat
                    aux = aux_hidden.new_empty((total, aux_hidden.shape[-1]))
                    final = final_hidden.new_empty((total, final_hidden.shape[-1]))
                # the spans are the batch's tokens in order, forward after forward (prefill_rounds)
                aux[done:done + n].copy_(aux_hidden)
                final[done:done + n].copy_(final_hidden)
                done += n
        finally:
            self._runner.clear()  # free the KV cache: every batch is a fresh prefill
        if self.routing:
            self.routing.finish([len(s) for s in sequences])
        return TargetOutput(aux, final, [len(s) for s in sequences])

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], budgets: list[int], regen: Regeneration) -> list[list[int]]:
        """Answers to `prompts` (at most budgets[i] new tokens each), decoded by SGLang's own extend
        and decode steps with the shared sampling rule (target_engine/sampling.py). Every TP rank calls it
        with the same prompts and draws the same tokens (the logits are gathered on every rank), so
        every rank drops the same finished requests from its batch."""
        need = generation_slots([len(p) for p in prompts], budgets, self.kv_page_size)
        if need > self.max_total_tokens:
            raise ValueError(f"generation needs {need} KV slots but the engine's pool holds {self.max_total_tokens}: "
                             f"lower data.regen_group or data.regen_max_new_tokens, or raise hw.max_total_tokens")
        state = {}

        def step(tokens, rows):
            if tokens is None:
                _, logits, state["batch"] = self._runner.extend(self._prefilled_but_last(prompts, budgets))
            else:
                if len(rows) < len(state["rows"]):  # finished requests leave the batch (rows keeps their order)
                    at = {b: k for k, b in enumerate(state["rows"])}
                    state["batch"].filter_batch(keep_indices=[at[b] for b in rows])
                _, logits = self._runner.decode(tokens.to(state["device"]), state["batch"])
            state["rows"], state["device"] = rows, logits.device
            return logits

        try:
            return generate_with(step, prompts, budgets, regen)
        finally:
            self._runner.clear()

    def _prefilled_but_last(self, prompts: list[torch.Tensor], budgets: list[int]) -> list:
        """The requests of `prompts`, ready for the extend that starts their decoding. With a prefill
        chunk and prompts longer than it, everything but each prompt's last token is prefilled first,
        in forwards of at most the chunk (`prefill_rounds`), and the requests returned extend only
        their last token: that last extend holds every request, so it yields every prompt's
        next-token logits and the one batch the decode steps continue."""
        reqs = self._requests(prompts, budgets)
        if self.prefill_chunk is None or sum(len(p) for p in prompts) <= self.prefill_chunk:
            return reqs
        for spans in prefill_rounds([len(p) - 1 for p in prompts], self.prefill_chunk, self.kv_page_size):
            for i, start, end in spans:
                reqs[i].prefix_len, reqs[i].extend_end = start, end  # as in forward
            self._runner.extend([reqs[i] for i, _, _ in spans])
        for req, p in zip(reqs, prompts):
            req.prefix_len, req.extend_end = len(p) - 1, len(p)
        return reqs

    @property
    def kv_page_size(self) -> int:
        """Tokens per page of the KV pool: SGLang gives each request whole pages."""
        return self._runner.torch_runner.token_to_kv_pool_allocator.page_size

    def _requests(self, sequences: list[torch.Tensor], new_tokens: list[int] | None = None) -> list:
        reqs = make_requests(sequences, self._next_rid, new_tokens)
        self._next_rid += len(reqs)
        return reqs

    def warmup(self) -> None:
        """Two small forwards (a static then a dynamic shape), so that SGLang's torch.compile'd
        pieces (DeepSeek's MoE gating) compile now, writing their cache (~/.cache/sglang/inductor),
        rather than during the first real batches."""
        routing, self.routing = self.routing, None  # not counted
        for n in (8, 24):
            self.forward([torch.arange(1, n + 1, dtype=torch.int64)])
        self.routing = routing

    def close(self) -> None:
        """Free the KV pool and, with TP > 1, tear down SGLang's process groups as its own one_batch
        benchmark ends: the TP group's shared-memory broadcaster (SGLang's MessageQueue, created by
        TP rank 0 and registered with Python's resource tracker) is unlinked here, before the
        trainer stops this process, instead of by the tracker with a "leaked shared_memory
        objects" warning. Every TP rank calls it after the last batch."""
        self._runner.clear()
        if self.routing:
            self.routing.counts.save(self.routing_dir)
        if self.tp_size > 1:
            from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
