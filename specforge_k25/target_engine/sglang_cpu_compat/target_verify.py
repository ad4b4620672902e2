"""Workaround 4 (target verify): TARGET_VERIFY batches through torch_native (SGLang `SGLANG_VERSION`,
CPU).

What SGLang lacks: TARGET_VERIFY batches carry no `extend_*` lengths, which the extend path of
torch_native attention needs, so the target cannot verify a draft on CPU.
What it does: for TARGET_VERIFY, `TorchNativeAttnBackend.forward_extend` runs as an extend of each
request's verified prefix by its draft_token_num chain tokens (the causal mask is the chain mask),
chain drafts (topk=1) only, with the batch's lengths restored afterwards.

Checked by `test_spec_patches_needed_and_working` in
tests/target_engine/sglang_cpu_compat/test_compat_spec_patches.py
(part b: against SDPA with the chain mask, without and with the patch; draft_backends.py is part a).
"""
from __future__ import annotations

import torch

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import patch_when_imported


def _patch_target_verify(torch_native_backend) -> None:
    """TARGET_VERIFY through torch_native's extend path: each request extends its verified
    prefix by the draft_token_num chain tokens, for which the causal mask is the chain mask."""
    backend = torch_native_backend.TorchNativeAttnBackend
    original_extend = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        spec = forward_batch.spec_info
        if getattr(spec, "topk", 1) != 1:
            raise NotImplementedError("torch_native target verify on CPU supports chain drafts only (topk=1)")
        saved = forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
        verified = forward_batch.seq_lens
        forward_batch.extend_prefix_lens = verified
        forward_batch.extend_seq_lens = torch.full_like(verified, spec.draft_token_num)
        forward_batch.seq_lens = verified + spec.draft_token_num
        try:
            return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        finally:
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved

    backend.forward_extend = forward_extend


def install() -> None:
    patch_when_imported("sglang.srt.layers.attention.torch_native_backend", _patch_target_verify)
