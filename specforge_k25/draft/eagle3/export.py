"""Serving folder of the EAGLE-3 head: `LlamaForCausalLMEagle3`, read by SGLang and vLLM as is
(docs/EAGLE3.md §5); its check, and the loader back into `Eagle3Draft`.

The three captured layers are written twice, once per server, because the two number them
differently and read different keys (target_engine/layers.py computes both; export/serving.py
passes them):
  * SGLang 0.5.23 reads `eagle_config.eagle_aux_hidden_state_layer_ids` (its per-model rule;
    the top-level key only counts how many there are);
  * vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` first (from 0.11.1; fallbacks to
    `eagle_config.layer_ids` from 0.22.0, and in one runner to SGLang's nested key from 0.27.0,
    which would be off by one for a Llama target), in its numbering = capture points
    (docs/EAGLE3.md §7).
Without the vLLM keys vLLM silently uses its default layers, right only when the capture points
happen to be its default [2, L//2, L-3].

The EAGLE-3.1 options (docs/EAGLE3.md §1.5) are written only when on, as top-level booleans both
servers read (SGLang 0.5.23 `llama_eagle3.py`, vLLM >= 0.22 `llama_eagle3.py`): `fc_norm` with
the tensors `fc_norm.{0,1,2}.weight`, and `norm_output`. With both off neither key nor tensor is
written: a plain EAGLE-3 folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..export_folder import shape_problems
from ..method import draft_state
from .model import NUM_AUX, DraftConfig, Eagle3Draft
from ..vocab import VOCAB_MAPS, vocab_map_problems, with_identity_maps, without_identity_maps

# EAGLE-3.1 config keys, top level, read as booleans by SGLang and vLLM (absent = off). SGLang
# also takes `use_aux_norm` for fc_norm; vLLM does not, so an export never relies on it.
EAGLE31_OPTIONS = ("fc_norm", "norm_output")


def serving_config(cfg: DraftConfig, sglang_capture_ids: list[int], vllm_ids: list[int], bos_token_id, eos_token_id,
                   dtype: str = "float32") -> dict:
    """config.json. `sglang_capture_ids`: SGLang's ids for the target; `vllm_ids`: vLLM's (the capture
    points); `eos_token_id` as served (export/serving.py::served_eos)."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(sglang_capture_ids), "use_aux_hidden_state": True,
                         "layer_ids": vllm_ids},
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
    }
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    for option in EAGLE31_OPTIONS:  # absent when off: a plain EAGLE-3 export stays as it was
        if getattr(cfg, option):
            config[option] = True
    return config

def serving_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our state (no embedding) under the checkpoint's names, which are ours; floats in `dtype`."""
    state = without_identity_maps(draft_state(draft), draft.cfg.draft_vocab_size, draft.cfg.vocab_size)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")


def config_to_draft(config: dict) -> DraftConfig:
    missing = [k for k in _REQUIRED_FIELDS if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    return DraftConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], vocab_size=config["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        **{option: config.get(option) is True for option in EAGLE31_OPTIONS},
    )


def _eagle31_problems(config: dict) -> list[str]:
    """Option keys the two servers would read differently."""
    problems = [f"config.{o}={config[o]!r}: must be true or false (the servers test its truth)"
                for o in EAGLE31_OPTIONS if o in config and not isinstance(config[o], bool)]
    if config.get("use_aux_norm") and config.get("fc_norm") is not True:
        problems.append("config.use_aux_norm without config.fc_norm: SGLang applies fc_norm, vLLM does not")
    return problems


def validate_export(export_dir: str | Path) -> None:
    """Raise ValueError listing every way the folder differs from what SGLang's and vLLM's loaders expect."""
    d = Path(export_dir)
    problems = []
    config = json.loads((d / "config.json").read_text())
    for key, want in (("architectures", ["LlamaForCausalLMEagle3"]), ("model_type", "llama"), ("num_hidden_layers", 1),
                      ("tie_word_embeddings", False)):
        if config.get(key) != want:
            problems.append(f"config.{key}={config.get(key)!r}, expected {want!r}")
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and len(ids) == 3 and all(type(i) is int for i in ids)):
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r}: need 3 ints")
    problems += _vllm_id_problems(config, ids)
    problems += _eagle31_problems(config)
    cfg = config_to_draft(config)
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                              cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    expected = {
        "fc.weight": (H, 3 * Ht), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H), "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I), "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }
    if cfg.fc_norm:
        expected |= {f"fc_norm.{i}.weight": (Ht,) for i in range(NUM_AUX)}
    tensors = load_file(d / "model.safetensors")
    problems += shape_problems(tensors, expected, VOCAB_MAPS, lambda name: (
        "config.fc_norm is off: the servers would not apply it" if name.startswith("fc_norm.")
        else "the embedding must not be exported"))
    problems += vocab_map_problems(tensors, cfg.draft_vocab_size, cfg.vocab_size)
    if problems:
        raise ValueError(f"invalid export {d}:\n  " + "\n  ".join(problems))


def _vllm_id_problems(config: dict, sglang_ids) -> list[str]:
    """The vLLM keys, when present (exports older than them lack both): 3 ints, the same in both
    places, and naming the layers SGLang's ids name. SGLang's rule is per model family (the
    export does not record which), so "the same layers" means vLLM ids == SGLang ids (DeepSeek,
    Kimi) or == SGLang ids + 1 (Llama; DeepSeek ids starting at 1)."""
    top, nested = config.get("eagle_aux_hidden_state_layer_ids"), config.get("eagle_config", {}).get("layer_ids")
    if top is None and nested is None:
        return []
    if not (isinstance(top, list) and len(top) == 3 and all(type(i) is int for i in top)):
        return [f"eagle_aux_hidden_state_layer_ids={top!r}: need 3 ints (vLLM reads them there)"]
    if nested != top:
        return [f"eagle_config.layer_ids={nested!r} differs from eagle_aux_hidden_state_layer_ids={top!r}"]
    sglang_ok = isinstance(sglang_ids, list) and len(sglang_ids) == 3 and all(type(i) is int for i in sglang_ids)
    if sglang_ok and top not in (sglang_ids, [i + 1 for i in sglang_ids]):
        return [f"vLLM ids {top} and SGLang ids {sglang_ids} capture different layers"]
    return []


def load_export(export_dir: str | Path, embed_weight: torch.Tensor) -> Eagle3Draft:
    """Rebuild our draft from an export folder plus the target's embedding [V, H]."""
    d = Path(export_dir)
    validate_export(d)
    cfg = config_to_draft(json.loads((d / "config.json").read_text()))
    draft = Eagle3Draft(cfg)
    state = with_identity_maps(load_file(d / "model.safetensors"), cfg.draft_vocab_size, cfg.vocab_size)
    state["embed_tokens.weight"] = embed_weight
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return draft
