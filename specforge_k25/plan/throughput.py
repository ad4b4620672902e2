"""Throughput plan of a node: seconds per token on every GPU for the target's prefill and for the
draft trainer, in either trainer layout (hw.trainer_layout), and the node tokens/s they imply.

Arithmetic on the target's facts, the draft's shapes and the hw profile; nothing is measured here.

- Tokens are counted per replica. Every TP rank of a replica prefills every token of its batches
  (its 1/tp of the FLOPs, plus the TP all-reduces); a trainer rank trains a share s of them:
  dedicated s = 1 on the replica's trainer GPU, colocated s = 1/tp on every GPU of the replica.
- A GPU does one thing at a time, so its busy seconds per replica token add up: target compute +
  target all-reduce + s x (trainer compute + its optimizer step and gradient traffic per token).
  A replica runs at 1 / max(busy): its TP ranks move in lock step (every layer all-reduces) and the
  stream's back-pressure ties the target to its trainer. Conservative where a GPU holds both: the
  trainer's kernels could fill the target's all-reduce waits.
- Idle share of a GPU = 1 - busy x rate. The balanced bound is the node with every GPU busy on the
  work each layout must do (the prefill with its all-reduces, the trainer's FLOPs): optimizer
  steps, gradient traffic and context parallelism's sequence exchanges (the attention all-to-alls
  of hw.context_parallel, over hw.link_gbps like the rest), which the layouts pay differently, are
  left out of it. The compute bound (`compute_bound_tokens_per_s`) is the node busy on FLOPs only,
  the same for every layout.
- The target as pipeline stages (hw.target_pp; predicted here) is planned in
  plan/pipeline.py on the same parts; plan/choose.py picks the fastest pipeline shape and puts every
  draft method in the job's place (`compare_methods`) on both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..draft.method import DraftMethod
from .budget import LAYOUTS, context_parallel, node_layout, optimizer_device, target_batch_tokens, with_layout
from .facts import PlanError, TargetFacts, draft_of, method_of_config, trainable_params

# NVIDIA H200 SXM datasheet: dense BF16 tensor-core peak and HBM3e bandwidth; the GPU the trainer was measured on
H200_PEAK_TFLOPS = 989.5
H200_MEMORY_GBPS = 4800.0
# The optimizer step of the 963,407,872-parameter Kimi draft on that H200 (median optim_s at T=2048):
# foreach AdamW next to the weights (docs/gpu_h200/shapes_default.json: 0.0227 s), and OffloadedAdamW
# on the host: grads to pinned memory, fused CPU AdamW on 16 threads, weights back (shapes_rtx.json: 0.367 s)
GPU_ADAMW_S_PER_PARAM = 0.0227 / 963_407_872  # memory bound: scaled by H200_MEMORY_GBPS / hw.memory_gbps
# Host AdamW, per thread: torch's fused CPU kernel on one thread, 1.25 ns per parameter over a
# 33.6M-parameter shard (benchmarks/host_adamw.py, docs/PERFORMANCE.md §3.1; the default per-tensor
# loop 8.4), divided by the rank's threads (hw.host_threads_per_rank; linear: optimistic once the
# threads saturate the host's memory bandwidth). The H200 host's 0.367 s is that compute on 16
# threads plus the copies OffloadedAdamW makes (grads down, weights up: 8 B per parameter over
# PCIe), which the dedicated layout pays on top; FSDP2's offload copies are counted over the link.
HOST_ADAMW_S_PER_PARAM_THREAD = 1.25e-9
PLAN_HOST_THREADS = 16  # hw.host_threads_per_rank=null: the node's cores are not in the profile; the H200 run's
HOST_COPY_S_PER_PARAM = 0.367 / 963_407_872 - HOST_ADAMW_S_PER_PARAM_THREAD / 16


def host_adamw_s_per_param(threads: int) -> float:
    """Seconds per parameter of the fused host AdamW on `threads` threads."""
    return HOST_ADAMW_S_PER_PARAM_THREAD / threads


def internode_grads_s(params: int, ranks: int, nodes: int, internode_gbps: float) -> float:
    """Seconds per step of the gradients' trip across nodes: HSDP (train/sharding.py) all-reduces
    each rank's reduce-scattered fp32 shard (4P / ranks bytes) with the same rank of every other
    node, a ring over `nodes` (2 (n-1)/n of it over each rank's share of the inter-node network,
    hw.internode_gbps); DDP (dedicated) across nodes moves the same per GPU. 0 on one node."""
    if nodes <= 1:
        return 0.0
    if internode_gbps <= 0:
        raise PlanError(f"{nodes} nodes: set hw.internode_gbps (the inter-node bandwidth per GPU) for the throughput plan")
    return 4 * (-(-params // ranks)) * 2 * (nodes - 1) / nodes / (internode_gbps * 1e9)

TARGET_COMPUTE, TARGET_ALLREDUCE = "target compute", "target all-reduce"
TRAINER_COMPUTE, TRAINER_OPTIMIZER, TRAINER_GRADS = "trainer compute", "optimizer step", "gradient traffic"
TRAINER_EXCHANGE = "sequence exchange"  # hw.context_parallel's all-to-alls
PARTS = (TARGET_COMPUTE, TARGET_ALLREDUCE, TRAINER_COMPUTE, TRAINER_EXCHANGE, TRAINER_OPTIMIZER, TRAINER_GRADS)


# ------------------------------------------------------------------------------- trainer
def draft_step_flops(cfg, batch: int, seq_len: int, ttt_length: int, checkpoint: bool = False,
                     method: DraftMethod | None = None) -> dict:
    """Analytic FLOPs of one draft training step ({"teacher", "draft_fwd", "draft_bwd",
    "draft_recompute", "attention_fwd", "attention_bwd", "total"}), as the draft's method counts
    them (its `plan` module; torch's flop counter checks each method's count in the tests)."""
    method = method if method is not None else method_of_config(cfg)
    return method.plan.draft_step_flops(cfg, batch, seq_len, ttt_length, checkpoint)


# -------------------------------------------------------------------------------- target
def target_params_per_token(facts: TargetFacts) -> dict[str, int]:
    """The weights one token multiplies in a prefill (the activated parameters), by module. The
    embedding is a lookup, not a matmul; the lm_head is in `target_flops_per_token`."""
    Ht, nh, L = facts.hidden_size, facts.num_attention_heads, facts.num_layers
    if facts.is_mla:
        if facts.qk_nope_head_dim is None or facts.v_head_dim is None:
            raise PlanError(f"target {facts.name}: MLA without qk_nope_head_dim / v_head_dim in its config")
        qk, v, latent = facts.qk_nope_head_dim + facts.qk_rope_head_dim, facts.v_head_dim, facts.kv_lora_rank
        q = Ht * facts.q_lora_rank + facts.q_lora_rank * nh * qk if facts.q_lora_rank else Ht * nh * qk
        # q (down + up), kv_a [Ht, latent + rope], kv_b [latent, nh*(nope + v)] (prefill decompresses K/V), o
        attn = q + Ht * (latent + facts.qk_rope_head_dim) + latent * nh * (facts.qk_nope_head_dim + v) + nh * v * Ht
    else:
        hd, nkv = facts.head_dim, facts.num_key_value_heads
        attn = Ht * nh * hd + 2 * Ht * nkv * hd + nh * hd * Ht
    moe = facts.num_moe_layers if facts.n_routed_experts else 0
    experts = facts.num_experts_per_tok + facts.n_shared_experts
    return {
        "attention projections": L * attn,
        "dense MLP": (L - moe) * 3 * Ht * facts.intermediate_size,
        "MoE experts (routed top-k + shared)": moe * experts * 3 * Ht * facts.moe_intermediate_size,
        "MoE router": moe * facts.n_routed_experts * Ht,
    }


def target_flops_per_token(facts: TargetFacts, seq_len: int) -> dict[str, float]:
    """Prefill FLOPs per token of samples of `seq_len` tokens: 2 x the activated parameters; the
    causal attention (a token at position t meets t keys: QK^T over the q/k head width, PV over the
    value width; mean (seq_len + 1) / 2 keys); the lm_head for the last position of each sample
    only (the engine asks for no prompt logprobs: target_engine/sglang_engine.py logprob_start_len=-1)."""
    params = sum(target_params_per_token(facts).values())
    nh = facts.num_attention_heads
    if facts.is_mla:  # SGLang's MLA prefill runs as MHA on the decompressed K/V
        qk, v = facts.qk_nope_head_dim + facts.qk_rope_head_dim, facts.v_head_dim
    else:
        qk = v = facts.head_dim
    out = {
        "matmuls (2 x activated params)": 2.0 * params,
        "attention (causal, mean over positions)": facts.num_layers * 2 * nh * (qk + v) * (seq_len + 1) / 2,
        "lm_head (last position of a sample)": 2.0 * facts.vocab_size * facts.hidden_size / seq_len,
    }
    out["total"] = sum(out.values())
    return out


def allreduce_bytes_per_token(facts: TargetFacts, elem: int) -> int:
    """Bytes one token adds to the target's TP all-reduces: SGLang 0.5.23's DeepSeek/Llama layers
    reduce the residual stream twice per layer (after attention, after the MLP/MoE) and the
    vocab-parallel embedding once, [tokens, Ht] in the target's dtype each time."""
    return (2 * facts.num_layers + 1) * facts.hidden_size * elem


def compute_bound_tokens_per_s(hw, facts: TargetFacts, seq_len: int, trainer_flops_per_token: float) -> float:
    """The node's tokens/s with every GPU busy on FLOPs only: the target's prefill at
    hw.target_efficiency and the trainer's at hw.trainer_efficiency, no communication, no optimizer
    step (the same for every layout: issue 23's "compute bound")."""
    peak = hw.peak_tflops * 1e12
    per_token = (target_flops_per_token(facts, seq_len)["total"] / (peak * hw.target_efficiency)
                 + trainer_flops_per_token / (peak * hw.trainer_efficiency))
    return hw.num_gpus / per_token


# ---------------------------------------------------------------------------- prediction
@dataclass
class GpuTime:
    gpu: int
    role: str
    parts: dict[str, float] = field(default_factory=dict)  # seconds per replica token, by PARTS

    @property
    def busy(self) -> float:
        return sum(self.parts.values())


@dataclass
class Throughput:
    layout: str
    gpus: list[GpuTime]
    replicas: int
    balanced_tokens_per_s: float
    inputs: list[tuple[str, str, str]]  # (input, value, source)
    notes: list[str] = field(default_factory=list)
    compute_bound_tokens_per_s: float = 0.0  # every GPU busy on FLOPs only (`compute_bound_tokens_per_s`)

    @property
    def replica_tokens_per_s(self) -> float:
        return 1.0 / max(g.busy for g in self.gpus)

    @property
    def tokens_per_s(self) -> float:
        return self.replicas * self.replica_tokens_per_s

    @property
    def of_bound(self) -> float:
        return self.tokens_per_s / self.balanced_tokens_per_s

    @property
    def of_compute_bound(self) -> float:
        return self.tokens_per_s / self.compute_bound_tokens_per_s if self.compute_bound_tokens_per_s else math.nan

    def idle(self, g: GpuTime) -> float:
        return 1.0 - g.busy * self.replica_tokens_per_s

    def gpu(self, gpu_id: int) -> GpuTime:
        return next(g for g in self.gpus if g.gpu == gpu_id)

    @property
    def bottleneck(self) -> tuple[GpuTime, str]:
        """The busiest GPU and the largest part of its time."""
        g = max(self.gpus, key=lambda x: x.busy)
        return g, max(g.parts, key=g.parts.get)


def trained_share(padding_share: float) -> float:
    """The share of the trainer's positions that are real tokens (1 - padding_share); ValueError
    outside [0, 1)."""
    if not 0.0 <= padding_share < 1.0:
        raise ValueError(f"padding share {padding_share} outside [0, 1)")
    return 1.0 - padding_share


def predict(job, facts: TargetFacts, layout: str | None = None, padding_share: float = 0.0,
            nodes: int = 1) -> Throughput:
    """The throughput of one node of `job` in `layout` (default hw.trainer_layout); PlanError when
    the profile has no throughput inputs (hw.peak_tflops, hw.memory_gbps, hw.link_gbps).

    `nodes`: nodes of data parallel, each running this node's layout; the gradients also cross
    the nodes once per step (`internode_grads_s` over hw.internode_gbps, part of "gradient traffic").

    `padding_share`: of the positions a trainer rank computes, the share that is padding (the run
    plan's, train/schedule.py `padding_share`; 0: every micro-batch full). The target prefills only
    real tokens (its batches are packed), so padding costs the trainer: per real token its compute
    grows by 1 / (1 - share), and a step holds that much fewer real tokens. Tokens/s counts real ones."""
    real = trained_share(padding_share)
    hw = job.hw if layout is None else with_layout(job.hw, layout)
    missing = [k for k in ("peak_tflops", "memory_gbps", "link_gbps") if getattr(hw, k) <= 0]
    if missing:
        raise PlanError(f"no throughput plan for hw={hw.name}: set " + ", ".join(f"hw.{k}" for k in missing))
    if hw.target_nnodes != 1:
        raise PlanError("the throughput plan covers a target on one node (hw.target_nnodes=1)")
    layout = node_layout(hw)
    tr, coloc = job.train, layout.colocated
    method, cfg = draft_of(job, facts)
    B, L, K, accum = tr.batch_size, job.data.max_length, method.depth(job.draft, cfg), tr.grad_accum
    groups, trainers = layout.groups, layout.trainer_gpus
    tp, ranks = layout.tp, len(trainers)
    P = trainable_params(cfg, method)
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4
    a = 2 if hw.autocast == "bf16" else 4  # the trainer's compute dtype: FSDP2 gathers its params in it
    peak, link, mem = hw.peak_tflops * 1e12, hw.link_gbps * 1e9, hw.memory_gbps * 1e9

    # target, on each TP rank per replica token: its 1/tp of the FLOPs, or reading its weights once per
    # batch if that takes longer; then the all-reduces (ring: 2(tp-1)/tp of the bytes cross each link)
    tflops = target_flops_per_token(facts, L)
    batch = target_batch_tokens(hw, B, L)
    t_compute = max(tflops["total"] / tp / (peak * hw.target_efficiency),
                    facts.weight_bytes_per_gpu(hw.target_tp) / mem / (batch * real))
    ar_bytes = allreduce_bytes_per_token(facts, elem)
    t_allreduce = ar_bytes * 2 * (tp - 1) / tp / link

    # trainer, per token it trains; optimizer and gradient traffic once per step of `step_tokens`
    flops = method.plan.draft_step_flops(cfg, B, L, K, tr.activation_checkpointing)
    c_compute = flops["total"] / (B * L) / (peak * hw.trainer_efficiency) / real
    step_tokens = B * L * accum * real
    gpu_adamw = GPU_ADAMW_S_PER_PARAM * H200_MEMORY_GBPS * 1e9 / mem  # seconds per parameter on this GPU
    opt_dev = optimizer_device(tr.optimizer_device, hw.device, trainers)
    threads = hw.host_threads_per_rank or PLAN_HOST_THREADS
    host_adamw = host_adamw_s_per_param(threads)
    if coloc:  # FSDP2: AdamW on this rank's shard; reduce-scatter fp32 grads per step, all-gather params per micro-batch
        shard = -(-P // ranks)
        gathers = accum * (1 if method.keep_units_gathered else 2)  # a freed unit is gathered again for its backward
        grads_s = (4 * P + gathers * a * P) * (ranks - 1) / ranks / link
        grads_how = f"reduce-scatter 4P + {gathers} x all-gather {a}P over {ranks} ranks"
        if opt_dev == "cpu":  # FSDP2's CPU offload: host AdamW on the shard; the fp32 shard up per gather, grads down
            opt_s = shard * host_adamw + 4 * shard * gathers / link
            opt_how = (f"fused host AdamW on a 1/{ranks} shard on {threads} threads (FSDP2 CPU offload, "
                       f"+ {gathers} x 4P/{ranks} up)")
        else:
            opt_s, opt_how = shard * gpu_adamw, f"AdamW on a 1/{ranks} shard on the GPU"
    else:
        if opt_dev == "cpu":
            opt_s = P * (host_adamw + HOST_COPY_S_PER_PARAM)
            opt_how = f"fused host AdamW on {threads} threads + grads down, weights up (train.optimizer_device=cpu)"
        elif isinstance(opt_dev, int):  # grads to that GPU and weights back over the link
            opt_s, opt_how = P * gpu_adamw + 8 * P / link, f"AdamW on cuda:{opt_dev} (+ 8P over the link)"
        else:
            opt_s, opt_how = P * gpu_adamw, "AdamW on the trainer GPU"
        grads_s = 4 * P * 2 * (ranks - 1) / ranks / link if ranks > 1 else 0.0
        grads_how = f"DDP all-reduce of 4P over {ranks} ranks" if ranks > 1 else "none (one rank)"
    if nodes > 1:
        grads_s += internode_grads_s(P, ranks, nodes, hw.internode_gbps)
        grads_how += (f"; across {nodes} nodes: all-reduce of the 4P/{ranks} grad shard over hw.internode_gbps="
                      f"{hw.internode_gbps:g} GB/s" + (" (HSDP)" if coloc else ""))

    # context parallelism: per position a rank holds, the attention exchanges of the whole loss (every
    # TTT step, or every layer), forward and backward (and the recompute's forward with checkpointing),
    # over the same link
    cp = context_parallel(hw)
    exchange_values = method.plan.context_parallel_values(cfg, cp, K) if cp > 1 and method.context_parallel else 0.0
    passes = 3 if tr.activation_checkpointing else 2
    x_exchange = exchange_values * a * passes / link / real

    gpus: dict[int, GpuTime] = {}

    def add(gpu: int, role: str, part: str, seconds: float) -> None:
        g = gpus.setdefault(gpu, GpuTime(gpu, ""))
        if role not in g.role:
            g.role = f"{g.role} + {role}" if g.role else role
        g.parts[part] = g.parts.get(part, 0.0) + seconds

    share = 1.0 / tp if coloc else 1.0
    for group in groups:
        for gpu in group:
            add(gpu, "TP rank", TARGET_COMPUTE, t_compute)
            add(gpu, "TP rank", TARGET_ALLREDUCE, t_allreduce)
    for gpu in trainers:
        add(gpu, "trainer rank", TRAINER_COMPUTE, share * c_compute)
        add(gpu, "trainer rank", TRAINER_EXCHANGE, share * x_exchange)
        add(gpu, "trainer rank", TRAINER_OPTIMIZER, share * opt_s / step_tokens)
        add(gpu, "trainer rank", TRAINER_GRADS, share * grads_s / step_tokens)
    for g in gpus.values():
        for part in PARTS:
            g.parts.setdefault(part, 0.0)
    balanced = len(gpus) / (tp * (t_compute + t_allreduce) + c_compute)

    src = f"conf/hw/{hw.name}.yaml"
    inputs = [
        ("GPU peak (dense bf16)", f"{hw.peak_tflops:,.1f} TFLOP/s", f"hw.peak_tflops ({src})"),
        ("GPU memory bandwidth", f"{hw.memory_gbps:,.0f} GB/s", f"hw.memory_gbps ({src})"),
        ("all-reduce bus bandwidth", f"{hw.link_gbps:,.0f} GB/s", f"hw.link_gbps ({src})"),
        ("target efficiency", f"{hw.target_efficiency:.3f}", "hw.target_efficiency (assumed; docs/PERFORMANCE.md §5)"),
        ("trainer efficiency", f"{hw.trainer_efficiency:.3f}",
         f"hw.trainer_efficiency ({src}: measured on an H200, docs/PERFORMANCE.md §3)"),
        ("target FLOPs per token", f"{tflops['total'] / 1e9:.2f} GFLOP",
         (f"2 x {sum(target_params_per_token(facts).values()) / 1e9:.2f}B activated params + attention at "
          f"max_length {L} + lm_head (target facts)")),
        ("target batch", f"{batch:,} tokens", "train.batch_size x data.max_length" + (" x tp" if coloc else "")),
        ("TP all-reduce per token", f"{ar_bytes / 1e6:.3f} MB", f"(2 x {facts.num_layers} layers + 1) x Ht x {elem} B"),
        ("trainer FLOPs per token", f"{flops['total'] / (B * L) / 1e9:.2f} GFLOP",
         f"draft_step_flops, T {L}, K {K}, checkpointing {'on' if tr.activation_checkpointing else 'off'}"),
        ("optimizer step", f"{opt_s:.4f} s",
         f"{opt_how}; " + ("host: benchmarks/host_adamw.py per thread, hw.host_threads_per_rank"
                           + ("" if hw.host_threads_per_rank else f"=null: {PLAN_HOST_THREADS} assumed")
                           if opt_dev == "cpu" else "H200 measured (plan/throughput.py)")),
        ("gradient traffic per step", f"{grads_s:.4f} s", grads_how),
        ("tokens per optimizer step per rank", f"{step_tokens:,.0f}",
         "batch_size x max_length x grad_accum" + (" x (1 - padding share)" if padding_share else "")),
        ("sequence exchange per position", f"{exchange_values * a * passes / 1e3:.1f} KB",
         f"hw.context_parallel={cp}: {exchange_values:,.0f} values x {a} B x {passes} "
         f"(forward, backward{', recompute' if passes == 3 else ''}; method plan context_parallel_values)"
         if exchange_values else "none (hw.context_parallel=1: whole sequences per rank)"),
        ("padding share", f"{padding_share:.0%}", "the run plan's (train/schedule.py padding_share)" if padding_share
         else "none: every micro-batch full at max_length (the run plan prints the run's share)"),
    ]
    notes = []
    if t_compute > tflops["total"] / tp / (peak * hw.target_efficiency):
        notes.append(f"the target reads its weights slower than it computes at {batch} tokens per batch")
    return Throughput(hw.trainer_layout, sorted(gpus.values(), key=lambda g: g.gpu), len(groups), balanced, inputs,
                      notes, compute_bound_tokens_per_s(hw, facts, L, flops["total"] / (B * L) / real))


def predict_layouts(job, facts: TargetFacts) -> dict[str, Throughput]:
    """Both layouts on the job's settings (colocated: AdamW sharded on the GPUs)."""
    return {layout: predict(job, facts, layout) for layout in LAYOUTS}
