"""Workaround 2: DeepSeek MLA prefill on torch_native (SGLang `SGLANG_VERSION`, CPU).

What SGLang does wrong: it registers no DeepSeek attention handler for `torch_native`, so prefill
falls back to the MHA path, whose k/v torch_native ignores (it reads the latent cache): DeepSeek /
Kimi hidden states come out silently wrong, with no error.
What it does: registers torch_native -> MLA in `AttentionBackendRegistry` as the handler module
loads (exact in fp32 against HF).

Checked by tests/target_engine/sglang_cpu_compat/test_compat_mla_torch_native.py:
`test_sglang_still_lacks_torch_native_mla_handler` fails when SGLang registers a handler of its own,
`test_mla_fix_needed_and_working` compares an engine with HF, with and without the fix.
"""
from __future__ import annotations

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import patch_when_imported

_MLA_HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"


def register_mla_for_torch_native(handler_module) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    handler_module.AttentionBackendRegistry.register("torch_native", lambda attn, batch: AttnForwardMethod.MLA)


def install() -> None:
    patch_when_imported(_MLA_HANDLER_MODULE, register_mla_for_torch_native)
