"""Workaround 6: the MLA draft's embedding hand-over on CPU (SGLang `SGLANG_VERSION`).

What SGLang does wrong on CPU: the MLA draft (`Eagle3DeepseekV2ForCausalLM`,
srt/models/kimi_k25_eagle3.py) ends `set_embed` and `set_embed_and_head`, through which the EAGLE
worker hands the draft the target's embedding, with torch.cuda.empty_cache();
torch.cuda.synchronize(), and the second raises on a CPU build of torch.
What it does: both run with those two calls as no-ops (`cuda_sync_on_cpu`); SGLang's own method
stays reachable as `__wrapped__`.

Checked by `test_mla_draft_set_embed_needed_and_working` in
tests/target_engine/sglang_cpu_compat/test_compat_mla_draft_sync.py.
"""
from __future__ import annotations

import contextlib

import torch

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import _run_inside, patch_when_imported

MLA_DRAFT_MODULE = "sglang.srt.models.kimi_k25_eagle3"


@contextlib.contextmanager
def cuda_sync_on_cpu():
    """torch.cuda.synchronize / empty_cache as no-ops where torch has no CUDA (a CPU build raises)."""
    saved = torch.cuda.synchronize, torch.cuda.empty_cache
    if not torch.cuda.is_available():
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.empty_cache = saved


def _mla_draft_without_cuda_sync(module) -> None:
    _run_inside(cuda_sync_on_cpu, module.Eagle3DeepseekV2ForCausalLM, "set_embed", "set_embed_and_head")


def install() -> None:
    patch_when_imported(MLA_DRAFT_MODULE, _mla_draft_without_cuda_sync)
