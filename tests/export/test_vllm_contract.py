"""The vLLM contract of our serving exports (docs/EAGLE3.md §7): for each draft method and variant,
a tiny draft is exported with `export_draft` and read the way vLLM's release sources read it,
release by release. vLLM is not installed here (and is never imported): what it reads is written
down below as data and as a small reader (`vllm_read`), each rule with the vLLM file and the
releases it was read in (the sdists of vllm 0.18.0, 0.18.1, 0.19.0, 0.21.0, 0.22.0, 0.22.1,
0.23.0, 0.24.0, 0.25.0, 0.26.0, 0.27.0, 0.28.0, 0.29.0, 0.30.0 and 0.33.0 from PyPI; 0.18.1 reads
exactly as 0.18.0, in every file used here). Paths are under `vllm/`.

A variant loads in a release when vLLM builds the class we export, reads the layer ids we captured,
sizes every parameter as our tensors are, fills every parameter from exactly one tensor, and reads
the options, the RoPE and the vocab map as trained. The minimum release of each variant
(`MIN_VLLM`, also in README.md's "Draft methods" table) is checked to be tight: the release
before it refuses or misreads the export.

Two known misreadings are marked xfail(strict): when the export is fixed they pass, and the mark
must go (docs/EAGLE3.md §7.3).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_k25.draft.eagle3_mla.model import Eagle3MLADraft, MLADraftConfig, _yarn
from specforge_k25.draft.eagle3.model import DraftConfig, Eagle3Draft
from specforge_k25.draft.registry import METHODS
from specforge_k25.draft.vocab import build_vocab_maps
from specforge_k25.export.serving import export_draft, load_exported_draft
from specforge_k25.target_engine.layers import DEEPSEEK_RULE, sglang_layer_ids

ROOT = Path(__file__).resolve().parents[2]


def V(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# ==============================================================================================
# What vLLM reads, as data
# ==============================================================================================

# Releases where something below changes, the first one at or after 0.18 (the first release that
# takes EAGLE-3 for a Kimi-K2.5 / DeepSeek target, §7.1) and the newest one read (0.33.0).
VERSIONS = ("0.18.0", "0.21.0", "0.22.0", "0.23.0", "0.25.0", "0.28.0", "0.29.0", "0.30.0", "0.33.0")

# config/speculative.py `SpeculativeConfig.hf_config_override` (0.18.0 .. 0.33.0): run on every
# draft's config.json before anything else; a config of these model types becomes a DeepSeek MTP
# layer (`architectures = ["DeepSeekMTPModel"]`, 0.33.0: "DeepseekV32MTPModel" for v32). "llama" and
# "kimi_k2" are rewritten in no release read.
MTP_REWRITTEN_MODEL_TYPES = {"deepseek_v3": "DeepSeekMTPModel", "deepseek_v32": "DeepSeekMTPModel",
                             "glm_moe_dsa": "DeepSeekMTPModel"}

# transformers_utils/configs/eagle.py `EAGLEConfig(method="eagle3")` (0.18.0, 0.33.0): an
# architecture that starts or ends with "Eagle3" is kept, any other gets the prefix "Eagle3".
# model_executor/models/registry.py `_SPECULATIVE_DECODING_MODELS` (0.18.0, 0.33.0; the
# LlamaForCausalLMEagle3 alias since 0.11.0, the two DeepSeek entries since 0.18.0):
VLLM_CLASSES = {
    "LlamaForCausalLMEagle3": "llama_eagle3.Eagle3LlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "llama_eagle3.Eagle3LlamaForCausalLM",
    "Eagle3DeepseekV2ForCausalLM": "deepseek_eagle3.Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV3ForCausalLM": "deepseek_eagle3.Eagle3DeepseekV2ForCausalLM",
}
LLAMA, MLA = "llama_eagle3.Eagle3LlamaForCausalLM", "deepseek_eagle3.Eagle3DeepseekV2ForCausalLM"

# Eagle3*ForCausalLM.load_weights (llama_eagle3.py, deepseek_eagle3.py; 0.18.0 .. 0.33.0), in
# order: a name containing "t2d" is skipped; containing "d2t" becomes "draft_id_to_target_id";
# containing "lm_head" stays; any other gets "model.". Then the model's loader renames
# "midlayer." to "layers.0." and merges the stacked shards below (first match wins, as vLLM's loop).
STACKED = {
    LLAMA: ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
            (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)),
    MLA: ((".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1),
          (".q_a_proj", ".fused_qkv_a_proj", 0), (".kv_a_proj_with_mqa", ".fused_qkv_a_proj", 1)),
}

# The first release of each change read from the sources.
SINCE = {
    # llama_eagle3.py / deepseek_eagle3.py: fc takes target_hidden_size (default hidden_size) x
    # num_aux, num_aux = config.num_aux_hidden_states, else len(eagle_config.eagle_aux_hidden_state_layer_ids),
    # else 3. Before: x 3, whatever the ids say.
    "num_aux_from_ids": "0.22.0",
    # llama_eagle3.py: top-level `fc_norm` (ModuleList of RMSNorm(target_hidden_size) x num_aux,
    # params model.fc_norm.{i}.weight, applied per chunk in combine_hidden_states) and top-level
    # `norm_output` (the next step reads the normed state). Before: neither key is read.
    "llama_eagle31": "0.22.0",
    # deepseek_eagle3.py: builds fc_norm and reads norm_output from 0.22.0, applies fc_norm from
    # 0.23.0 (0.22.x builds the norms and never calls them). Our MLA head has no such option.
    "mla_eagle31": "0.23.0",
    # deepseek_eagle3.py: a tensor name without a parameter is skipped silently (0.18.0 .. 0.24.0,
    # `if name not in params_dict: continue`); from 0.25.0 AutoWeightsLoader raises. llama_eagle3.py
    # raises in every release read (KeyError from params_dict, then AutoWeightsLoader).
    "mla_unknown_name_raises": "0.25.0",
    # deepseek_eagle3.py 0.18.0 .. 0.27.0 builds the rope from `rope_scaling` alone (copy, rope_type
    # deepseek_yarn; without rope_scaling {"rope_type": "default"}, base 10000 whatever rope_theta
    # says); from 0.28.0 it uses config.rope_parameters (rope_theta folded in).
    "mla_rope_from_rope_parameters": "0.28.0",
    # llama_eagle3.py / deepseek_eagle3.py: draft_id_to_target_id exists only when draft_vocab_size
    # differs from the target's vocab (model_config.get_vocab_size()); a `d2t` tensor then has no
    # parameter and AutoWeightsLoader raises. Before: always a parameter (zeros if no d2t).
    "full_vocab_drops_d2t": "0.30.0",
}


def since(change: str, version: str) -> bool:
    return V(version) >= V(SINCE[change])


class Refused(Exception):
    """vLLM would stop at startup."""


def vllm_class(config: dict) -> str:
    """The model class vLLM builds for the draft (method eagle3), or Refused."""
    archs = list(config["architectures"])
    if config.get("model_type") in MTP_REWRITTEN_MODEL_TYPES:  # hf_config_override
        archs = [MTP_REWRITTEN_MODEL_TYPES[config["model_type"]]]
    archs = [a if a.startswith("Eagle3") or a.endswith("Eagle3") else "Eagle3" + a for a in archs]  # EAGLEConfig
    if archs[0] not in VLLM_CLASSES:  # registry.py _raise_for_unsupported
        raise Refused(f"Model architectures {archs} are not supported (model_type {config.get('model_type')!r} "
                      f"is rewritten by SpeculativeConfig.hf_config_override)")
    return VLLM_CLASSES[archs[0]]


def vllm_config_reading(cls: str, config: dict, version: str) -> dict:
    """The config values vLLM builds the draft with."""
    eagle = config.get("eagle_config") or {}
    H = config["hidden_size"]
    Ht = config.get("target_hidden_size", H)
    if since("num_aux_from_ids", version):
        num_aux = config.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    else:
        num_aux = 3
    # v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config` (0.11.1 .. 0.33.0) and
    # v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (0.18.0 .. 0.33.0): the top-level list first;
    # only without it, from 0.22.0, the runner falls back to eagle_config.eagle_aux_hidden_state_layer_ids
    # (SGLang's numbering; modelled here) and, from 0.27.0, the v2 runner to eagle_config.layer_ids;
    # before 0.22.0 to its default layers.
    aux_ids = (config.get("eagle_aux_hidden_state_layer_ids")
               or (eagle.get("eagle_aux_hidden_state_layer_ids") if V(version) >= V("0.22.0") else None)
               or "vLLM's default layers")
    read = {
        "aux_ids": aux_ids, "num_aux": num_aux, "fc_in": Ht * num_aux, "H": H, "Ht": Ht,
        "draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"],
        "logit_scale": config.get("logit_scale", 1.0),
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "eps": config["rms_norm_eps"],
    }
    eagle31 = since("llama_eagle31" if cls == LLAMA else "mla_eagle31", version)
    read["fc_norm"] = bool(config.get("fc_norm", False)) if eagle31 else False
    read["norm_output"] = bool(config.get("norm_output", False)) if eagle31 else False
    # what we write that this release does not read at all (a trained option silently dropped)
    read["unread_options"] = [o for o in ("fc_norm", "norm_output") if config.get(o) and not eagle31]
    # d2t parameter: llama_eagle3.py / deepseek_eagle3.py __init__
    read["d2t_param"] = not (since("full_vocab_drops_d2t", version) and read["draft_vocab_size"] == config["vocab_size"])
    if cls == LLAMA:
        read["use_aux_hidden_state"] = eagle.get("use_aux_hidden_state", True)
        # 0.22.0+: eagle_config.norm_before_fc first, then the top-level key
        read["norm_before_fc"] = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))
                                      if V(version) >= V("0.22.0") else config.get("norm_before_fc", False))
        # model_executor/models/llama.py LlamaAttention / LlamaMLP (0.18.0 .. 0.33.0)
        nh, nkv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
        read.update(nh=nh, nkv=nkv, hd=config.get("head_dim") or H // nh, I=config["intermediate_size"],
                    qkv_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)),
                    act=config.get("hidden_act"))
        # transformers_utils/config.py patch_rope_parameters: rope_theta + rope_scaling -> rope_parameters
        scaling = config.get("rope_scaling")
        read["rope"] = {"rope_type": "default" if not scaling else scaling.get("rope_type", scaling.get("type")),
                        "base": config.get("rope_theta", 10000)}
    else:
        # deepseek_eagle3.py DeepseekV2Eagle3DecoderLayer + deepseek_v2.py DeepseekV2MLAAttention / DeepseekV2MLP
        read.update(nh=config["num_attention_heads"], I=config["intermediate_size"], act=config.get("hidden_act"),
                    q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config.get("kv_lora_rank", 0),
                    dn=config.get("qk_nope_head_dim", 0), dr=config.get("qk_rope_head_dim", 0),
                    dv=config.get("v_head_dim", 0))
        scaling = dict(config.get("rope_scaling") or {})
        if scaling or since("mla_rope_from_rope_parameters", version):
            params = {**scaling, "rope_theta": config.get("rope_theta", 10000)}
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":  # DeepseekV2MLAAttention: yarn -> deepseek_yarn (llama scaling if apply_yarn_scaling false)
                kind = "deepseek_yarn" if params.get("apply_yarn_scaling", True) else "deepseek_llama_scaling"
        else:
            params, kind = {}, "default"
        rope = {"rope_type": kind, "base": params.get("rope_theta", 10000)}  # layers/rotary_embedding get_rope
        if kind == "deepseek_yarn":  # get_rope: these two are indexed (KeyError if absent), the rest defaulted
            rope["factor"] = params["factor"]
            rope["original_max_position_embeddings"] = params["original_max_position_embeddings"]
            defaults = dict(extrapolation_factor=1, attn_factor=1, beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=0)
            rope.update({k: params.get(k, d) for k, d in defaults.items()})  # DeepseekScalingRotaryEmbedding
        read["rope"] = rope
    return read


def vllm_parameters(cls: str, r: dict) -> dict[str, dict]:
    """Every parameter the draft class builds: name -> {shard: shape} (one shard None when not stacked)."""
    H, I, fc_in = r["H"], r["I"], r["fc_in"]
    one = lambda *shape: {None: shape}  # noqa: E731
    L = "model.layers.0."
    params = {"model.norm.weight": one(H), "lm_head.weight": one(r["draft_vocab_size"], H),
              L + "input_layernorm.weight": one(H), L + "hidden_norm.weight": one(H),
              L + "post_attention_layernorm.weight": one(H),
              L + "mlp.gate_up_proj.weight": {0: (I, H), 1: (I, H)}, L + "mlp.down_proj.weight": one(H, I)}
    if r["d2t_param"]:
        params["draft_id_to_target_id"] = one(r["draft_vocab_size"])
    if cls == LLAMA:
        nh, nkv, hd = r["nh"], r["nkv"], r["hd"]
        params[L + "self_attn.qkv_proj.weight"] = {"q": (nh * hd, 2 * H), "k": (nkv * hd, 2 * H), "v": (nkv * hd, 2 * H)}
        params[L + "self_attn.o_proj.weight"] = one(H, nh * hd)
        if r["use_aux_hidden_state"]:
            params["model.fc.weight"] = one(H, fc_in)
        if r["norm_before_fc"]:
            params["model.input_norm.weight"] = one(fc_in)
    else:
        nh, rq, rk, dn, dr, dv = r["nh"], r["q_lora_rank"], r["kv_lora_rank"], r["dn"], r["dr"], r["dv"]
        a = L + "self_attn."
        params["model.fc.weight"] = one(H, fc_in)
        if rq is None:  # not ours: the MLA head requires q_lora_rank
            params[a + "q_proj.weight"] = one(nh * (dn + dr), 2 * H)
            params[a + "kv_a_proj_with_mqa.weight"] = one(rk + dr, 2 * H)
        else:
            params[a + "fused_qkv_a_proj.weight"] = {0: (rq, 2 * H), 1: (rk + dr, 2 * H)}
            params[a + "q_a_layernorm.weight"] = one(rq)
            params[a + "q_b_proj.weight"] = one(nh * (dn + dr), rq)
        params[a + "kv_a_layernorm.weight"] = one(rk)
        params[a + "kv_b_proj.weight"] = one(nh * (dn + dv), rk)
        params[a + "o_proj.weight"] = one(H, nh * dv)
    if r["fc_norm"]:
        params.update({f"model.fc_norm.{i}.weight": one(r["Ht"]) for i in range(r["num_aux"])})
    return params


def vllm_target(cls: str, name: str) -> tuple[str, object] | None:
    """(parameter, shard) a checkpoint tensor lands in, by the loaders' renames; None = skipped."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for shard_name, param_name, shard in STACKED[cls]:
        if shard_name in name:
            return name.replace(shard_name, param_name), shard
    return name, None


def vllm_read(out: Path, version: str, cls: str | None = None) -> tuple[dict, list[str]]:
    """Read an export folder as `version` of vLLM would: (config reading, problems). No problem =
    vLLM builds the draft we trained. `cls` skips the class lookup (tests of one reader)."""
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    cls = cls or vllm_class(config)
    r = vllm_config_reading(cls, config, version)
    params = vllm_parameters(cls, r)
    problems = [f"config.{o} is not read: the draft runs without it" for o in r["unread_options"]]
    filled: dict[str, dict] = {}
    for name, t in tensors.items():
        hit = vllm_target(cls, name)
        if hit is None:
            continue
        param, shard = hit
        if param not in params:
            if cls == MLA and not since("mla_unknown_name_raises", version) and "draft_id_to_target_id" not in param:
                problems.append(f"tensor {name} is skipped silently (no parameter {param})")
            else:
                problems.append(f"tensor {name}: There is no module or parameter named {param!r}")
            continue
        if shard not in params[param]:
            problems.append(f"tensor {name}: {param} has no shard {shard!r}")
        elif shard in filled.setdefault(param, {}):
            problems.append(f"{param}[{shard}] filled twice")
        else:
            filled[param][shard] = tuple(t.shape)
            if tuple(t.shape) != params[param][shard]:  # the weight loaders assert the shape
                problems.append(f"tensor {name} {tuple(t.shape)} into {param}[{shard}] {params[param][shard]}")
    for param, shards in params.items():
        for shard in shards:
            # draft_id_to_target_id starts as zeros: the identity a full-vocab export leaves out
            identity = param == "draft_id_to_target_id" and r["draft_vocab_size"] == config["vocab_size"]
            if shard not in filled.get(param, {}) and not identity:
                problems.append(f"parameter {param}[{shard}] is not in the checkpoint (left as initialised)")
    if tensors.get("d2t") is not None and tensors["d2t"].dtype != torch.int64:
        problems.append("d2t is not int64 (draft_id_to_target_id is torch.long)")
    return r, problems


# ==============================================================================================
# Our exports
# ==============================================================================================

POINTS = [2, 30, 58]  # capture points behind a Kimi-K2.5-like target (DeepSeek rule: SGLang ids = points)
POINTS_4 = [2, 20, 40, 58]
H, V_TARGET, VD = 32, 300, 50

# variant -> (method, options); each exported once per module
VARIANTS = {
    "eagle3": ("eagle3", {}),
    "eagle3-fc_norm": ("eagle3", {"fc_norm": True}),
    "eagle3-norm_output": ("eagle3", {"norm_output": True}),
    "eagle3-fc_norm-norm_output": ("eagle3", {"fc_norm": True, "norm_output": True}),
    "eagle3-Ht_ne_H": ("eagle3", {"target_hidden_size": 48}),
    "eagle3-full_vocab": ("eagle3", {"draft_vocab_size": V_TARGET}),
    "eagle3_mla": ("eagle3_mla", {}),
    "eagle3_mla-4_aux": ("eagle3_mla", {"num_aux_hidden_states": 4}),
    "eagle3_mla-Ht_ne_H": ("eagle3_mla", {"target_hidden_size": 48}),
    "eagle3_mla-plain_rope": ("eagle3_mla", {"rope_scaling": {}, "rope_theta": 500000.0}),
    "eagle3_mla-full_vocab": ("eagle3_mla", {"draft_vocab_size": V_TARGET}),
}

# The first vLLM release that loads each variant as trained, behind a Kimi-K2.5 target (README.md
# "Draft methods"; docs/EAGLE3.md §7.1). Every variant needs 0.18.0 for the target's side.
MIN_VLLM = {
    "eagle3": "0.18.0",
    "eagle3-fc_norm": "0.22.0",
    "eagle3-norm_output": "0.22.0",
    "eagle3-fc_norm-norm_output": "0.22.0",
    "eagle3-Ht_ne_H": "0.18.0",
    "eagle3-full_vocab": "0.18.0",
    "eagle3_mla": "0.18.0",
    "eagle3_mla-4_aux": "0.22.0",
    "eagle3_mla-Ht_ne_H": "0.18.0",
    "eagle3_mla-plain_rope": "0.18.0",
    "eagle3_mla-full_vocab": "0.18.0",
}

# config/speculative.py `_verify_args`: EAGLE-3 targets by model_type; deepseek_v2, deepseek_v3,
# kimi_k2 and kimi_k25 join the list in 0.18.0 (0.17.1 refuses them), with the aux-state capture in
# model_executor/models/deepseek_v2.py and kimi_k25.py (SupportsEagle3). A Llama-family target
# (model_type "llama") is on the list, and reads our Llama head, from 0.11.1.
KIMI_TARGET_SINCE = "0.18.0"
assert min(MIN_VLLM.values(), key=V) == KIMI_TARGET_SINCE == VERSIONS[0]

# Known misreadings (docs/EAGLE3.md §7.3), fixed in the export and kept here so that a regression
# shows as one: variant predicate, first release, reason. The MLA export once said model_type
# deepseek_v3 (every vLLM 0.18.0-0.33.0 rewrites that into a DeepSeek MTP layer and refuses it: now
# kimi_k2), and full-vocab exports once wrote d2t (vLLM >= 0.30.0 has no parameter for it: now left out).
KNOWN_MISREADS: list = []


def known_misread(variant: str, version: str) -> str | None:
    reasons = [why for applies, first, why in KNOWN_MISREADS if applies(variant) and V(version) >= V(first)]
    return "; ".join(reasons) or None


def _draft(method: str, options: dict, seed: int):
    torch.manual_seed(seed)
    vd = options.get("draft_vocab_size", VD)
    ht = options.get("target_hidden_size", H)
    if method == "eagle3":
        cfg = DraftConfig(hidden_size=H, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=6, vocab_size=V_TARGET, draft_vocab_size=vd, target_hidden_size=ht,
                          rope_theta=50000.0, fc_norm=options.get("fc_norm", False),
                          norm_output=options.get("norm_output", False))
        draft = Eagle3Draft(cfg)
    else:
        yarn = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        cfg = MLADraftConfig(hidden_size=H, intermediate_size=40, num_attention_heads=2, q_lora_rank=12,
                             kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                             vocab_size=V_TARGET, draft_vocab_size=vd, target_hidden_size=ht,
                             num_aux_hidden_states=options.get("num_aux_hidden_states", 3),
                             rope_theta=options.get("rope_theta", 50000.0),
                             rope_scaling=options.get("rope_scaling", yarn), max_position_embeddings=4096)
        draft = Eagle3MLADraft(cfg)
    d2t, t2d = build_vocab_maps(torch.randint(0, 1000, (V_TARGET,)), vd)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    return draft


@pytest.fixture(scope="module")
def exports(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("vllm_contract")
    out = {}
    for i, (variant, (method, options)) in enumerate(VARIANTS.items()):
        draft = _draft(method, options, seed=i)
        points = POINTS_4 if options.get("num_aux_hidden_states") == 4 else POINTS
        path = export_draft(draft, root / variant, sglang_layer_ids(points, DEEPSEEK_RULE), 163584, [163586, 163585],
                            capture_points=points)
        out[variant] = (draft, path, points)
    return out


def _variants_with_marks():
    """One case per variant; xfail(strict) when some release from its minimum on misreads it."""
    for variant in VARIANTS:
        why = sorted({w for r in VERSIONS if V(r) >= V(MIN_VLLM[variant]) for w in [known_misread(variant, r)] if w})
        yield pytest.param(variant, marks=[pytest.mark.xfail(strict=True, reason="; ".join(why))] if why else [])


def _releases(variant: str) -> list[str]:
    return [r for r in VERSIONS if V(r) >= V(MIN_VLLM[variant])]


# ==============================================================================================
# Tests
# ==============================================================================================

@pytest.mark.parametrize("variant", list(_variants_with_marks()))
def test_vllm_loads_the_export_as_trained(exports, variant):
    """From its minimum release to the newest read, vLLM builds the class we export and reads
    every key and tensor as trained."""
    draft, out, points = exports[variant]
    cls = vllm_class(json.loads((out / "config.json").read_text()))
    assert cls == (LLAMA if isinstance(draft, Eagle3Draft) else MLA)
    for version in _releases(variant):
        read, problems = vllm_read(out, version)
        assert problems == [], version
        _assert_reads_as_trained(draft, read, points)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_reads_keys_and_tensors_once_the_class_is_found(exports, variant):
    """The same reading with the model class given: the tensor names and keys of every variant
    match each release, a full-vocab export's (no vocab maps) included."""
    draft, out, points = exports[variant]
    cls = LLAMA if isinstance(draft, Eagle3Draft) else MLA
    for version in _releases(variant):
        read, problems = vllm_read(out, version, cls=cls)
        assert problems == [], version
        _assert_reads_as_trained(draft, read, points)


def _assert_reads_as_trained(draft, read: dict, points: list[int]) -> None:
    cfg = draft.cfg
    mla = isinstance(draft, Eagle3MLADraft)
    assert read["aux_ids"] == points  # vLLM's aux ids are the capture points (docs/EAGLE3.md §4.3)
    assert read["num_aux"] == len(points) == (cfg.num_aux_hidden_states if mla else 3)
    assert read["fc_in"] == read["num_aux"] * cfg.target_hidden_size
    assert read["draft_vocab_size"] == cfg.draft_vocab_size
    assert read["logit_scale"] == 1.0 and read["eps"] == cfg.rms_norm_eps
    assert read["norm_before_residual"] is False  # our step: residual = pre-hidden_norm state, vLLM's default
    assert read["fc_norm"] == getattr(cfg, "fc_norm", False)
    assert read["norm_output"] == getattr(cfg, "norm_output", False)
    assert read["act"] == "silu"
    if mla:
        assert (read["q_lora_rank"], read["kv_lora_rank"], read["dn"], read["dr"], read["dv"]) == (
            cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        y = _yarn(cfg)  # the rope our head trained with
        assert read["rope"] == {"rope_type": "deepseek_yarn", "base": cfg.rope_theta, **{
            k: y[k] for k in ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor",
                              "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}}
    else:
        assert read["use_aux_hidden_state"] is True and read["norm_before_fc"] is False
        assert (read["nh"], read["nkv"], read["hd"]) == (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        assert read["qkv_bias"] is False and read["mlp_bias"] is False
        assert read["rope"] == {"rope_type": "default", "base": cfg.rope_theta}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if MIN_VLLM[v] != VERSIONS[0]])
def test_each_minimum_is_tight(exports, variant):
    """The release before a variant's minimum refuses or misreads it."""
    draft, out, _ = exports[variant]
    before = max(r for r in VERSIONS if V(r) < V(MIN_VLLM[variant]))
    cls = LLAMA if isinstance(draft, Eagle3Draft) else MLA
    read, problems = vllm_read(out, before, cls=cls)
    assert problems, f"{variant} already loads in vLLM {before}"


def test_the_readers_change_where_the_sources_do(exports, tmp_path):
    """What each boundary release changes, on the exports themselves (a reader too lenient fails here)."""
    _, mla4, _ = exports["eagle3_mla-4_aux"]
    assert vllm_read(mla4, "0.21.0", cls=MLA)[1] == ["tensor fc.weight (32, 128) into model.fc.weight[None] (32, 96)"]
    _, fc_norm, _ = exports["eagle3-fc_norm"]
    assert "config.fc_norm is not read: the draft runs without it" in vllm_read(fc_norm, "0.21.0", cls=LLAMA)[1]
    assert any("fc_norm.0.weight" in p for p in vllm_read(fc_norm, "0.21.0", cls=LLAMA)[1])
    _, norm_output, _ = exports["eagle3-norm_output"]
    assert vllm_read(norm_output, "0.21.0", cls=LLAMA)[1] == ["config.norm_output is not read: the draft runs without it"]
    _, full, _ = exports["eagle3_mla-full_vocab"]
    with_d2t = tmp_path / "with_d2t"  # a full-vocab folder as exports once were: with the identity maps
    shutil.copytree(full, with_d2t)
    tensors = load_file(with_d2t / "model.safetensors")
    tensors |= {"d2t": torch.zeros(V_TARGET, dtype=torch.int64), "t2d": torch.ones(V_TARGET, dtype=torch.bool)}
    save_file(tensors, with_d2t / "model.safetensors")
    assert vllm_read(with_d2t, "0.29.0", cls=MLA)[1] == []
    assert vllm_read(with_d2t, "0.30.0", cls=MLA)[1] == [
        "tensor d2t: There is no module or parameter named 'draft_id_to_target_id'"]


def test_the_mla_model_type_is_one_vllm_does_not_rewrite(exports):
    """The MLA export's model_type kimi_k2 finds vLLM's MLA draft class; deepseek_v3 (what it once
    said) is rewritten into a DeepSeek MTP layer and refused."""
    _, out, _ = exports["eagle3_mla"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and vllm_class(config) == MLA
    with pytest.raises(Refused, match="Eagle3DeepSeekMTPModel"):
        vllm_class({**config, "model_type": "deepseek_v3"})


def test_a_full_vocab_export_has_no_vocab_maps(exports):
    """vLLM >= 0.30.0 has no d2t parameter at the full vocab and refuses the tensor: it is left out
    (vLLM before 0.30 starts d2t at zeros, SGLang reads its absence: both the identity)."""
    for variant in ("eagle3-full_vocab", "eagle3_mla-full_vocab"):
        draft, out, _ = exports[variant]
        assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors")), variant
        cls = LLAMA if isinstance(draft, Eagle3Draft) else MLA
        for version in ("0.29.0", "0.30.0"):
            assert vllm_read(out, version, cls=cls)[1] == [], (variant, version)
        back = load_exported_draft(out, draft.embed_tokens.weight)  # our loader puts the identity back
        for name, t in draft.state_dict().items():
            assert torch.equal(back.state_dict()[name], t), (variant, name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_key_vllm_would_read_against_the_draft(exports, variant):
    """Keys vLLM reads with a meaning our heads do not have are absent (their defaults are ours)."""
    _, out, points = exports[variant]
    config = json.loads((out / "config.json").read_text())
    eagle = config["eagle_config"]
    for key in ("norm_before_fc", "norm_before_residual", "num_aux_hidden_states", "logit_scale", "use_aux_norm",
                "parallel_drafting", "mask_hidden"):
        assert key not in config and key not in eagle, key
    assert eagle["use_aux_hidden_state"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == eagle["layer_ids"] == points  # vLLM's numbering
    assert len(eagle["eagle_aux_hidden_state_layer_ids"]) == len(points)  # vLLM >= 0.22 sizes fc from this length
    for option in ("fc_norm", "norm_output"):
        assert config.get(option, True) is True  # a boolean true, or absent (vLLM and SGLang test its truth)
    assert "apply_yarn_scaling" not in (config.get("rope_scaling") or {})  # vLLM would switch the rope type
    tensors = load_file(out / "model.safetensors")
    assert not any("embed_tokens" in n or "mask_hidden" in n for n in tensors)  # vLLM shares the target's


def test_readme_states_the_minimum_versions():
    """README.md's "Draft methods" table gives, per method, the minimum vLLM of MIN_VLLM."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Draft methods", 1)[1].split("\n#", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|[^\n]*", section, re.M)}
    assert set(rows) == set(METHODS)  # one row per registered method (draft/registry.py)
    cells = {method: [c.strip() for c in row.strip("|").split("|")] for method, row in rows.items()}
    assert cells["eagle3"][1:3] == ["`LlamaForCausalLMEagle3`", "0.5.23"]
    assert cells["eagle3_mla"][1:3] == ["`Eagle3DeepseekV2ForCausalLM`", "0.5.23"]
    assert cells["eagle3"][3].startswith(MIN_VLLM["eagle3"]) and MIN_VLLM["eagle3-fc_norm-norm_output"] in cells["eagle3"][3]
    assert cells["eagle3_mla"][3].startswith(MIN_VLLM["eagle3_mla"]) and MIN_VLLM["eagle3_mla-4_aux"] in cells["eagle3_mla"][3]
    assert cells["eagle3"][4].startswith("`draft=eagle3`")
    assert cells["eagle3_mla"][4].startswith("`draft=eagle3_mla`")
    # DFlash (vLLM's sources read, not run): by target family, and the B - 1 rule
    dflash = cells["dflash"][3]
    assert dflash.startswith(f"{DFLASH_MIN_VLLM['deepseek']} behind Kimi-K2.5 / DeepSeek")
    assert f"{DFLASH_MIN_VLLM['llama']} behind Llama / Qwen" in dflash and "`num_speculative_tokens` = block size - 1" in dflash
    assert cells["dflash"][4].startswith("`draft=dflash`") and "`draft=kimi_dflash`" in cells["dflash"][4]


# DFlash in vLLM (read in its release sources 0.17.1-0.34.0, not run): the method and
# `DFlashDraftModel` -> `DFlashQwen3ForCausalLM` arrive in 0.20.0 (model_executor/models/registry.py),
# which serves it behind Llama / Qwen targets; behind an MLA target (DeepSeek, Kimi) 0.20.x sets
# non-causal attention for the whole engine (attention/selector.py), no MLA backend supports it and
# start-up fails ("No valid attention backend found"); 0.21.0 sets it on the draft only. No release
# reads `dflash_config.block_size`: a step runs 1 + num_speculative_tokens queries, so vLLM must be
# given block_size - 1 (DFlashMethod.servings; tests/test_readme_commands.py checks the README's command).
DFLASH_MIN_VLLM = {"llama": "0.20.0", "deepseek": "0.21.0"}


def test_dflash_is_served_by_vllm_at_block_size_minus_one():
    from specforge_k25.draft.registry import get_method

    for block in (4, 8, 16):
        (serving,) = get_method("dflash").servings([[block - 1, 1, block]])
        assert serving.vllm_speculative_config == {"method": "dflash", "num_speculative_tokens": block - 1}
        assert serving.sglang_args["speculative_num_draft_tokens"] == block and serving.depth == block - 1
    assert V(DFLASH_MIN_VLLM["llama"]) < V(DFLASH_MIN_VLLM["deepseek"])
