"""Write a trained draft as a `LlamaForCausalLMEagle3` folder that SGLang and vLLM load as is
(docs/EAGLE3.md §5), check such a folder, and load it back into our draft class.

The three captured layers are written twice, once per server, because the two number them
differently and read different keys (target_engine/layers.py):
  * SGLang 0.5.23 reads `eagle_config.eagle_aux_hidden_state_layer_ids` (its per-model rule;
    the top-level key only counts how many there are);
  * vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` first (0.16-0.18: only there;
    later releases fall back to `eagle_config.layer_ids`, and one of their runners to SGLang's
    nested key, which would be off by one for a Llama target), in its numbering = capture points.
Without the vLLM keys vLLM silently uses its default layers, right only when the capture points
happen to be its default [2, L//2, L-3].

The EAGLE-3.1 options (docs/EAGLE3.md §1.5) are written only when on, as top-level booleans both
servers read (SGLang 0.5.23 `llama_eagle3.py`, vLLM >= 0.22 `llama_eagle3.py`): `fc_norm` with
the tensors `fc_norm.{0,1,2}.weight`, and `norm_output`. With both off neither key nor tensor is
written: a plain EAGLE-3 folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..draft.model import NUM_AUX, DraftConfig, Eagle3Draft, draft_state
from ..paths import write_atomic, write_text_atomic
from ..target_engine.layers import vllm_layer_ids

# EAGLE-3.1 config keys, top level, read as booleans by SGLang and vLLM (absent = off). SGLang
# also takes `use_aux_norm` for fc_norm; vLLM does not, so an export never relies on it.
EAGLE31_OPTIONS = ("fc_norm", "norm_output")


def served_eos(eos_token_id, end_of_turn_id: int | None = None):
    """The `eos_token_id` an export writes: the ids the served model stops at. A chat target whose
    turns end with their own token (Kimi-K2.5: `<|im_end|>` 163586, while its config's eos is
    [EOS] 163585) gets that token first, then the config's eos ids; without one, the config's eos."""
    if end_of_turn_id is None:
        return eos_token_id
    rest = eos_token_id if isinstance(eos_token_id, list) else [] if eos_token_id is None else [eos_token_id]
    rest = [i for i in rest if i != end_of_turn_id]
    return [int(end_of_turn_id), *rest] if rest else int(end_of_turn_id)


def serving_config(cfg: DraftConfig, eagle_layer_ids: list[int], bos_token_id, eos_token_id, dtype: str,
                   capture_points: list[int], end_of_turn_id: int | None = None) -> dict:
    """`eagle_layer_ids`: SGLang's ids for this target; `capture_points`: the layers they capture;
    `end_of_turn_id`: the token ending a served turn, written first in `eos_token_id` (`served_eos`)."""
    vllm_ids = vllm_layer_ids(capture_points)
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
        "eos_token_id": served_eos(eos_token_id, end_of_turn_id),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(eagle_layer_ids), "use_aux_hidden_state": True,
                         "layer_ids": vllm_ids},
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
    }
    if cfg.hidden_size != cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    for option in EAGLE31_OPTIONS:  # absent when off: a plain EAGLE-3 export stays as it was
        if getattr(cfg, option):
            config[option] = True
    return config


def export_draft(draft: Eagle3Draft, out_dir: str | Path, eagle_layer_ids: list[int], bos_token_id, eos_token_id,
                 dtype: torch.dtype = torch.float32, *, capture_points: list[int],
                 end_of_turn_id: int | None = None) -> Path:
    """Atomically write <out_dir>/{config.json, model.safetensors}; no embedding (the server shares the target's).

    `eagle_layer_ids` are SGLang's ids (`target.layers.sglang_layer_ids`), `capture_points` the
    layer inputs they capture; the vLLM ids are derived from the latter. `end_of_turn_id`
    (target.end_of_turn_token's id) goes first in the written `eos_token_id` (`served_eos`).
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in draft_state(draft).items()}
    # the umask's mode: a server running as another user reads the folder (save_file alone makes 0600)
    write_atomic(tmp / "model.safetensors", lambda f: save_file(tensors, f, metadata={"format": "pt"}))
    config = serving_config(draft.cfg, eagle_layer_ids, bos_token_id, eos_token_id, str(dtype).replace("torch.", ""),
                            capture_points, end_of_turn_id)
    write_text_atomic(tmp / "config.json", json.dumps(config, indent=2))
    try:
        validate_export(tmp)
    except ValueError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")


def _config_to_draft(config: dict) -> DraftConfig:
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
    cfg = _config_to_draft(config)
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                              cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    expected = {
        "fc.weight": (H, 3 * Ht), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H), "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I), "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    }
    if cfg.fc_norm:
        expected |= {f"fc_norm.{i}.weight": (Ht,) for i in range(NUM_AUX)}
    tensors = load_file(d / "model.safetensors")
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in sorted(set(tensors) - set(expected)):
        why = ("config.fc_norm is off: the servers would not apply it" if name.startswith("fc_norm.")
               else "the embedding must not be exported")
        problems.append(f"unexpected tensor {name} ({why})")
    if tensors.get("d2t") is not None and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t has dtype {tensors['d2t'].dtype}, expected int64")
    if tensors.get("t2d") is not None and tensors["t2d"].dtype != torch.bool:
        problems.append(f"t2d has dtype {tensors['t2d'].dtype}, expected bool")
    if not problems:  # vocab map semantics only once shapes and dtypes are right
        used = torch.arange(cfg.draft_vocab_size) + tensors["d2t"]
        if used.min() < 0 or used.max() >= cfg.vocab_size or not bool(torch.all(used[1:] > used[:-1])):
            problems.append("d2t does not map draft ids to strictly increasing target ids")
        elif not torch.equal(tensors["t2d"].nonzero().flatten(), used):
            problems.append("t2d disagrees with d2t")
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


def load_exported_draft(export_dir: str | Path, embed_weight: torch.Tensor) -> Eagle3Draft:
    """Rebuild our draft from an export folder plus the target's embedding [V, H]."""
    d = Path(export_dir)
    validate_export(d)
    draft = Eagle3Draft(_config_to_draft(json.loads((d / "config.json").read_text())))
    state = load_file(d / "model.safetensors")
    state["embed_tokens.weight"] = embed_weight
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return draft
