"""Workaround 4 (draft backends): torch_native draft-decode backends for chain drafts (SGLang
`SGLANG_VERSION`, CPU).

What SGLang lacks: its `DraftBackendFactory` knows no `torch_native` backend, so EAGLE-3 decoding
with `attention_backend="torch_native"` (the one CPU backend) fails when the draft worker starts.
What it does: the factory builds one torch_native backend per draft decode step (a step's query
also sees the draft tokens of the steps before it) and a torch_native draft-extend backend, for
chain drafts (topk=1) only.

Checked by `test_spec_patches_needed_and_working` in
tests/target_engine/sglang_cpu_compat/test_compat_spec_patches.py
(part a: the factory, without and with the patch; target_verify.py is part b).
"""
from __future__ import annotations

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import patch_when_imported


def _patch_draft_backends(draft_utils) -> None:
    """Let `DraftBackendFactory` build torch_native draft backends (chain drafts, topk=1)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DraftStepBackend(TorchNativeAttnBackend):
        """Draft decode step `step`: the query also sees the draft tokens of steps 0..step."""

        def __init__(self, model_runner, step: int):
            super().__init__(model_runner)
            self.step = step

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            verified = forward_batch.seq_lens
            forward_batch.seq_lens = verified + self.step + 1
            try:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens = verified

    class ChainDraftBackends:
        """One backend per draft decode step, the container shape EAGLE workers expect."""

        def __init__(self, model_runner, topk: int, num_steps: int):
            if topk != 1:
                raise NotImplementedError("torch_native speculative decoding on CPU supports chain drafts "
                                          "only (speculative_eagle_topk=1)")
            self.attn_backends = [DraftStepBackend(model_runner, i) for i in range(num_steps - 1)]
            for b in [self, *self.attn_backends]:
                b.prefill_attention_backend_str = b.decode_attention_backend_str = "torch_native"

        def init_forward_metadata(self, forward_batch):
            for b in self.attn_backends:
                b.init_forward_metadata(forward_batch)

    factory = draft_utils.DraftBackendFactory
    original_decode, original_extend = factory.create_decode_backend, factory.create_draft_extend_backend

    def uses_torch_native(self, decode: bool) -> bool:  # the choice SGLang's `_create_backend` makes
        return (self.draft_attn_backend or draft_utils.attention_backends()[1 if decode else 0]) == "torch_native"

    def create_decode_backend(self):
        if self.speculative_num_steps > 1 and uses_torch_native(self, decode=True):
            return ChainDraftBackends(self.draft_model_runner, self.topk, self.speculative_num_steps)
        return original_decode(self)

    def create_draft_extend_backend(self):
        if uses_torch_native(self, decode=False):
            backend = TorchNativeAttnBackend(self.draft_model_runner)
            backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
            return backend
        return original_extend(self)

    factory.create_decode_backend = create_decode_backend
    factory.create_draft_extend_backend = create_draft_extend_backend


def install() -> None:
    patch_when_imported("sglang.srt.speculative.draft_utils", _patch_draft_backends)
