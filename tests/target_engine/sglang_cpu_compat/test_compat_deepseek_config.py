"""Workaround 3, target_engine/sglang_cpu_compat/deepseek_config.py: DeepSeek configs the CPU path cannot run."""
from __future__ import annotations

import pytest


def test_deepseek_config_check():
    from specforge_k25.target_engine.models import tiny_deepseek_config
    from specforge_k25.target_engine.sglang_cpu_compat import check_deepseek_config

    check_deepseek_config(tiny_deepseek_config(100))
    with pytest.raises(ValueError, match="YaRN"):
        check_deepseek_config(tiny_deepseek_config(100, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    cfg = tiny_deepseek_config(100)
    cfg.moe_layer_freq = None
    with pytest.raises(ValueError, match="moe_layer_freq"):
        check_deepseek_config(cfg)
