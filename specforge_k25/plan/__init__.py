"""Per-GPU memory plan of a run, checked before any process starts.

`python -m specforge_k25.plan +hw=rtxpro6000x8 target=kimi_k25 draft=kimi` prints it;
`check_fits(job)` returns the `MemoryPlan` or raises `PlanError` naming an override that fits.

Everything here is plain arithmetic on plain numbers. Sources:
- target facts: `TargetFacts` (Kimi-K2.5 defaults in `KIMI_K25`, or read from `target.path`);
- SGLang 0.5.23 sizing rules: the MLA KV cache holds (kv_lora_rank + qk_rope_head_dim) values per
  token per layer on EVERY TP rank (the latent is not sharded); the KV pool is
  min(profiled, hw.max_total_tokens) tokens, profiled = pre * f - weights - mm_reservation where
  `pre` is the smallest free memory over the TP ranks before the weights load and f is
  `mem_fraction_static`; startup fails when `pre` on one rank is below 0.9x another rank's free
  memory (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK: our engine turns it off for CUDA TP > 1, the
  trainer and the ring share rank 0's GPU by design);
- the trainer as it stands (train/loop.py, train/step.py, train/optim.py, draft/model.py,
  draft/loss.py): the draft lives in fp32 with fp32 grads (`hw.autocast=bf16` computes in bf16 and
  caches bf16 weight copies until backward); AdamW's m/v sit next to it (the fp32 weights are the
  master copy) or, with `train.optimizer_device`, on the host or another GPU with their own fp32
  master and gradient copies; the frozen embedding [V, H] and the target's lm_head [V, Ht] keep
  the target's dtype; the teacher holds [B, T, Vd] fp32 draft logits; each TTT step keeps its
  activations ([B, T, Vd] fp32 log-probs and teacher probs, the fused attention's q/K/V/out and
  logsumexp, its [T, (k+1)T] mask; never [B, nh, T, T] probabilities) or, with
  `train.activation_checkpointing`, only its inputs and recomputes one step at a time in backward.
  `ttt_saved_bytes` counts those tensors exactly (tests/test_plan.py measures them with
  saved-tensor hooks); the backward working set and the runtime reserves are estimates.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..draft.model import DraftConfig

GiB = 1 << 30
MiB = 1 << 20


class PlanError(ValueError):
    """The configuration does not fit (or cannot start); the message names an override that fits."""


# ------------------------------------------------------------------------------ target facts
@dataclass(frozen=True)
class TargetFacts:
    """What the memory plan needs to know about a target (text backbone)."""

    name: str
    num_layers: int
    hidden_size: int  # Ht
    vocab_size: int  # V
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # dense MLP width (the draft's default I)
    head_dim: int  # GQA/MHA KV head dim (unused for MLA)
    weight_bytes: int  # all weights, all ranks together (what SGLang loads)
    kv_lora_rank: Optional[int] = None  # MLA latent width; None = GQA/MHA KV cache
    qk_rope_head_dim: Optional[int] = None
    q_lora_rank: Optional[int] = None
    n_routed_experts: int = 0
    num_moe_layers: int = 0
    kv_dtype_bytes: int = 2  # KV cache element (bf16)
    weight_dtype_bytes: int = 2  # element of the replicated (unquantized) weights
    multimodal: bool = False  # SGLang reserves SGLANG_VLM_CACHE_SIZE_MB out of the KV budget
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV cache bytes per token on ONE TP rank."""
        if self.is_mla:  # the latent (+ rope key) is shared by all heads: every rank holds all of it
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes
        heads_per_rank = max(1, math.ceil(self.num_key_value_heads / tp))  # SGLang replicates KV heads when nkv < tp
        return 2 * self.num_layers * heads_per_rank * self.head_dim * self.kv_dtype_bytes

    def replicated_weight_bytes(self) -> int:
        """Weights every TP rank holds in full under SGLang's TP (not divided by tp).

        MLA: the fused q_a/kv_a down-projection [(q_lora + kv_lora + rope), Ht] of every layer;
        MoE: the router gate [n_experts, Ht] of every MoE layer. Norms (< 3 MB) are left out.
        """
        if not self.is_mla:
            return 0
        down = (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim
        mla = self.num_layers * down * self.hidden_size * self.weight_dtype_bytes
        router = self.num_moe_layers * self.n_routed_experts * self.hidden_size * self.weight_dtype_bytes
        return mla + router

    def weight_bytes_per_gpu(self, tp: int) -> int:
        rep = min(self.replicated_weight_bytes(), self.weight_bytes)
        return math.ceil((self.weight_bytes - rep) / tp) + rep


# Kimi-K2.5 (shared/reference/kimi_k25.md): 61 layers (1 dense + 60 MoE), hidden 7168, 64 heads,
# MLA q_lora 1536 / kv_lora 512 / rope 64, dense I 18432, 384 routed experts, vocab 163840,
# INT4 (group 32) experts ~595 GB on disk. A real `target.path` replaces all of these.
KIMI_K25 = TargetFacts(
    name="kimi_k25", num_layers=61, hidden_size=7168, vocab_size=163840, num_attention_heads=64,
    num_key_value_heads=64, intermediate_size=18432, head_dim=112, weight_bytes=595_000_000_000,
    kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536, n_routed_experts=384, num_moe_layers=60,
    multimodal=True, max_position_embeddings=262144,
)
KNOWN_TARGETS = {"kimi_k25": KIMI_K25}


def facts_from_folder(path: str | Path, name: str | None = None) -> TargetFacts:
    """Facts from an HF folder: config.json (text_config for multimodal models) and the sizes of
    its *.safetensors files (0 when it has none: `check_fits` then asks for hw.target_weight_gb)."""
    from ..target.hf_config import read_target_info

    path = Path(path)
    info = read_target_info(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    heads = int(text.get("num_attention_heads") or 1)
    first_dense = int(text.get("first_k_dense_replace") or 0)
    experts = int(text.get("n_routed_experts") or 0)
    freq = int(text.get("moe_layer_freq") or 1)
    moe_layers = sum(1 for i in range(first_dense, info.num_layers) if i % freq == 0) if experts else 0
    return TargetFacts(
        name=name or path.name, num_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
        num_attention_heads=heads, num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        intermediate_size=int(text.get("intermediate_size") or 4 * info.hidden_size),
        head_dim=int(text.get("head_dim") or info.hidden_size // heads),
        weight_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        kv_lora_rank=text.get("kv_lora_rank"), qk_rope_head_dim=text.get("qk_rope_head_dim"),
        q_lora_rank=text.get("q_lora_rank"), n_routed_experts=experts, num_moe_layers=moe_layers,
        multimodal="text_config" in config, max_position_embeddings=info.max_position_embeddings,
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
    )


def target_facts_for(job) -> TargetFacts:
    """target.path (a real folder) > a known target by name when there is no builtin > the builtin's folder."""
    t = job.target
    if t.path:
        return facts_from_folder(t.path, t.name)
    if t.builtin in (None, "", "none"):
        if t.name not in KNOWN_TARGETS:
            raise PlanError(f"target {t.name!r} has no builtin and no target.path: set target.path=/path/to/model")
        return KNOWN_TARGETS[t.name]
    from ..train.loop import resolve_target_path  # builds the embedded target once (cached)

    return facts_from_folder(resolve_target_path(job), t.name)


# ----------------------------------------------------------------------------------- draft
def resolve_draft(spec, facts: TargetFacts) -> DraftConfig:
    """The draft the trainer builds from `draft.*` (DraftConfigSpec); unset sizes follow the target.

    H = Ht (the draft embeds tokens with the target's frozen embedding)."""
    heads = spec.num_attention_heads or facts.num_attention_heads
    kv_heads = spec.num_key_value_heads or facts.num_key_value_heads or heads
    if heads % kv_heads:  # e.g. MLA targets report as many KV heads as heads: fall back to MHA
        kv_heads = heads
    return DraftConfig(
        hidden_size=facts.hidden_size, intermediate_size=spec.intermediate_size or facts.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=spec.head_dim or facts.hidden_size // heads,
        vocab_size=facts.vocab_size, draft_vocab_size=spec.vocab_size, target_hidden_size=facts.hidden_size,
        rms_norm_eps=facts.rms_norm_eps, rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings or facts.max_position_embeddings,
    )


def draft_param_counts(cfg: DraftConfig) -> dict[str, int]:
    """Parameters per module of `Eagle3Draft` (draft/model.py); `embed_tokens` is frozen."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc": 3 * Ht * H,
        "q_proj": 2 * H * q_out,
        "k_proj": 2 * H * kv_out,
        "v_proj": 2 * H * kv_out,
        "o_proj": q_out * H,
        "mlp (gate, up, down)": 3 * H * I,
        "norms (4 RMSNorm)": 4 * H,
        "lm_head": cfg.draft_vocab_size * H,
        "embed_tokens (frozen)": cfg.vocab_size * H,
    }


def trainable_params(cfg: DraftConfig) -> int:
    return sum(n for name, n in draft_param_counts(cfg).items() if name != "embed_tokens (frozen)")


# ------------------------------------------------------------------------- TTT activations
def ttt_step_bytes(cfg: DraftConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(per-token bytes, mask bytes) TTT step k saves for backward (draft/loss.py::ttt_loss, one step).

    Per token (a = 2 under bf16 autocast, 4 in fp32; qw = nh*hd):
      bf16: 38H (norm inputs fp32 + outputs bf16, per-linear bf16 input casts) | fp32: 40H
      + a*qw q + 2a*qw*(k+1) the K/V of steps 0..k repeated to nh heads + a*qw attention output
      (= o_proj input) + 4*nh logsumexp (fp32) of the fused attention
      + 4a*I MLP (gate, silu, up, product) + 2a*hd cos/sin
      + 8*Vd (log-probs and renormalised teacher probs, both fp32) + 12 (rsqrt) + 1 (counted mask)
    Per step: the [T, (k+1)T] attention mask, as SDPA's additive float mask (a bytes), shared by
    the batch. No [B, nh, T, T] probabilities: the fused kernel recomputes them in backward.
    """
    H, I, hd, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.draft_vocab_size
    qw, nh = cfg.num_attention_heads * cfg.head_dim, cfg.num_attention_heads
    a = 2 if bf16 else 4
    per_token = ((38 if bf16 else 40) * H + a * qw + 2 * a * qw * (k + 1) + a * qw + 4 * nh
                 + 4 * a * I + 2 * a * hd + 8 * Vd + 12 + 1)
    return per_token * batch * seq_len, a * seq_len * seq_len * (k + 1)


def ttt_saved_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the TTT forward leaves saved for backward, all K steps (`ttt_step_bytes` each).

    Once: bf16: the fc input cast [T, 3Ht] (6Ht per token); fp32: fc's output (4H per token).
    checkpoint=True (train.activation_checkpointing): a step keeps only its inputs: the hidden
    [B, T, H] entering every step (a bytes; step 0's is fc's output) and the K/V [B, nkv, T, hd]
    of steps 0..K-2 (a bytes each); backward then recomputes one step at a time
    (`ttt_step_bytes`, counted by the plan as a transient of the TTT phase).
    Returns {"per_token": linear bytes, "attention_mask": quadratic bytes, "total": both}.
    """
    a = 2 if bf16 else 4
    N = batch * seq_len
    quadratic = 0
    if checkpoint:
        kv = 2 * a * cfg.num_key_value_heads * cfg.head_dim
        linear = ((6 * cfg.target_hidden_size if bf16 else 0) + ttt_length * a * cfg.hidden_size
                  + (ttt_length - 1) * kv) * N
    else:
        linear = (6 * cfg.target_hidden_size if bf16 else 4 * cfg.hidden_size) * N
        for k in range(ttt_length):
            per_token, mask = ttt_step_bytes(cfg, batch, seq_len, k, bf16)
            linear += per_token
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def ttt_backward_working_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors, in the last
    step's backward: the grads of its attention inputs (q and the K/V of all K steps at nh heads),
    of its [B, T, Vd] log-softmax (8 bytes) and of its MLP activations (3 [B, T, I])."""
    a = 2 if bf16 else 4
    N = batch * seq_len
    qw = cfg.num_attention_heads * cfg.head_dim
    return (a * qw * (1 + 2 * ttt_length) + 8 * cfg.draft_vocab_size + 3 * a * cfg.intermediate_size) * N


# ----------------------------------------------------------------------------- the budget
@dataclass
class Item:
    name: str
    bytes: int
    phase: Optional[str] = None  # None: resident; else only the largest phase of a GPU counts
    note: str = ""
    owner: str = "trainer"  # trainer | target | stream


@dataclass
class GpuBudget:
    gpu: int
    role: str
    capacity: int
    items: list[Item] = field(default_factory=list)

    def resident(self) -> int:
        return sum(i.bytes for i in self.items if i.phase is None)

    def phases(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.items:
            if i.phase is not None:
                out[i.phase] = out.get(i.phase, 0) + i.bytes
        return out

    def peak_phase(self) -> Optional[str]:
        phases = self.phases()
        return max(phases, key=phases.get) if phases else None

    def total(self) -> int:
        return self.resident() + max(self.phases().values(), default=0)

    def headroom(self) -> int:
        return self.capacity - self.total()

    def get(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)


@dataclass
class MemoryPlan:
    facts: TargetFacts
    draft: DraftConfig
    gpus: list[GpuBudget]
    kv_pool_tokens: int
    tokens_per_step: int
    mem_fraction_static: Optional[float]  # derived for SGLang (rounded up to 0.01); None on cpu
    mem_fraction_min: Optional[float]  # the smallest value SGLang accepts for this plan
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    capacity_ok: bool = True  # every GPU's peak fits and the target loads (what an override of sizes can fix)

    @property
    def fits(self) -> bool:
        return not self.problems

    def gpu(self, gpu_id: int) -> GpuBudget:
        return next(g for g in self.gpus if g.gpu == gpu_id)


ROLE_TARGET = "target TP rank"
PHASE_TEACHER, PHASE_TTT, PHASE_OPT = "teacher", "TTT fwd+bwd", "optimizer step"


def optimizer_items(P: int, on_gpu: bool) -> list[Item]:
    """train.optimizer_device: what OffloadedAdamW (train/optim.py) holds on its own device. The
    master copies and gradient copies are allocated when the trainer is built; m, v on the first
    step. On a GPU torch's foreach AdamW adds temporaries; on the host the fused kernel does not."""
    items = [
        Item("AdamW master weights fp32", 4 * P),
        Item("AdamW gradient copies fp32", 4 * P),
        Item("AdamW m, v fp32", 8 * P),
    ]
    if on_gpu:
        items.append(Item("AdamW foreach temporaries fp32", 4 * P, PHASE_OPT))
    return items


def trainer_items(cfg: DraftConfig, *, batch: int, seq_len: int, ttt_length: int, teacher_chunk: int, bf16: bool,
                  data_parallel: bool, context_bytes: int, frozen_bytes: int = 4, checkpoint: bool = False,
                  optimizer_offloaded: bool = False) -> list[Item]:
    """One trainer rank's memory on its GPU. Resident items are allocated before the target starts
    (weights, frozen tensors) or persist across steps (grads, AdamW state); phase items are peaks of
    the three phases of a micro-batch, which do not overlap.

    frozen_bytes: element size of the frozen embedding and lm_head (the target's dtype);
    checkpoint: train.activation_checkpointing; optimizer_offloaded: AdamW state elsewhere
    (`optimizer_items` on train.optimizer_device)."""
    P = trainable_params(cfg)
    V, H, Ht, Vd = cfg.vocab_size, cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size
    N = batch * seq_len
    # DraftBatch: aux fp32 [N, 3Ht], input_ids int64, loss_mask bool, teacher: draft logits fp32
    # [N, Vd], logsumexp fp32, argmax int64; plus lengths (negligible)
    batch_bytes = N * (12 * Ht + 8 + 1 + 4 * Vd + 4 + 8)
    saved = ttt_saved_bytes(cfg, batch, seq_len, ttt_length, bf16, checkpoint)
    chunk = min(teacher_chunk, N)
    dtype = {2: "bf16", 4: "fp32"}.get(frozen_bytes, f"{frozen_bytes} B")
    items = [
        Item("CUDA context (trainer process)", context_bytes),
        Item("draft weights fp32", 4 * P, note=f"{P:,} trainable params" + ("" if optimizer_offloaded else
                                                                            " (= AdamW's master copy)")),
        Item("draft grads fp32", 4 * P),
    ]
    if not optimizer_offloaded:
        items.append(Item("AdamW m, v fp32", 8 * P))
    items += [
        Item(f"frozen embedding [V, H] {dtype}", frozen_bytes * V * H),
        Item(f"target lm_head [V, Ht] {dtype} (teacher)", frozen_bytes * V * Ht),
        Item("vocab maps d2t int64 + t2d bool", 8 * Vd + V),
    ]
    if data_parallel:
        items.append(Item("DP gradient buckets fp32 (DDP, assumed)", 4 * P,
                          note="upper bound: train/step.py all-reduces each grad in place"))
    # teacher logits: [chunk, V] in the lm_head's dtype, its fp32 copy (not made for fp32) and logsumexp's exp
    chunk_elem = frozen_bytes + (4 if frozen_bytes != 4 else 0) + 4
    items += [
        Item("batch: aux fp32 [B,T,3Ht] + teacher [B,T,Vd] fp32", batch_bytes, PHASE_TEACHER),
        Item("next batch + its final hidden fp32 [B,T,Ht]", batch_bytes + 4 * N * Ht, PHASE_TEACHER,
             note="built while the previous batch is still referenced"),
        Item("teacher chunk [chunk, V]: logits, fp32 copy, logsumexp", chunk_elem * chunk * V + 8 * V, PHASE_TEACHER),
        Item("batch: aux fp32 [B,T,3Ht] + teacher [B,T,Vd] fp32", batch_bytes, PHASE_TTT),
        Item("bf16 autocast weight copies", 2 * P if bf16 else 0, PHASE_TTT),
        Item("TTT saved: per-token tensors (K steps)", saved["per_token"], PHASE_TTT,
             note=("checkpointed: each step's hidden input + K/V" if checkpoint else
                   "incl. [B,T,Vd] fp32 log-probs + teacher probs per step")),
        Item("TTT saved: attention masks [T,(k+1)T] (K steps)", saved["attention_mask"], PHASE_TTT),
    ]
    if checkpoint:  # backward recomputes one step at a time: the last (largest) one at most
        per_token, mask = ttt_step_bytes(cfg, batch, seq_len, ttt_length - 1, bf16)
        items.append(Item("TTT one step recomputed in backward", per_token + mask, PHASE_TTT,
                          note="activation checkpointing: the largest step's saved tensors"))
    items += [
        Item("TTT backward working set (estimate)", ttt_backward_working_bytes(cfg, batch, seq_len, ttt_length, bf16),
             PHASE_TTT),
        Item("batch: aux fp32 [B,T,3Ht] + teacher [B,T,Vd] fp32", batch_bytes, PHASE_OPT),
    ]
    if not optimizer_offloaded:
        items.append(Item("AdamW foreach temporaries fp32", 4 * P, PHASE_OPT))
    return [i for i in items if i.bytes]


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _gpu_layout(hw) -> tuple[list[list[int]], list[int]]:
    # a target spanning nodes (hw.target_nnodes) holds target_tp / target_nnodes ranks per node; this plans node 0
    tp, replicas = hw.target_tp // hw.target_nnodes, hw.target_replicas
    groups = [[hw.target_gpu + r * tp + i for i in range(tp)] for r in range(replicas)]
    trainers = list(hw.trainer_gpus) if hw.trainer_gpus else [hw.trainer_gpu]
    return groups, trainers


def optimizer_device(value: Optional[str], device: str, trainer_gpus: list[int]) -> str | int | None:
    """train.optimizer_device as the plan sees it: None (the trainer's own device), "cpu" or a GPU id."""
    if value in (None, "", "none") or device != "cuda":
        return None
    if value == "cpu":
        return "cpu"
    if not value.startswith("cuda:") or not value[5:].isdigit():
        raise PlanError(f"train.optimizer_device={value!r}: expected null, cpu or cuda:N")
    gpu = int(value[5:])
    return None if trainer_gpus == [gpu] else gpu


def plan_memory(job, facts: TargetFacts, *, max_length: int | None = None, batch_size: int | None = None,
                intermediate_size: int | None = None) -> MemoryPlan:
    """The budget of every GPU (no exception for a plan that does not fit: see `problems`).
    The keyword arguments replace the job's value (used to search for an override that fits)."""
    hw, tr = job.hw, job.train
    L = max_length or job.data.max_length
    B = batch_size or tr.batch_size
    spec = job.draft if intermediate_size is None else replace(job.draft, intermediate_size=intermediate_size)
    cfg = resolve_draft(spec, facts)
    bf16 = hw.autocast == "bf16"
    groups, trainers = _gpu_layout(hw)
    ranks = len(trainers)
    tokens_per_step = B * L * tr.grad_accum * ranks
    batch_tokens = B * L
    kv_tokens = max(hw.max_total_tokens, batch_tokens)
    ctx = int(hw.cuda_context_gib * GiB) if hw.device == "cuda" else 0
    problems: list[str] = []
    notes: list[str] = []
    capacity = hw.gpu_memory_mib * MiB
    elem = 2 if hw.target_dtype in ("bfloat16", "float16") else 4  # the target's dtype: ring, frozen tensors
    opt_dev = optimizer_device(tr.optimizer_device, hw.device, trainers)
    t_items = trainer_items(cfg, batch=B, seq_len=L, ttt_length=tr.ttt_length, teacher_chunk=tr.teacher_chunk,
                            bf16=bf16, data_parallel=ranks > 1, context_bytes=ctx, frozen_bytes=elem,
                            checkpoint=tr.activation_checkpointing, optimizer_offloaded=opt_dev is not None)
    P = trainable_params(cfg)
    if opt_dev == "cpu":
        host = sum(i.bytes for i in optimizer_items(P, on_gpu=False)) * ranks
        notes.append(f"optimizer on the host (train.optimizer_device=cpu): {_gib(host)} of pinned host memory for "
                     f"{ranks} rank(s) (fp32 master, gradient copies, m, v); each optimizer step copies "
                     f"{_gib(8 * P)} over PCIe (grads in, weights out) and runs fused AdamW on the CPU: raise "
                     f"train.grad_accum to amortise it, or put it on a GPU with room (train.optimizer_device=cuda:N)")
    if hw.device != "cuda":
        g = GpuBudget(-1, "trainer rank (host memory, not checked)", 0, t_items)
        return MemoryPlan(facts, cfg, [g], kv_tokens, tokens_per_step, None, None, problems, notes)

    if capacity <= 0:
        problems.append("hw.gpu_memory_mib is not set: the plan needs the GPU size (MiB, as nvidia-smi shows)")
    if facts.weight_bytes <= 0:
        problems.append("the target's weight size is unknown (no *.safetensors in target.path): set hw.target_weight_gb")
    used = sorted(g for group in groups for g in group)
    if len(set(used)) != len(used) or (used and (used[0] < 0 or used[-1] >= hw.num_gpus)):
        problems.append(f"target GPUs {used} do not fit on hw.num_gpus={hw.num_gpus} GPUs without overlap")
    for t in trainers:
        if not 0 <= t < hw.num_gpus:
            problems.append(f"trainer GPU {t} is not one of the {hw.num_gpus} GPUs")
    if isinstance(opt_dev, int) and not 0 <= opt_dev < hw.num_gpus:
        problems.append(f"train.optimizer_device=cuda:{opt_dev} is not one of the {hw.num_gpus} GPUs")
    if len(set(trainers)) != ranks:
        problems.append(f"hw.trainer_gpus={trainers}: one trainer rank per GPU")
    if hw.trainer_gpus and trainers[0] != hw.trainer_gpu:
        problems.append(f"hw.trainer_gpu={hw.trainer_gpu} must equal hw.trainer_gpus[0]={trainers[0]} (rank 0)")
    if ranks != hw.target_replicas:
        problems.append(f"{ranks} trainer rank(s) but hw.target_replicas={hw.target_replicas}: each rank reads one replica's stream")

    weights = facts.weight_bytes_per_gpu(hw.target_tp)
    kv = kv_tokens * facts.kv_bytes_per_token(hw.target_tp)
    mm = 100 * MiB if facts.multimodal else 0  # SGLANG_VLM_CACHE_SIZE_MB default
    runtime = int(hw.target_runtime_gib * GiB) + batch_tokens * 4 * facts.hidden_size * 2
    ring = tr.stream_slots * batch_tokens * 4 * facts.hidden_size * elem

    budgets: dict[int, GpuBudget] = {}

    def budget(gpu: int) -> GpuBudget:
        return budgets.setdefault(gpu, GpuBudget(gpu, "", capacity))

    roles: dict[int, list[str]] = {}
    preloaded: dict[int, int] = {}  # bytes other processes hold on a GPU when SGLang measures it
    for r, group in enumerate(groups):
        for gpu in group:
            b = budget(gpu)
            roles.setdefault(gpu, []).append(ROLE_TARGET)
            b.items += [
                Item("CUDA context (SGLang TP rank)", ctx, owner="target"),
                Item("target weights (TP shard + replicated)", weights, owner="target",
                     note=f"({_gib(facts.weight_bytes)} - {_gib(facts.replicated_weight_bytes())}) / {hw.target_tp} + replicated"),
                Item("KV cache pool", kv, owner="target",
                     note=f"{kv_tokens} tokens x {facts.kv_bytes_per_token(hw.target_tp)} B"),
                Item("SGLang multimodal reservation", mm, owner="target"),
                Item("SGLang runtime (activations, workspaces)", runtime, owner="target",
                     note="estimate: hw.target_runtime_gib + captured states"),
            ]
        ring_gpu = group[0]  # TargetStream puts the slots on cuda:{target_gpu}, allocated by the trainer process
        trainer_gpu = trainers[r] if r < ranks else None
        budget(ring_gpu).items.append(Item("stream ring slots (aux + final)", ring, owner="stream",
                                           note=f"{tr.stream_slots} x {batch_tokens} tokens x 4Ht x {elem} B"))
        roles.setdefault(ring_gpu, []).append("stream ring")
        preloaded[ring_gpu] = preloaded.get(ring_gpu, 0) + ring
        if trainer_gpu is not None and trainer_gpu != ring_gpu:  # the trainer process also opens a context there
            budget(ring_gpu).items.append(Item("CUDA context (trainer process, for the ring)", ctx, owner="stream"))
            preloaded[ring_gpu] += ctx
    for rank, gpu in enumerate(trainers):
        b = budget(gpu)
        roles.setdefault(gpu, []).append("trainer rank")
        b.items += t_items
        # allocated by build_trainer before the target process starts
        preloaded[gpu] = preloaded.get(gpu, 0) + sum(
            i.bytes for i in t_items if i.phase is None and not i.name.startswith(("draft grads", "AdamW")))
        if isinstance(opt_dev, int):  # OffloadedAdamW on another GPU: the trainer process opens a context there too
            o_items = [Item("CUDA context (trainer process, for AdamW)", ctx)] + optimizer_items(P, on_gpu=True)
            budget(opt_dev).items += o_items
            roles.setdefault(opt_dev, []).append("AdamW state")
            preloaded[opt_dev] = preloaded.get(opt_dev, 0) + sum(
                i.bytes for i in o_items if i.phase is None and "m, v" not in i.name)
    for gpu, b in budgets.items():
        b.role = " + ".join(dict.fromkeys(roles.get(gpu, [])))

    # SGLang's static fraction: pre = min over the TP ranks of free memory before loading (its own
    # context counted), KV pool = pre * f - weights - mm must hold kv_tokens.
    frac = frac_min = None
    capacity_ok = capacity > 0 and facts.weight_bytes > 0
    if capacity > 0:
        for group in groups:
            free = [capacity - ctx - preloaded.get(g, 0) for g in group]
            pre = min(free)
            need = (weights + kv + mm) / pre if pre > 0 else math.inf
            frac_min = need if frac_min is None else max(frac_min, need)
            if hw.target_tp > 1 and pre < 0.9 * max(free):
                worst = group[free.index(pre)]
                notes.append(
                    f"GPU {worst} has {_gib(capacity - ctx - pre)} taken by the trainer/ring before the engine loads, "
                    f"more than SGLang's 10% TP memory-balance check allows; the target runs with "
                    f"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (set by target/sglang_engine.py for every CUDA TP>1 "
                    f"target) and this plan sizes the KV pool from the fullest rank")
        frac = math.ceil(frac_min * 100) / 100 if math.isfinite(frac_min) else math.inf
        if frac_min >= 1:
            capacity_ok = False
            problems.append(f"the target does not load: weights + KV need {frac_min:.3f} of the free memory")
        elif hw.mem_fraction_static < frac_min:
            problems.append(f"hw.mem_fraction_static={hw.mem_fraction_static} is below what SGLang needs for the "
                            f"weights and a {kv_tokens}-token KV pool ({frac_min:.4f}): set hw.mem_fraction_static={frac}")
        for b in sorted(budgets.values(), key=lambda b: b.gpu):
            if b.total() > capacity:
                capacity_ok = False
                problems.append(f"GPU {b.gpu} ({b.role}) needs {_gib(b.total())} of {_gib(capacity)} "
                                f"(peak phase: {b.peak_phase() or '-'})")
    if batch_tokens > hw.max_total_tokens:
        problems.append(f"a batch holds up to {batch_tokens} tokens but the KV pool is capped at hw.max_total_tokens="
                        f"{hw.max_total_tokens}: set hw.max_total_tokens={batch_tokens}"
                        + (" (it fits)" if capacity_ok else " (the memory above counts that pool)"))
    if L > facts.max_position_embeddings:
        problems.append(f"data.max_length={L} exceeds the target's context ({facts.max_position_embeddings})")

    notes.append(activation_note(cfg, B, L, tr.ttt_length, bf16, tr.activation_checkpointing))
    if ranks > 1 or hw.target_replicas > 1:
        notes.append(f"data-parallel: launch with torchrun --nproc-per-node {hw.target_replicas} (one trainer rank "
                     f"per replica)")
    return MemoryPlan(facts, cfg, sorted(budgets.values(), key=lambda b: b.gpu), kv_tokens, tokens_per_step,
                      frac, frac_min, problems, notes, capacity_ok)


def activation_note(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool, checkpoint: bool) -> str:
    """The TTT activations with and without train.activation_checkpointing at this length."""
    plain = ttt_saved_bytes(cfg, batch, seq_len, ttt_length, bf16)["total"]
    kept = ttt_saved_bytes(cfg, batch, seq_len, ttt_length, bf16, checkpoint=True)["total"]
    one = sum(ttt_step_bytes(cfg, batch, seq_len, ttt_length - 1, bf16))
    state = "on" if checkpoint else "off"
    return (f"TTT activations at T={seq_len}, K={ttt_length}: {_gib(plain)} kept for backward without activation "
            f"checkpointing; {_gib(kept)} kept + {_gib(one)} for the one step recomputed with it "
            f"(train.activation_checkpointing, {state}; ~1 more forward)")


def _fits(job, facts, **kw) -> bool:
    return plan_memory(job, facts, **kw).capacity_ok


def suggest_override(job, facts: TargetFacts) -> Optional[str]:
    """One override (or one pair) that makes the plan fit, or None. Switches that keep the tokens
    per step come first (batch split into accumulation, activation checkpointing, AdamW state on
    the host), then a shorter max_length, then a smaller draft MLP."""
    tr, L = job.train, job.data.max_length
    step = 256
    if tr.batch_size > 1 and _fits(job, facts, batch_size=1):
        return f"train.batch_size=1 train.grad_accum={tr.grad_accum * tr.batch_size} (same tokens per step)"
    switches = []
    if not tr.activation_checkpointing:
        switches.append(("train.activation_checkpointing=true", {"activation_checkpointing": True}))
    if optimizer_device(tr.optimizer_device, job.hw.device, _gpu_layout(job.hw)[1]) is None:
        switches.append(("train.optimizer_device=cpu", {"optimizer_device": "cpu"}))
    for n in range(1, len(switches) + 1):
        names = " ".join(name for name, _ in switches[:n])
        changes = {k: v for _, c in switches[:n] for k, v in c.items()}
        if _fits(replace(job, train=replace(tr, **changes)), facts):
            return f"{names} (same tokens per step)"
    for B in ([tr.batch_size] + ([1] if tr.batch_size > 1 else [])):
        best = None
        lo, hi = 1, (L - 1) // step  # multiples of 256 below L; memory grows with L: bisect
        while lo <= hi:
            mid = (lo + hi) // 2
            if _fits(job, facts, max_length=mid * step, batch_size=B):
                best, lo = mid * step, mid + 1
            else:
                hi = mid - 1
        if best:
            batch = "" if B == tr.batch_size else f"train.batch_size=1 train.grad_accum={tr.grad_accum * tr.batch_size} "
            return f"{batch}lower data.max_length to {best} (data.max_length={best})"
    cfg = resolve_draft(job.draft, facts)
    best, lo, hi = None, 1, (cfg.intermediate_size - 1) // step
    while lo <= hi:
        mid = (lo + hi) // 2
        if _fits(job, facts, intermediate_size=mid * step):
            best, lo = mid * step, mid + 1
        else:
            hi = mid - 1
    if best:
        return f"a smaller draft MLP: draft.intermediate_size={best} (at data.max_length={L})"
    return None


def with_hw_overrides(job, facts: TargetFacts) -> TargetFacts:
    """`hw.target_weight_gb` (when set) replaces the facts' weight size."""
    if job.hw.target_weight_gb is not None:
        facts = replace(facts, weight_bytes=int(job.hw.target_weight_gb * 1e9))
    return facts


def check_fits(job, target_facts: TargetFacts | None = None) -> MemoryPlan:
    """The plan of `job`, or PlanError (a ValueError) naming an override that fits."""
    facts = with_hw_overrides(job, target_facts or target_facts_for(job))
    plan = plan_memory(job, facts)
    if plan.fits:
        return plan
    lines = ["the run does not fit:"] + [f"  - {p}" for p in plan.problems]
    if not plan.capacity_ok and job.hw.gpu_memory_mib > 0 and facts.weight_bytes > 0:
        fix = suggest_override(job, facts)
        if fix:
            lines.append(f"  fits with: {fix}")
        else:
            worst = max(plan.gpus, key=lambda g: g.resident() - g.capacity)
            lines.append(
                f"  no single override fits: GPU {worst.gpu} holds {_gib(worst.resident())} of {_gib(worst.capacity)} "
                f"before any activation (target {_gib(sum(i.bytes for i in worst.items if i.owner == 'target'))}, "
                f"trainer {_gib(sum(i.bytes for i in worst.items if i.owner == 'trainer' and i.phase is None))}"
                f"), so no data.max_length, batch size or draft.intermediate_size >= 256 fits, even with "
                f"train.activation_checkpointing=true train.optimizer_device=cpu; the trainer must move to a GPU "
                f"of its own (hw.trainer_gpu) or the target to more GPUs (see `python -m specforge_k25.plan`)")
    raise PlanError("\n".join(lines))
