"""Serving folder of the MLA draft: `Eagle3DeepseekV2ForCausalLM`, read by SGLang 0.5.23
(srt/models/kimi_k25_eagle3.py) and vLLM >= 0.18 (model_executor/models/deepseek_eagle3.py);
and the loader back into `Eagle3MLADraft`.

What each server reads (docs/EAGLE3.md §6):
  * tensors `layers.0.*` for the decoder layer (SGLang maps `layers.0.` to its `midlayer.`,
    vLLM keeps `layers.0.`; both also accept `midlayer.`), `fc`, `norm`, `lm_head`, `d2t`
    (`t2d` is skipped by both); q_a_proj and kv_a_proj_with_mqa stay separate (each server fuses
    them itself), as do gate_proj / up_proj. No embedding: both use the target's.
  * layer ids: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` (its per-model rule;
    its fc width is K·Ht with K the length of that list), vLLM the top-level
    `eagle_aux_hidden_state_layer_ids` (capture points; newer releases also `eagle_config.layer_ids`).
    The ids come from target_engine/layers.py (`sglang_layer_ids`, `vllm_layer_ids`): the caller passes
    them, draft/ imports nothing of ours outside itself.
  * rope: `rope_theta` and `rope_scaling` (DeepSeek YaRN; always written, factor 1 = plain RoPE:
    SGLang's CPU rope takes YaRN only, and vLLM 0.18 gives a draft without `rope_scaling` base
    10000 whatever `rope_theta` says).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..export_folder import shape_problems
from ..method import draft_state
from ..vocab import VOCAB_MAPS, vocab_map_problems, with_identity_maps, without_identity_maps
from .model import YARN_KEYS, Eagle3MLADraft, MLADraftConfig, _yarn

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MODEL_TYPE = "kimi_k2"
LAYER_PREFIX = "layers.0."  # the checkpoint's name of our `midlayer.`
_MIDLAYER = "midlayer."
# the YaRN fields of a DeepSeek-V3 config, written even when they hold the default
YARN_WRITTEN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def serving_tensors(draft: Eagle3MLADraft, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our state (no embedding) under the checkpoint's names; floats in `dtype`, d2t int64, t2d bool."""
    out = {}
    for name, t in without_identity_maps(draft_state(draft), draft.cfg.draft_vocab_size, draft.cfg.vocab_size).items():
        if name.startswith(_MIDLAYER):
            name = LAYER_PREFIX + name[len(_MIDLAYER):]
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def serving_config(cfg: MLADraftConfig, sglang_capture_ids: list[int], vllm_layer_ids: list[int], bos_token_id,
                   eos_token_id, dtype: str = "float32") -> dict:
    """config.json. `sglang_capture_ids`: SGLang's ids for the target (target_engine/layers.py::sglang_layer_ids);
    `vllm_layer_ids`: vLLM's (vllm_layer_ids(capture points)). One id per aux state."""
    for ids, who in ((sglang_capture_ids, "SGLang"), (vllm_layer_ids, "vLLM")):
        if len(ids) != cfg.num_aux_hidden_states:
            raise ValueError(f"{len(ids)} {who} layer ids for a draft that reads "
                             f"{cfg.num_aux_hidden_states} aux states")
    y, given = _yarn(cfg), cfg.rope_scaling or {}
    rope_scaling = {"type": "yarn", **{k: y[k] for k in YARN_KEYS if k in given or k in YARN_WRITTEN}}
    config = {
        "architectures": [ARCHITECTURE],
        # kimi_k2, not deepseek_v3: vLLM (0.18-0.33) rewrites a deepseek_v3 draft config into its MTP
        # layer and refuses it; both servers read kimi_k2 as DeepseekV3Config (SGLang 0.5.23 registers
        # the alias for this very class)
        "model_type": MODEL_TYPE,
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        # layer 0 < first_k_dense_replace: dense by the DeepSeek rule too (both servers build a dense MLP anyway)
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(sglang_capture_ids), "use_aux_hidden_state": True,
                         "layer_ids": list(vllm_layer_ids)},
        "eagle_aux_hidden_state_layer_ids": list(vllm_layer_ids),
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config


def expected_shapes(cfg: MLADraftConfig) -> dict[str, tuple]:
    H, nh, r, rq = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    dn, dr, dv, I = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.intermediate_size
    a = LAYER_PREFIX + "self_attn."
    return {
        "fc.weight": (H, cfg.num_aux_hidden_states * cfg.target_hidden_size),
        LAYER_PREFIX + "input_layernorm.weight": (H,), LAYER_PREFIX + "hidden_norm.weight": (H,),
        a + "q_a_proj.weight": (rq, 2 * H), a + "q_a_layernorm.weight": (rq,),
        a + "q_b_proj.weight": (nh * (dn + dr), rq),
        a + "kv_a_proj_with_mqa.weight": (r + dr, 2 * H), a + "kv_a_layernorm.weight": (r,),
        a + "kv_b_proj.weight": (nh * (dn + dv), r), a + "o_proj.weight": (H, nh * dv),
        LAYER_PREFIX + "post_attention_layernorm.weight": (H,), LAYER_PREFIX + "mlp.gate_proj.weight": (I, H),
        LAYER_PREFIX + "mlp.up_proj.weight": (I, H), LAYER_PREFIX + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
    }


def config_to_draft(config: dict) -> MLADraftConfig:
    """config.json -> MLADraftConfig (K from SGLang's id list, as SGLang sizes fc)."""
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "draft_vocab_size",
              "rms_norm_eps", "rope_theta", "max_position_embeddings")
    missing = [k for k in fields if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r}: need a list of ints")
    rope_scaling = dict(config.get("rope_scaling") or {})
    return MLADraftConfig(**{k: config[k] for k in fields}, rope_scaling=rope_scaling, num_aux_hidden_states=len(ids),
                          target_hidden_size=config.get("target_hidden_size") or config["hidden_size"])


def validate_export(export_dir: str | Path) -> None:
    """Raise ValueError listing every way the folder differs from what both servers load."""
    d = Path(export_dir)
    config = json.loads((d / "config.json").read_text())
    problems = [f"config.{key}={config.get(key)!r}, expected {want!r}"
                for key, want in (("architectures", [ARCHITECTURE]), ("model_type", MODEL_TYPE),
                                  ("num_hidden_layers", 1), ("tie_word_embeddings", False))
                if config.get(key) != want]
    cfg = config_to_draft(config)
    top, nested = config.get("eagle_aux_hidden_state_layer_ids"), config.get("eagle_config", {}).get("layer_ids")
    if top != nested or not isinstance(top, list) or len(top) != cfg.num_aux_hidden_states:
        problems.append(f"vLLM ids {top!r} / eagle_config.layer_ids {nested!r}: need the same "
                        f"{cfg.num_aux_hidden_states} ints in both")
    tensors = load_file(d / "model.safetensors")
    problems += shape_problems(tensors, expected_shapes(cfg), VOCAB_MAPS,
                               lambda name: "vLLM skips unknown names silently")
    problems += vocab_map_problems(tensors, cfg.draft_vocab_size, cfg.vocab_size)
    if problems:
        raise ValueError(f"invalid MLA draft export {d}:\n  " + "\n  ".join(problems))


def load_export(export_dir: str | Path, embed_weight: torch.Tensor) -> Eagle3MLADraft:
    """Rebuild the draft from an export folder plus the target's embedding [V, H]."""
    d = Path(export_dir)
    validate_export(d)
    cfg = config_to_draft(json.loads((d / "config.json").read_text()))
    draft = Eagle3MLADraft(cfg)
    state = {}
    tensors = with_identity_maps(load_file(d / "model.safetensors"), cfg.draft_vocab_size, cfg.vocab_size)
    for name, t in tensors.items():
        if name.startswith(LAYER_PREFIX):
            name = _MIDLAYER + name[len(LAYER_PREFIX):]
        state[name] = t.float() if t.is_floating_point() else t
    state["embed_tokens.weight"] = embed_weight.float()
    draft.load_state_dict(state)
    return draft
