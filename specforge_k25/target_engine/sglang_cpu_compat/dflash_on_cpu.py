"""Workaround 7: DFLASH speculative decoding on CPU (eval of DFlash heads; SGLang `SGLANG_VERSION`).

What SGLang does wrong on CPU, and what each patch does:
(a) srt/arg_groups/speculative_hook.py `_handle_dflash` refuses device cpu: on CPU it sees a platform
    that serves DFLASH (the rest of the function unchanged).
(b) DRAFT_ATTENTION_BACKEND_CHOICES lacks torch_native and DFLASH's draft worker falls back to
    flashinfer: torch_native joins the list (SGLang's own `add_draft_attention_backend_choices`).
(c) DFlashWorkerV2.forward_batch_generation calls `record_stream` on `seq_lens`, which a CPU tensor
    refuses: a no-op there (one CPU stream).
(d) ModelRunner._extend_forward_kwargs casts `input_embeds` to bf16, but the DFlash draft takes the
    block's embeddings as input_embeds and must stay fp32 on CPU (in bf16 it reaches a Triton
    qk-norm-rope kernel): the embeddings keep their dtype.

Checked by `test_dflash_on_cpu_needed_and_working` in
tests/target_engine/sglang_cpu_compat/test_compat_dflash_on_cpu.py
(each against SGLang's own function, the patch's `__wrapped__`); that a DFLASH engine then serves a
head correctly: tests/eval/test_eval_dflash.py.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .version import SGLANG_VERSION  # noqa: F401  (the version this workaround is checked against)
from .hooks import _run_inside, patch_when_imported


class _DFlashServingPlatform:
    """`current_platform` as `_handle_dflash` sees it on CPU: an out-of-tree platform that serves
    DFLASH with the draft backends of DRAFT_ATTENTION_BACKEND_CHOICES, torch_native by default."""

    def __init__(self, real, choices):
        self._real, self._choices = real, choices

    def __getattr__(self, name):
        return getattr(self._real, name)

    is_out_of_tree = staticmethod(lambda: True)
    supports_speculative_algorithm = staticmethod(lambda algorithm: algorithm == "DFLASH")
    get_default_speculative_draft_attention_backend = staticmethod(lambda algorithm: "torch_native")

    def supports_speculative_draft_attention_backend(self, algorithm, backend):
        return backend in self._choices


def _dflash_on_cpu(hook) -> None:  # 7a
    original = hook._handle_dflash

    @functools.wraps(original)
    def handle_dflash(server_args):
        if hook.resolving_view(server_args).device != "cpu":
            return original(server_args)
        real = hook.current_platform
        hook.current_platform = _DFlashServingPlatform(real, hook.DRAFT_ATTENTION_BACKEND_CHOICES)
        try:
            return original(server_args)
        finally:
            hook.current_platform = real

    hook._handle_dflash = handle_dflash


def _torch_native_draft_choice(choices) -> None:  # 7b
    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices(["torch_native"])


@contextlib.contextmanager
def record_stream_on_cpu():
    """Tensor.record_stream a no-op on CPU tensors (torch raises there; CPU work has one stream)."""
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.device.type != "cpu":
            return original(self, stream)

    torch.Tensor.record_stream = record_stream
    try:
        yield
    finally:
        torch.Tensor.record_stream = original


def _dflash_worker_record_stream(worker_module) -> None:  # 7c
    _run_inside(record_stream_on_cpu, worker_module.DFlashWorkerV2, "forward_batch_generation")


def _input_embeds_keep_dtype(model_runner) -> None:  # 7d
    cls = model_runner.ModelRunner
    original = cls._extend_forward_kwargs

    @functools.wraps(original)
    def extend_forward_kwargs(self, forward_batch, pp_proxy_tensors):
        kwargs = original(self, forward_batch, pp_proxy_tensors)
        embeds = forward_batch.input_embeds
        if embeds is not None and forward_batch.replace_embeds is None:
            kwargs["input_embeds"] = embeds  # SGLang's cast to bf16 undone
        return kwargs

    cls._extend_forward_kwargs = extend_forward_kwargs


def install() -> None:
    patch_when_imported("sglang.srt.arg_groups.speculative_hook", _dflash_on_cpu)
    patch_when_imported("sglang.srt.arg_groups.choices", _torch_native_draft_choice)
    patch_when_imported("sglang.srt.speculative.dflash_worker_v2", _dflash_worker_record_stream)
    patch_when_imported("sglang.srt.model_executor.model_runner", _input_embeds_keep_dtype)
