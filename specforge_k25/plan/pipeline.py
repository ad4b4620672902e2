"""Throughput and memory plan of the target as SGLang pipeline stages (hw.target_pp; the runtime is
target_engine/sglang_pipeline.py with co-located trainer ranks, stream/pipeline_shares.py), and the
check a pipeline run passes before it starts (`check_pipeline_fits`); plan/choose.py searches the
node's shapes for the fastest that fits (`best_pipeline`).

Arithmetic on the target's facts, the draft's shapes and the hw profile, as plan/throughput.py;
nothing is measured here. The layout: the node's GPUs = replicas x pp stages x tp ranks per stage
(stage s of a replica on GPUs first + s*tp ... + tp - 1), a co-located trainer rank beside every
GPU (whole sequences per trainer rank, the draft state sharded over all of them with FSDP2, as
hw.trainer_layout=colocated).

- Layer split: SGLang 0.5.23's default (`srt/distributed/utils.py` get_pp_indices): every stage
  gets num_layers // pp layers and the LAST num_layers % pp stages one more (61 over 8: 7,7,7,8,8,8,8,8; 30 over 2: 15,15);
  SGLANG_PP_LAYER_PARTITION (a list) replaces it. The embedding is on stage 0, the final norm and
  lm_head on the last stage.
- Compute of a stage, per replica token: its layers' share of `target_flops_per_token` (per layer:
  the attention projections, its dense MLP or MoE experts + router, its causal attention; the
  lm_head on the last stage) / tp / (hw.peak_tflops x hw.target_efficiency), or its weights read
  once per micro-batch if slower; + within-stage TP all-reduces (2 per layer, + the vocab-parallel
  embedding's on stage 0; ring, 2(tp-1)/tp of the bytes) when tp > 1.
- Stage transfers over hw.link_gbps: the proxy {hidden_states, residual} (2 x Ht x elem bytes per
  token) from each stage to the next (with tp > 1 each rank sends 1/tp and the receiving ranks
  all-gather); the aux states (Ht x elem each) from the stage owning their capture layer, and the
  final state from the last stage, to the trainer rank of each sequence: a trainer rank on one of
  the owning stage's GPUs reads it on its own GPU (1/pp of the tokens), the rest cross PCIe. A
  GPU's link time = max(bytes in, bytes out) / hw.link_gbps (full duplex, the way the TP
  all-reduce is counted: hw.link_gbps is a bus bandwidth, each GPU sending and receiving at once).
- Trainer: 1/N of the trainer per token on each of the N = pp x tp x replicas trainer ranks
  (compute, AdamW on a 1/N shard, FSDP2's gradient traffic), as the colocated layout counts it.
- A GPU does one thing at a time (its busy seconds add up, no overlap of transfers with compute:
  conservative); the slowest stage sets the rate (forward only: no steady-state bubble once pp
  micro-batches are in flight). Start and drain: (pp - 1) micro-batch times of the slowest stage
  each, once per run (the frozen target never waits for an optimizer step: the stream rings absorb
  the trainer's steps), not per step.
- Memory per stage GPU: its layers' weights (`stage_weight_bytes`: bf16 dense parts from the
  config; the routed experts = what `weight_bytes` leaves, evenly per MoE layer; vocab-parallel
  embedding / lm_head on the first / last stage), the KV of its layers only for pp micro-batches in
  flight (Kimi's MLA latent is not replicated over PP stages: each stage holds its own layers'),
  SGLang's runtime estimate + the captured states it owns for one micro-batch + proxy buffers, the
  Marlin MoE scratch for one forward, the stream ring and a co-located trainer rank's items.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .budget import ENGINE_ACTIVATIONS, GpuBudget, length_problems
from .engine import extend_activation_bytes, extend_tokens, trainer_nccl_bytes
from .facts import GiB, MiB, PlanError, TargetFacts, draft_of, run_capture_points, trainable_params
from .fit import largest_fitting
from .kernels import MARLIN, int4_moe_backend, marlin_scratch_bytes
from .memory import Item, trainer_items
from .throughput import (GPU_ADAMW_S_PER_PARAM, H200_MEMORY_GBPS, TARGET_ALLREDUCE, TARGET_COMPUTE, TRAINER_COMPUTE,
                         TRAINER_EXCHANGE, TRAINER_GRADS, TRAINER_OPTIMIZER, GpuTime, Throughput,
                         compute_bound_tokens_per_s, target_flops_per_token, target_params_per_token, trained_share)

STAGE_TRANSFERS = "stage transfers"
PIPELINE_PARTS = (TARGET_COMPUTE, TARGET_ALLREDUCE, STAGE_TRANSFERS, TRAINER_COMPUTE, TRAINER_EXCHANGE, TRAINER_OPTIMIZER,
                  TRAINER_GRADS)
NOT_RUNNABLE = "predicted; runs with hw.target_pp (CPU-tested; no GPU run yet)"


# ---------------------------------------------------------------------------------- layers
def pp_layer_split(num_layers: int, pp: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """[(start, end)) of each stage's layers: SGLang's default split (num_layers // pp each, one more
    on the last num_layers % pp stages), or `partition` (layers per stage, as
    SGLANG_PP_LAYER_PARTITION)."""
    if pp < 1 or num_layers < pp:
        raise PlanError(f"{num_layers} layers cannot be split over {pp} pipeline stages")
    if partition is None:
        base, extra = divmod(num_layers, pp)
        partition = [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
        raise PlanError(f"partition {partition}: expected {pp} positive counts summing to {num_layers}")
    starts = [sum(partition[:s]) for s in range(pp)]
    return [(a, a + n) for a, n in zip(starts, partition)]


def _dense_layers(facts: TargetFacts) -> int:
    """Layers without routed experts: the first ones (DeepSeek/Kimi's first_k_dense_replace, every
    later layer MoE: moe_layer_freq 1, as Kimi-K2.5)."""
    return facts.num_layers - (facts.num_moe_layers if facts.n_routed_experts else 0)


def layer_flops_per_token(facts: TargetFacts, seq_len: int) -> list[float]:
    """FLOPs per token of each decoder layer in a prefill of `seq_len`-token samples: 2 x its
    activated weights (attention projections; dense MLP or routed top-k + shared experts + router)
    + its causal attention. Their sum + the lm_head is `target_flops_per_token`'s total."""
    p = target_params_per_token(facts)
    L, dense = facts.num_layers, _dense_layers(facts)
    moe = L - dense
    attn_flops = target_flops_per_token(facts, seq_len)["attention (causal, mean over positions)"] / L
    attn_params = p["attention projections"] / L
    mlp = p["dense MLP"] / dense if dense else 0.0
    experts = (p["MoE experts (routed top-k + shared)"] + p["MoE router"]) / moe if moe else 0.0
    return [2.0 * (attn_params + (mlp if i < dense else experts)) + attn_flops for i in range(L)]


def stage_flops_per_token(facts: TargetFacts, seq_len: int, split: list[tuple[int, int]]) -> list[float]:
    per_layer = layer_flops_per_token(facts, seq_len)
    lm_head = target_flops_per_token(facts, seq_len)["lm_head (last position of a sample)"]
    return [sum(per_layer[a:b]) + (lm_head if s == len(split) - 1 else 0.0) for s, (a, b) in enumerate(split)]


@dataclass(frozen=True)
class LayerWeights:
    """Bytes of each decoder layer (bf16 dense parts + INT4/bf16 routed experts), of them the ones
    SGLang's TP replicates on every rank, and the embedding and lm_head (each V x Ht)."""

    layers: tuple[int, ...]
    replicated: tuple[int, ...]
    embedding: int
    lm_head: int
    experts_per_moe_layer: int


def layer_weight_bytes(facts: TargetFacts) -> LayerWeights:
    """How the memory plan splits `facts.weight_bytes` over the layers: every dense part from the
    config in `weight_dtype_bytes` (attention projections of every layer; the dense MLP of the
    first dense layers; the shared experts and the router of each MoE layer; the embedding and a
    separate lm_head, V x Ht each: under PP the last stage builds its own lm_head even for tied
    embeddings); the routed experts are what `weight_bytes` leaves (Kimi-K2.5: INT4 + group scales,
    571.5 GB, 9.53 GB per MoE layer; the vision tower and norms are inside that rest), evenly over
    the MoE layers. A dense target's rest (norms, rounding) is spread evenly over all layers."""
    p = target_params_per_token(facts)
    wb, L, Ht, dense = facts.weight_dtype_bytes, facts.num_layers, facts.hidden_size, _dense_layers(facts)
    moe = L - dense
    attn = p["attention projections"] // L
    mlp = p["dense MLP"] // dense if dense else 0
    shared = facts.n_shared_experts * 3 * Ht * facts.moe_intermediate_size
    router = facts.n_routed_experts * Ht if moe else 0
    vocab = facts.vocab_size * Ht * wb
    dense_bytes = [wb * (attn + (mlp if i < dense else shared + router)) for i in range(L)]
    rest = max(0, facts.weight_bytes - sum(dense_bytes) - 2 * vocab)
    per_moe = rest // moe if moe else 0
    spread = 0 if moe else rest // L
    layers = tuple(d + (per_moe if i >= dense else spread) for i, d in enumerate(dense_bytes))
    # SGLang's TP keeps whole on every rank: the MLA down-projection of each layer, the router of each MoE layer
    down = ((facts.q_lora_rank or 0) + facts.kv_lora_rank + facts.qk_rope_head_dim) * Ht * wb if facts.is_mla else 0
    replicated = tuple(down + (router * wb if i >= dense else 0) for i in range(L))
    return LayerWeights(layers, replicated, vocab, vocab, per_moe)


def stage_weight_bytes(facts: TargetFacts, split: list[tuple[int, int]], tp: int = 1) -> list[int]:
    """Weights on one GPU of each stage: (its layers - their replicated parts) / tp + the replicated
    parts, + the vocab-parallel embedding / tp on stage 0 and lm_head / tp on the last stage."""
    w = layer_weight_bytes(facts)
    out = []
    for s, (a, b) in enumerate(split):
        rep = sum(w.replicated[a:b])
        total = sum(w.layers[a:b]) + (w.embedding if s == 0 else 0) + (w.lm_head if s == len(split) - 1 else 0)
        out.append(math.ceil((total - rep) / tp) + rep)
    return out


def kv_bytes_per_token_per_layer(facts: TargetFacts, tp: int) -> int:
    return facts.kv_bytes_per_token(tp) // facts.num_layers


def owned_states(split: list[tuple[int, int]], points: list[int]) -> list[list[str]]:
    """The states each stage sends to the trainer ranks: aux point p (the input of layer p) from the
    stage holding layer p, the final state from the last stage."""
    out: list[list[str]] = [[] for _ in split]
    for p in points:
        s = next(i for i, (a, b) in enumerate(split) if a <= p < b)
        out[s].append(f"aux {p}")
    out[-1].append("final")
    return out


# ------------------------------------------------------------------------------ prediction
@dataclass
class PipelinePlan:
    """A pipeline layout's throughput (`throughput`, as the TP layouts') and what is only PP's."""

    pp: int
    tp: int
    replicas: int
    split: list[tuple[int, int]]
    states: list[list[str]]  # per stage, the captured states it sends
    stage_seconds: list[float]  # per stage, busy seconds per replica token of its busiest GPU
    micro_batch_tokens: int
    fill_s: float  # start (and drain): (pp - 1) micro-batches of the slowest stage, once per run
    throughput: Throughput
    memory: Optional[list[GpuBudget]] = None
    memory_problems: list[str] = field(default_factory=list)
    mem_fraction_min: Optional[float] = None
    partition: Optional[list[int]] = None  # SGLANG_PP_LAYER_PARTITION; None: SGLang's default split

    @property
    def name(self) -> str:
        return pipeline_name(self.pp, self.tp, self.replicas)

    @property
    def setting(self) -> str:
        """The layer split as SGLang would be told it."""
        return ("SGLang's default split " if self.partition is None else "SGLANG_PP_LAYER_PARTITION=") + \
            ",".join(str(b - a) for a, b in self.split)

    @property
    def bottleneck_stage(self) -> int:
        return max(range(self.pp), key=lambda s: self.stage_seconds[s])

    @property
    def fits(self) -> bool:
        return self.memory is not None and not self.memory_problems


def pipeline_name(pp: int, tp: int, replicas: int = 1) -> str:
    return f"pipeline PP{pp} x TP{tp}" + (f" x {replicas} replicas" if replicas > 1 else "")


def predict_pipeline(job, facts: TargetFacts, pp: int, tp: int = 1, replicas: int | None = None,
                     partition: list[int] | None = None, memory: bool = True,
                     padding_share: float = 0.0) -> PipelinePlan:
    """The node in `replicas` (default: as many as fit) pipelines of `pp` stages of `tp` GPUs, a
    trainer rank beside every GPU; PlanError without the throughput inputs. `padding_share` as in
    plan/throughput.py `predict`."""
    real = trained_share(padding_share)
    hw, tr = job.hw, job.train
    missing = [k for k in ("peak_tflops", "memory_gbps", "link_gbps") if getattr(hw, k) <= 0]
    if missing:
        raise PlanError(f"no throughput plan for hw={hw.name}: set " + ", ".join(f"hw.{k}" for k in missing))
    replicas = replicas or hw.num_gpus // (pp * tp)
    if replicas < 1 or pp * tp * replicas > hw.num_gpus:
        raise PlanError(f"PP{pp} x TP{tp} x {replicas} replicas does not fit on {hw.num_gpus} GPUs")
    split = pp_layer_split(facts.num_layers, pp, partition)
    method, cfg = draft_of(job, facts)
    B, L, accum = tr.batch_size, job.data.max_length, tr.grad_accum
    K = method.depth(job.draft, cfg)
    N = pp * tp * replicas  # trainer ranks, one per GPU
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4
    a = 2 if hw.autocast == "bf16" else 4
    peak, link, mem = hw.peak_tflops * 1e12, hw.link_gbps * 1e9, hw.memory_gbps * 1e9
    Ht = facts.hidden_size
    micro = B * L * tp  # one micro-batch: one for each trainer rank beside a stage's TP ranks; pp of them in flight

    # target stages
    flops = stage_flops_per_token(facts, L, split)
    weights = stage_weight_bytes(facts, split, tp)
    points = run_capture_points(job, facts.num_layers)
    states = owned_states(split, points)
    proxy = 2 * Ht * elem  # {hidden_states, residual} per token
    remote = 1.0 - 1.0 / pp  # tokens whose trainer rank sits on another stage's GPUs
    # trainer (as the colocated layout): 1/N of it per token on each GPU
    steps = method.plan.draft_step_flops(cfg, B, L, K, tr.activation_checkpointing)
    c_compute = steps["total"] / (B * L) / (peak * hw.trainer_efficiency) / real
    P = trainable_params(cfg, method)
    opt_s = -(-P // N) * GPU_ADAMW_S_PER_PARAM * H200_MEMORY_GBPS * 1e9 / mem
    grads_s = (4 * P + accum * a * P) * (N - 1) / N / link
    step_tokens = B * L * accum * real

    gpus, stage_seconds = [], []
    for s, (lo, hi) in enumerate(split):
        compute = max(flops[s] / tp / (peak * hw.target_efficiency), weights[s] / mem / (micro * real))
        ar_layers = 2 * (hi - lo) + (1 if s == 0 else 0)
        allreduce = ar_layers * Ht * elem * 2 * (tp - 1) / tp / link if tp > 1 else 0.0
        # per GPU of the stage, bytes per replica token
        out_b = (proxy / tp if s < pp - 1 else 0.0) + len(states[s]) * Ht * elem * remote / tp
        in_b = 0.0
        if s > 0:  # the previous stage's 1/tp, then the all-gather of the rest inside the stage
            in_b += proxy / tp + proxy * (tp - 1) / tp
            out_b += proxy * (tp - 1) / tp
        # this GPU's trainer rank reads its sequences' states (1/N of the replica's tokens x replicas)
        others = sum(len(x) for i, x in enumerate(states) if i != s)
        in_b += others * Ht * elem * replicas / N
        transfers = max(in_b, out_b) / link
        share = replicas / N  # of the replica's tokens, each trainer rank trains 1/N of the node's
        parts = {TARGET_COMPUTE: compute, TARGET_ALLREDUCE: allreduce, STAGE_TRANSFERS: transfers,
                 TRAINER_COMPUTE: share * c_compute, TRAINER_OPTIMIZER: share * opt_s / step_tokens,
                 TRAINER_GRADS: share * grads_s / step_tokens}
        role = f"stage {s}: layers {lo}-{hi - 1}" + (f" ({', '.join(states[s])})" if states[s] else "")
        stage_seconds.append(sum(parts.values()))
        for r in range(replicas):
            for t in range(tp):
                gpus.append(GpuTime(r * pp * tp + s * tp + t, role + " + trainer rank", dict(parts)))
    rate = 1.0 / max(stage_seconds)
    target_s = [sum(g.parts[k] for k in (TARGET_COMPUTE, TARGET_ALLREDUCE, STAGE_TRANSFERS)) for g in gpus[:pp * tp:tp]]
    fill = (pp - 1) * micro * max(target_s)  # the trainer ranks have nothing to train yet
    c_flops = steps["total"] / (B * L) / real
    balanced = N / (sum(g.parts[TARGET_COMPUTE] + g.parts[TARGET_ALLREDUCE] + g.parts[STAGE_TRANSFERS]
                        for g in gpus[:pp * tp]) + c_compute)
    src = f"conf/hw/{hw.name}.yaml"
    inputs = [
        ("layer split", ",".join(str(b - a_) for a_, b in split),
         "SGLang 0.5.23 default (distributed/utils.py get_pp_indices): extra layers on the last stages"
         if partition is None else "SGLANG_PP_LAYER_PARTITION (the default's counts, extra layers on the first "
                                   "stages: the last stage also holds the lm_head)"),
        ("stage weights per GPU", ", ".join(f"{w / 1e9:.1f}" for w in weights) + " GB",
         "plan/pipeline.py layer_weight_bytes: bf16 dense parts from the config, routed experts = the rest of "
         "the weights"),
        ("proxy per token per boundary", f"{proxy / 1e3:.1f} KB", f"2 x Ht x {elem} B (hidden_states, residual)"),
        ("captured states per token", f"{len(points)} aux + final, {Ht * elem / 1e3:.1f} KB each",
         f"target.aux_layers {points}: " + "; ".join(f"stage {i}: {', '.join(x)}" for i, x in enumerate(states) if x)),
        ("micro-batch", f"{micro:,} tokens, {pp} in flight", "train.batch_size x data.max_length x tp"),
        ("start / drain", f"{fill:.2f} s once per run", f"({pp} - 1) micro-batches of the slowest stage's target work"),
        ("link", f"{hw.link_gbps:,.0f} GB/s", f"hw.link_gbps ({src}): max(bytes in, bytes out) per GPU"),
    ]
    t = Throughput(pipeline_name(pp, tp, replicas), gpus, replicas, balanced, inputs,
                   [NOT_RUNNABLE], compute_bound_tokens_per_s(hw, facts, L, c_flops))
    assert abs(t.replica_tokens_per_s - rate) <= 1e-9 * rate
    plan = PipelinePlan(pp, tp, replicas, split, states, stage_seconds, micro, fill, t, partition=partition)
    if memory and hw.device == "cuda":
        plan.memory, plan.memory_problems, plan.mem_fraction_min = pipeline_memory(job, facts, pp, tp, replicas,
                                                                                   partition)
    return plan


# ---------------------------------------------------------------------------------- memory
def pipeline_memory(job, facts: TargetFacts, pp: int, tp: int = 1, replicas: int = 1,
                    partition: list[int] | None = None, *, max_length: int | None = None
                    ) -> tuple[list[GpuBudget], list[str], Optional[float]]:
    """Each stage GPU's items (one GPU per stage: a stage's TP ranks are alike; the replicas too),
    the problems (a GPU over capacity, SGLang's static fraction >= 1) and SGLang's smallest
    mem_fraction_static (one value for all stages: the largest any stage needs)."""
    hw, tr = job.hw, job.train
    L = max_length or job.data.max_length
    B = tr.batch_size
    split = pp_layer_split(facts.num_layers, pp, partition)
    method, cfg = draft_of(job, facts)
    num_aux = method.num_aux(cfg)
    N = pp * tp * replicas
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4
    ctx = int(hw.cuda_context_gib * GiB)
    capacity = hw.gpu_memory_mib * MiB
    micro = B * L * tp
    kv_tokens = max(hw.max_total_tokens, pp * micro)  # pp micro-batches in flight (SGLang's event_loop_pp)
    forward = extend_tokens(hw, micro)  # one chunk of the prefill (plan/engine.py)
    weights = stage_weight_bytes(facts, split, tp)
    kv_layer = kv_bytes_per_token_per_layer(facts, tp)
    points = run_capture_points(job, facts.num_layers)
    states = owned_states(split, points)
    t_items = trainer_items(cfg, batch=B, seq_len=L, ttt_length=method.depth(job.draft, cfg),
                            teacher_chunk=tr.teacher_chunk, bf16=hw.autocast == "bf16", data_parallel=True,
                            context_bytes=ctx, frozen_bytes=elem, checkpoint=tr.activation_checkpointing,
                            shards=N, method=method)
    nccl, nccl_how = trainer_nccl_bytes(hw, N, 1)
    if nccl:
        t_items.append(Item("NCCL buffers (trainer communicators)", nccl, note=nccl_how))
    ring = Item("stream ring slots (aux + final)", tr.stream_slots * B * L * (num_aux + 1) * facts.hidden_size * elem,
                owner="stream", note=f"{tr.stream_slots} x {B * L} tokens x {num_aux + 1}Ht x {elem} B")
    budgets, problems, frac = [], [], 0.0
    for s, (lo, hi) in enumerate(split):
        n = hi - lo
        items = [
            Item("CUDA context (SGLang stage rank)", ctx, owner="target"),
            Item("target weights (the stage's layers)", weights[s], owner="target",
                 note=f"layers {lo}-{hi - 1}" + (" + embedding" if s == 0 else "")
                 + (" + lm_head" if s == pp - 1 else "") + (f", / TP{tp} (replicated parts whole)" if tp > 1 else "")),
            Item("KV cache pool (the stage's layers)", kv_tokens * n * kv_layer, owner="target",
                 note=f"{kv_tokens} tokens x {n} layers x {kv_layer} B"),
            Item("SGLang multimodal reservation", 100 * MiB if facts.multimodal else 0, owner="target"),
            Item("SGLang runtime (activations, workspaces)",
                 int(hw.target_runtime_gib * GiB) + micro * (len(states[s]) + 4) * facts.hidden_size * elem,
                 owner="target", note="hw.target_runtime_gib + its captured states + one proxy in and one out "
                                      "(2Ht each), one micro-batch"),
        ]
        items.append(Item(ENGINE_ACTIVATIONS, extend_activation_bytes(hw, facts, forward), owner="target",
                          note=f"{forward} tokens (plan/engine.py)"))
        if int4_moe_backend(hw, facts) == MARLIN and any(i >= facts.num_layers - facts.num_moe_layers
                                                         for i in range(lo, hi)):
            items.append(Item("SGLang Marlin MoE scratch (INT4 experts)", marlin_scratch_bytes(facts, forward, tp),
                              owner="target", note=f"{forward} tokens, N = expert width / TP{tp}"))
        items.append(ring)
        items += list(t_items)
        g = GpuBudget(s * tp, f"stage {s} + stream ring + trainer rank", capacity, [i for i in items if i.bytes])
        budgets.append(g)
        static = weights[s] + kv_tokens * n * kv_layer + (100 * MiB if facts.multimodal else 0)
        preloaded = ring.bytes + sum(i.bytes for i in t_items if i.phase is None
                                     and not i.name.startswith(("draft grads", "AdamW")))
        pre = capacity - ctx - preloaded
        frac = max(frac, (static + int(hw.kv_pool_margin_gib * GiB)) / pre if pre > 0 else math.inf)
        if g.total() > capacity:
            problems.append(f"stage {s} (GPU {g.gpu}) needs {g.total() / GiB:.2f} of {capacity / GiB:.2f} GiB")
    if frac >= 1:
        problems.append(f"a stage does not load: weights + KV need {frac:.3f} of its free memory")
    problems += length_problems(facts, L)
    return budgets, problems, frac


def longest_pipeline_length(job, facts: TargetFacts, pp: int, tp: int = 1, replicas: int = 1,
                            partition: list[int] | None = None) -> Optional[int]:
    """The longest data.max_length (multiple of 256) whose pipeline memory fits, or None."""
    def fits(length: int) -> bool:
        return not pipeline_memory(job, facts, pp, tp, replicas, partition, max_length=length)[1]
    return largest_fitting(fits, facts.max_position_embeddings + 1)


def first_stages_partition(num_layers: int, pp: int) -> Optional[list[int]]:
    """The default split's layer counts with the extra layers on the FIRST stages (None when the
    layers divide evenly): as fast (the same largest stage), lighter on the last stage, which also
    holds the lm_head (rtxpro6000x8, Kimi: 8,8,8,8,8,7,7,7)."""
    counts = [b - a for a, b in pp_layer_split(num_layers, pp)]
    return None if len(set(counts)) == 1 else counts[::-1]


def check_pipeline_fits(job, facts: TargetFacts) -> None:
    """A run with hw.target_pp > 1 (co-located trainer ranks beside the stages): PlanError unless
    every stage GPU fits (`pipeline_memory`) and hw.mem_fraction_static covers the fullest stage's
    weights and KV. Nothing to plan on CPU (hw.gpu_memory_mib 0)."""
    hw = job.hw
    if hw.gpu_memory_mib <= 0:
        return
    if hw.trainer_layout != "colocated":
        raise PlanError(f"hw.target_pp={hw.target_pp} with hw.trainer_layout={hw.trainer_layout}: the plan covers "
                        f"trainer ranks beside the stages (hw.trainer_layout=colocated); launch without a memory "
                        f"plan with hw.gpu_memory_mib=0")
    partition = env_partition(facts.num_layers, hw.target_pp)
    _, problems, frac = pipeline_memory(job, facts, hw.target_pp, hw.target_tp, partition=partition)
    if frac is not None and frac < 1 and hw.mem_fraction_static < frac:
        problems.append(f"hw.mem_fraction_static={hw.mem_fraction_static} is below what SGLang needs for the fullest "
                        f"stage's weights and KV pool: set hw.mem_fraction_static={math.ceil(frac * 100) / 100}")
    if problems:
        longest = longest_pipeline_length(job, facts, hw.target_pp, hw.target_tp, partition=partition)
        fix = f"; the longest data.max_length that fits is {longest}" if longest else ""
        raise PlanError("the pipeline run does not fit:\n" + "\n".join(f"  - {p}" for p in problems) + fix)


def env_partition(num_layers: int, pp: int) -> Optional[list[int]]:
    """SGLANG_PP_LAYER_PARTITION as the stage processes will read it (they inherit the environment)."""
    import os

    value = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    if not value:
        return None
    counts = [int(v) for v in value.split(",")]
    if len(counts) != pp or sum(counts) != num_layers:
        raise PlanError(f"SGLANG_PP_LAYER_PARTITION={value}: expected {pp} layer counts summing to {num_layers}")
    return counts
