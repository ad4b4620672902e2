"""Workaround 3: DeepSeek configs SGLang's CPU path cannot run (SGLang `SGLANG_VERSION`, CPU).

What SGLang lacks: its CPU rope path only supports YaRN, and its DeepSeek model needs
`moe_layer_freq` in the config; either violation crashes deep inside SGLang.
What it does: `check_deepseek_config` (called by specforge_k25.setup on every DeepSeek/Kimi target
that runs on CPU) turns a violation into a clear error first. Nothing to install.

Checked by `test_deepseek_config_check` in
tests/target_engine/sglang_cpu_compat/test_compat_deepseek_config.py.
"""
from __future__ import annotations

from .version import SGLANG_VERSION


def check_deepseek_config(config) -> None:
    """Reject DeepSeek/Kimi text configs the SGLang CPU path cannot run correctly."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type != "yarn":
        raise ValueError(
            f"sglang {SGLANG_VERSION} on CPU runs DeepSeek models only with YaRN rope "
            f"(rope_scaling.type=yarn, as DeepSeek-V3/Kimi configs have); got {rope_type!r}"
        )
    if getattr(config, "moe_layer_freq", None) is None:
        raise ValueError(f"sglang {SGLANG_VERSION} on CPU needs `moe_layer_freq` in the DeepSeek config (use 1)")
