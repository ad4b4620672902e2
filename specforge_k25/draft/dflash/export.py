"""Serving folder of the DFlash draft: `DFlashDraftModel`, read by SGLang 0.5.23
(srt/models/dflash.py, speculative_algorithm DFLASH) and vLLM (qwen3_dflash.py, method `dflash`);
and the loader back into `DFlashDraft`.

config.json: an AutoConfig-loadable `model_type: qwen3` (both servers build the draft from a
Qwen3-shaped config) with explicit `head_dim` (Qwen3's default 128 otherwise), `rope_theta`
(vLLM otherwise assumes another base) and `layer_types` all full attention (SGLang then makes every
layer ENCODER_ONLY, i.e. bidirectional over context + block), plus
  * `dflash_config: {target_layer_ids, block_size, mask_token_id}`. target_layer_ids are SGLang's
    ids: SGLang captures the input of layer id+1 for every model family
    (`set_dflash_layers_to_capture` in llama.py / deepseek_v2.py: layers_to_capture = id + 1), so
    id = capture point - 1 (our capture point p = the input of decoder layer p,
    target_engine/layers.py). No DeepSeek exception, unlike EAGLE-3's ids.
  * top-level `eagle_aux_hidden_state_layer_ids`: vLLM's ids, the capture points themselves (vLLM
    reads this key first and otherwise adds 1 to dflash_config.target_layer_ids: both give p).
  * `block_size` also top-level (older readers look there; SGLang prefers dflash_config's).
The served block size is `speculative_num_draft_tokens` (SGLang); the config's is the trained one.

Tensors, under the names SGLang's `load_weights` and vLLM's loader take: `fc.weight` [H, K*H],
`hidden_norm.weight`, `norm.weight`, `layers.i.{input_layernorm, post_attention_layernorm}.weight`,
`layers.i.self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}.weight` (q/k/v separate: each
server fuses them), `layers.i.mlp.{gate_proj, up_proj, down_proj}.weight`. No embedding, lm_head or
vocab maps: both servers use the target's embedding and lm_head, and the draft has no own vocab.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..export_folder import shape_problems
from ..method import draft_state
from .model import DFlashConfig, DFlashDraft, check_config

ARCHITECTURE = "DFlashDraftModel"
_NOT_SERVED = ("embed_tokens.", "d2t", "t2d", "lm_head")


def sglang_target_layer_ids(capture_points: list[int]) -> list[int]:
    """dflash_config.target_layer_ids for capture points p (SGLang captures the input of layer id+1)."""
    ids = [int(p) - 1 for p in capture_points]
    if not ids or min(ids) < 0:
        raise ValueError(f"capture points {capture_points}: DFlash needs points >= 1 (id = point - 1 >= 0)")
    return ids


def serving_tensors(draft: DFlashDraft, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: t.to(dtype) for name, t in draft_state(draft).items() if not name.startswith(_NOT_SERVED)}


def serving_config(cfg: DFlashConfig, vllm_layer_ids: list[int], bos_token_id, eos_token_id,
                   dtype: str = "float32") -> dict:
    """config.json. `vllm_layer_ids`: vLLM's ids (= our capture points, target_engine/layers.py
    vllm_layer_ids); SGLang's dflash ids are derived from them here (not the EAGLE-3 ids)."""
    if len(vllm_layer_ids) != cfg.num_aux_hidden_states:
        raise ValueError(f"{len(vllm_layer_ids)} layer ids for a draft that reads {cfg.num_aux_hidden_states} aux states")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "use_sliding_window": False,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": sglang_target_layer_ids(vllm_layer_ids), "block_size": cfg.block_size,
                          "mask_token_id": cfg.mask_token_id},
        "eagle_aux_hidden_state_layer_ids": [int(p) for p in vllm_layer_ids],
    }


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {"fc.weight": (H, cfg.num_aux_hidden_states * cfg.target_hidden_size), "hidden_norm.weight": (H,),
           "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    a + "q_proj.weight": (nh * hd, H), a + "k_proj.weight": (nkv * hd, H),
                    a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd),
                    a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    return out


def config_to_draft(config: dict) -> DFlashConfig:
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    missing = [k for k in fields if config.get(k) is None]
    dflash = config.get("dflash_config") or {}
    missing += [f"dflash_config.{k}" for k in ("target_layer_ids", "block_size", "mask_token_id") if dflash.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    ids = dflash["target_layer_ids"]
    if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise ValueError(f"dflash_config.target_layer_ids={ids!r}: need a list of ints")
    return DFlashConfig(**{k: config[k] for k in fields}, target_hidden_size=config["hidden_size"],
                        num_aux_hidden_states=len(ids), block_size=dflash["block_size"],
                        mask_token_id=dflash["mask_token_id"])


def validate_export(export_dir: str | Path) -> None:
    """Raise ValueError listing every way the folder differs from what both servers load."""
    d = Path(export_dir)
    config = json.loads((d / "config.json").read_text())
    problems = [f"config.{key}={config.get(key)!r}, expected {want!r}"
                for key, want in (("architectures", [ARCHITECTURE]), ("model_type", "qwen3"),
                                  ("tie_word_embeddings", False), ("rope_scaling", None))
                if config.get(key) != want]
    cfg = config_to_draft(config)
    try:
        check_config(cfg)
    except ValueError as e:
        problems.append(str(e))
    ids, vllm = config["dflash_config"]["target_layer_ids"], config.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(vllm, list) or [i + 1 for i in ids] != vllm:
        problems.append(f"eagle_aux_hidden_state_layer_ids={vllm!r} must be dflash_config.target_layer_ids + 1 "
                        f"({[i + 1 for i in ids]}): vLLM and SGLang would read different layers")
    if ids != sorted(set(ids)) or min(ids) < 0:
        problems.append(f"dflash_config.target_layer_ids={ids}: need distinct increasing ids >= 0")
    if config.get("layer_types", ["full_attention"] * cfg.num_hidden_layers) != ["full_attention"] * cfg.num_hidden_layers:
        problems.append(f"layer_types={config.get('layer_types')!r}: the draft is full (bidirectional) attention")
    tensors = load_file(d / "model.safetensors")
    problems += shape_problems(tensors, expected_shapes(cfg),
                               why_unexpected=lambda name: "the servers skip unknown names silently")
    if problems:
        raise ValueError(f"invalid DFlash draft export {d}:\n  " + "\n  ".join(problems))


def load_export(export_dir: str | Path, embed_weight: torch.Tensor) -> DFlashDraft:
    """Rebuild the draft from an export folder plus the target's embedding [V, H] (the lm_head is
    attached by DraftMethod.load)."""
    d = Path(export_dir)
    validate_export(d)
    draft = DFlashDraft(config_to_draft(json.loads((d / "config.json").read_text())))
    state = {name: t.float() for name, t in load_file(d / "model.safetensors").items()}
    state["embed_tokens.weight"] = embed_weight.float()
    state["d2t"], state["t2d"] = draft.d2t, draft.t2d
    draft.load_state_dict(state)
    return draft
