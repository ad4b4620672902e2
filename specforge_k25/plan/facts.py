"""What the plans know about a run before anything starts: the target's facts (`TargetFacts`,
from its folder or known defaults) and the draft those facts imply (`draft_of`: the method
`job.draft` configures and its model config, `resolve_draft`; its parameter counts). Plain arithmetic
inputs; nothing here allocates.

The plan never names a draft method: whatever depends on one (parameters, TTT activations, FLOPs,
the captured states it reads) is asked of the method (draft/method.py, its `plan` module).

Kimi-K2.5's defaults are summarised in docs/KIMI_K25.md §2.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ..draft.method import DraftMethod, trainable_count
from ..draft.registry import method_of_config, method_of_spec
from ..target_engine.layers import default_capture_points, resolve_capture_points

GiB = 1 << 30
MiB = 1 << 20


class PlanError(ValueError):
    """The configuration does not fit (or cannot start); the message names an override that fits."""


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
    # the compute of one token (throughput plan): experts a token activates and their width, MLA head widths
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    qk_nope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    kv_dtype_bytes: int = 2  # KV cache element (bf16)
    weight_dtype_bytes: int = 2  # element of the replicated (unquantized) weights
    multimodal: bool = False  # SGLang reserves SGLANG_VLM_CACHE_SIZE_MB out of the KV budget
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # quantized routed experts (`quantization_config`): method, weight bits and group size; None = bf16/fp32
    quant_method: Optional[str] = None
    expert_weight_bits: Optional[int] = None
    quant_group_size: Optional[int] = None

    @property
    def int4_experts(self) -> bool:
        """Routed experts in compressed-tensors INT4 (Kimi-K2.5's format): SGLang runs them with its
        WNA16 MoE kernels (plan/kernels.py)."""
        return self.quant_method == "compressed-tensors" and self.expert_weight_bits == 4 and self.num_moe_layers > 0

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


# Kimi-K2.5 (docs/KIMI_K25.md §2): 61 layers (1 dense + 60 MoE), hidden 7168, 64 heads,
# MLA q_lora 1536 / kv_lora 512 / rope 64, dense I 18432, 384 routed experts, vocab 163840,
# INT4 (compressed-tensors, group 32) routed experts, ~595 GB on disk; each token runs 8 routed +
# 1 shared expert of width 2048, MLA heads qk_nope 128 / v 128. A real `target.path` replaces all
# of these (its config.json and the index's total size suffice: `facts_from_folder`).
KIMI_K25 = TargetFacts(
    name="kimi_k25", num_layers=61, hidden_size=7168, vocab_size=163840, num_attention_heads=64,
    num_key_value_heads=64, intermediate_size=18432, head_dim=112, weight_bytes=595_000_000_000,
    kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536, n_routed_experts=384, num_moe_layers=60,
    num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, qk_nope_head_dim=128, v_head_dim=128,
    multimodal=True, max_position_embeddings=262144, quant_method="compressed-tensors", expert_weight_bits=4,
    quant_group_size=32,
)
KNOWN_TARGETS = {"kimi_k25": KIMI_K25}


def weight_bytes_of_folder(path: Path) -> int:
    """Bytes of the weights SGLang loads: the *.safetensors files, or without them the total size
    `model.safetensors.index.json` records (planning from config.json + index alone); 0 when neither."""
    files = list(path.glob("*.safetensors"))
    if files:
        return sum(f.stat().st_size for f in files)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return int(json.loads(index.read_text()).get("metadata", {}).get("total_size") or 0)
    return 0


def expert_quantization(config: dict) -> dict:
    """TargetFacts' quant fields from a `quantization_config` (None: unquantized). compressed-tensors:
    the weights of its first config group (Kimi-K2.5 has one, `group_0`, targeting the experts)."""
    from ..target_engine.hf_config import quantization_config

    quant = quantization_config(config)
    if not quant:
        return {}
    fields = {"quant_method": quant.get("quant_method")}
    groups = quant.get("config_groups") or {}
    weights = (next(iter(groups.values()), None) or {}).get("weights") if isinstance(groups, dict) else None
    if isinstance(weights, dict):
        fields.update(expert_weight_bits=weights.get("num_bits"), quant_group_size=weights.get("group_size"))
    return fields


def facts_from_folder(path: str | Path, name: str | None = None) -> TargetFacts:
    """Facts from an HF folder: config.json (text_config for multimodal models, its
    quantization_config) and the weights' size (`weight_bytes_of_folder`; 0 when unknown:
    `check_fits` then asks for hw.target_weight_gb)."""
    from ..target_engine.hf_config import read_target_info

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
        weight_bytes=weight_bytes_of_folder(path),
        kv_lora_rank=text.get("kv_lora_rank"), qk_rope_head_dim=text.get("qk_rope_head_dim"),
        q_lora_rank=text.get("q_lora_rank"), n_routed_experts=experts, num_moe_layers=moe_layers,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        n_shared_experts=int(text.get("n_shared_experts") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        qk_nope_head_dim=text.get("qk_nope_head_dim"), v_head_dim=text.get("v_head_dim"),
        multimodal="text_config" in config, max_position_embeddings=info.max_position_embeddings,
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6), **expert_quantization(config),
    )


def target_facts_for(t) -> TargetFacts:
    """Of the `target` group: target.path (a real folder) > a known target by name when there is no
    builtin > the builtin's folder."""
    if t.path:
        return facts_from_folder(t.path, t.name)
    if t.builtin in (None, "", "none"):
        if t.name not in KNOWN_TARGETS:
            raise PlanError(f"target {t.name!r} has no builtin and no target.path: set target.path=/path/to/model")
        return KNOWN_TARGETS[t.name]
    from ..target_engine.models import resolve_target_path  # builds the embedded target once (cached)

    return facts_from_folder(resolve_target_path(t), t.name)


def with_hw_overrides(hw, facts: TargetFacts) -> TargetFacts:
    """`hw.target_weight_gb` (when set) replaces the facts' weight size."""
    if hw.target_weight_gb is not None:
        facts = replace(facts, weight_bytes=int(hw.target_weight_gb * 1e9))
    return facts


# ----------------------------------------------------------------------------------- draft
def requested_capture_points(spec, aux_layers: list | None, num_layers: int) -> list | None:
    """The capture points a run asks for: `target.aux_layers`, else the draft method's default for
    `spec` (`DraftMethod.default_capture_points`); None: the target's default (target_engine/layers.py)."""
    if aux_layers is not None:
        return aux_layers
    return method_of_spec(spec).default_capture_points(spec, num_layers)


def run_capture_points(job, num_layers: int) -> list[int]:
    """The run's capture points on a `num_layers`-layer target, checked (target_engine/layers.py)."""
    return resolve_capture_points(requested_capture_points(job.draft, job.target.aux_layers, num_layers), num_layers)


def num_capture_points(job, facts: TargetFacts, spec=None) -> int:
    """K, the target states the run captures: len(target.aux_layers) (0 for []), or the length of the
    draft method's default (of `spec`, else job.draft), else the target's, when it is null (checked
    against the target when a run starts)."""
    spec = job.draft if spec is None else spec
    points = requested_capture_points(spec, job.target.aux_layers, facts.num_layers)
    return len(default_capture_points(facts.num_layers) if points is None else points)


def resolve_draft(spec, facts: TargetFacts, num_aux: int | None = None):
    """The model config the trainer builds from `draft.*` (a method's own config, draft/registry.py),
    with `num_aux` capture points (None: the method's default count on these facts); unset sizes
    follow the target. A method that refuses the spec raises PlanError (a ValueError) with its reason."""
    if num_aux is None:
        points = requested_capture_points(spec, None, facts.num_layers)
        num_aux = len(default_capture_points(facts.num_layers) if points is None else points)
    try:
        return method_of_spec(spec).resolve_config(spec, facts, num_aux)
    except PlanError:
        raise
    except ValueError as err:
        raise PlanError(str(err)) from err


def draft_of(job, facts: TargetFacts, spec=None) -> tuple[DraftMethod, Any]:
    """(the method whose config job.draft is, its model config for this target and the run's capture points);
    `spec` replaces job.draft (the fit search and the method comparison vary it)."""
    spec = job.draft if spec is None else spec
    return method_of_spec(spec), resolve_draft(spec, facts, num_capture_points(job, facts, spec))


def draft_param_counts(cfg, method: DraftMethod | None = None) -> dict[str, int]:
    """Parameters per module of the method's model; names ending in '(frozen)' are not trained."""
    return (method or method_of_config(cfg)).plan.param_counts(cfg)


def trainable_params(cfg, method: DraftMethod | None = None) -> int:
    return trainable_count(draft_param_counts(cfg, method))
