"""The time of one target decode or verify step on a node, and of the draft's work per step.

One TP replica (hw.target_tp GPUs) serves `concurrency` requests at `context` tokens of KV each;
a step runs `tokens` tokens per request (1: a decode step; k+1: a verify step of k drafted tokens
and the last accepted one). Every GPU of the replica, per step:
- reads the weights the step touches: the dense ones (attention projections, the dense MLP,
  shared experts, router, lm_head; 1/tp each, the MLA down-projections and the router in full as
  SGLang replicates them) and, per MoE layer, 1/tp of every distinct routed expert the
  concurrency x tokens tokens route to (`Routing`), at the experts' real dtype (Kimi-K2.5: INT4 with
  a bf16 scale per group of 32 = 0.5625 bytes a weight);
- reads each request's KV once (MLA: the latent + rope key of every layer, all of it on every rank);
- computes 2 x activated parameters per token / tp plus the attention of each token over its
  context (MLA decode in absorbed form: per head 2 x context x (2 kv_lora + rope) FLOPs);
- all-reduces the residual stream twice a layer and once for the embedding, [tokens, Ht] each:
  latency + bytes / link (hw.allreduce_latency_us, hw.link_gbps).
Memory and compute overlap (roofline: the larger counts), the all-reduces do not (each waits
for the layer before it). Assumptions and their sensitivity: docs/PERFORMANCE.md §9.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan.facts import TargetFacts


class ServingError(ValueError):
    """A prediction that cannot be made (missing hw constants, bad acceptance); exits 2."""


@dataclass(frozen=True)
class Node:
    """The hw profile's serving constants (conf/hw/*.yaml, their sources there)."""

    name: str
    tp: int
    peak_tflops: float
    memory_gbps: float
    link_gbps: float
    allreduce_latency_us: float
    memory_efficiency: float
    compute_efficiency: float

    @classmethod
    def of(cls, hw) -> "Node":
        missing = [k for k in ("peak_tflops", "memory_gbps", "link_gbps") if not getattr(hw, k)]
        if missing:
            raise ServingError(f"hw={hw.name} has no {', '.join('hw.' + k for k in missing)}: a serving prediction "
                               f"needs a GPU profile, e.g. +hw=rtxpro6000x8 or +hw=b300x8")
        return cls(hw.name, hw.target_tp, hw.peak_tflops, hw.memory_gbps, hw.link_gbps, hw.allreduce_latency_us,
                   hw.decode_memory_efficiency, hw.target_efficiency)


@dataclass
class StepCost:
    """Seconds of one step on one GPU, by part; `total` = max(memory, compute) + all-reduce."""

    weights_s: float
    experts_s: float
    kv_s: float
    compute_s: float
    allreduce_s: float

    @property
    def memory_s(self) -> float:
        return self.weights_s + self.experts_s + self.kv_s

    @property
    def total(self) -> float:
        return max(self.memory_s, self.compute_s) + self.allreduce_s

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(*(a + b for a, b in zip(self.parts(), other.parts())))

    def parts(self) -> tuple:
        return self.weights_s, self.experts_s, self.kv_s, self.compute_s, self.allreduce_s


def expert_bytes_per_weight(facts: TargetFacts) -> float:
    """Bytes a routed-expert weight reads: INT4 groups carry one bf16 scale per group."""
    if facts.expert_weight_bits:
        group = facts.quant_group_size or 128
        return facts.expert_weight_bits / 8 + 2 / group
    return facts.weight_dtype_bytes


def dense_params(facts: TargetFacts) -> tuple[int, int]:
    """(sharded, replicated) parameters every step reads besides the routed experts: attention
    projections, dense MLPs, shared experts, router, lm_head (the embedding is a lookup)."""
    Ht, nh, L = facts.hidden_size, facts.num_attention_heads, facts.num_layers
    moe = facts.num_moe_layers if facts.n_routed_experts else 0
    if facts.is_mla:
        qk = facts.qk_nope_head_dim + facts.qk_rope_head_dim
        down = Ht * ((facts.q_lora_rank or 0) + facts.kv_lora_rank + facts.qk_rope_head_dim)  # replicated
        up = ((facts.q_lora_rank or Ht) * nh * qk + facts.kv_lora_rank * nh * (facts.qk_nope_head_dim + facts.v_head_dim)
              + nh * facts.v_head_dim * Ht)
        attn_sharded, replicated = L * up, L * down
    else:
        hd, nkv = facts.head_dim, facts.num_key_value_heads
        attn_sharded, replicated = L * (2 * Ht * nh * hd + 2 * Ht * nkv * hd), 0
    replicated += moe * facts.n_routed_experts * Ht  # the router
    sharded = (attn_sharded + (L - moe) * 3 * Ht * facts.intermediate_size
               + moe * facts.n_shared_experts * 3 * Ht * facts.moe_intermediate_size + facts.vocab_size * Ht)
    return sharded, replicated


def expert_params(facts: TargetFacts) -> int:
    return 3 * facts.hidden_size * facts.moe_intermediate_size


def attention_flops_per_token(facts: TargetFacts, context: int) -> float:
    """FLOPs of one new token's attention over `context` keys, all heads, all layers."""
    if facts.is_mla:  # absorbed decode: scores over latent + rope, values in the latent
        per_head = 2 * context * (2 * facts.kv_lora_rank + facts.qk_rope_head_dim)
    else:
        per_head = 4 * context * facts.head_dim
    return facts.num_layers * facts.num_attention_heads * per_head


def allreduce_s(node: Node, nbytes: float) -> float:
    """One all-reduce of `nbytes` over the replica's tp GPUs: latency + the ring's 2(tp-1)/tp x bytes
    over the bus bandwidth (nccl-tests' busbw definition, which hw.link_gbps quotes)."""
    return node.allreduce_latency_us * 1e-6 + 2 * (node.tp - 1) / node.tp * nbytes / (node.link_gbps * 1e9)


def target_step(facts: TargetFacts, node: Node, concurrency: int, tokens: int, context: int,
                distinct_experts: float) -> StepCost:
    """One target step: `concurrency` requests x `tokens` tokens each at `context` tokens of KV;
    `distinct_experts` = the distinct routed experts all its tokens route to, summed over MoE layers."""
    tp, n = node.tp, concurrency * tokens
    bw = node.memory_gbps * 1e9 * node.memory_efficiency
    sharded, replicated = dense_params(facts)
    weights = (sharded / tp + replicated) * facts.weight_dtype_bytes
    experts = distinct_experts * expert_params(facts) * expert_bytes_per_weight(facts) / tp
    kv = concurrency * context * facts.kv_bytes_per_token(tp)
    active = sharded + replicated + (facts.num_moe_layers * facts.num_experts_per_tok * expert_params(facts)
                                     if facts.n_routed_experts else 0)
    flops = n * (2 * active + attention_flops_per_token(facts, context)) / tp
    allreduce = 0.0
    if tp > 1:
        count = 2 * facts.num_layers + 1
        allreduce = count * allreduce_s(node, n * facts.hidden_size * facts.weight_dtype_bytes)
    return StepCost(weights / bw, experts / bw, kv / bw, flops / (node.peak_tflops * 1e12 * node.compute_efficiency),
                    allreduce)


@dataclass(frozen=True)
class DraftShape:
    """What one draft forward reads and computes (per token: 2 x params FLOPs)."""

    params: int  # weights read per forward (bf16), the target's lm_head included where the draft uses it
    layers: int
    kv_bytes_per_token: int  # the draft's own KV cache
    hidden: int


def draft_forward(shape: DraftShape, node: Node, concurrency: int, tokens: int, context: int) -> StepCost:
    """One draft forward of `tokens` tokens per request, TP-sharded like the target (SGLang runs the
    draft with the target's TP size): its weights, its KV over the context, its all-reduces."""
    tp, n = node.tp, concurrency * tokens
    bw = node.memory_gbps * 1e9 * node.memory_efficiency
    weights = shape.params * 2 / tp
    kv = concurrency * context * shape.kv_bytes_per_token / tp
    flops = n * 2 * shape.params / tp
    allreduce = 0.0
    if tp > 1:
        allreduce = (2 * shape.layers + 1) * allreduce_s(node, n * shape.hidden * 2)
    return StepCost(weights / bw, 0.0, kv / bw, flops / (node.peak_tflops * 1e12 * node.compute_efficiency), allreduce)


def draft_cost(setting, shape: DraftShape | None, node: Node, concurrency: int, context: int) -> StepCost:
    """The draft's work for one verify step of `setting` (predict.Setting): its `forwards` forwards
    of `tokens_per_forward` tokens per request and, for a chain drafter, the draft extend over the
    drafted + 1 tokens the verify step ran (counted as a full forward); nothing for prompt lookup."""
    zero = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
    if shape is None or setting.forwards == 0:
        return zero
    one = draft_forward(shape, node, concurrency, setting.tokens_per_forward, context)
    cost = StepCost(*(x * setting.forwards for x in one.parts()))
    if setting.extend:
        cost = cost + draft_forward(shape, node, concurrency, setting.drafted + 1, context)
    return cost


def uniform_distinct(facts: TargetFacts, window: int, concurrency: int) -> float:
    """The prior without measured routing: every token picks top_k of the routed experts uniformly
    and independently; summed over MoE layers."""
    if not facts.n_routed_experts:
        return 0.0
    E, k = facts.n_routed_experts, facts.num_experts_per_tok
    return facts.num_moe_layers * E * (1 - (1 - k / E) ** (window * concurrency))


def check_finite(*xs: float) -> None:
    if not all(math.isfinite(x) for x in xs):
        raise ServingError("serving model produced a non-finite time (a zero bandwidth or peak in the hw profile?)")
