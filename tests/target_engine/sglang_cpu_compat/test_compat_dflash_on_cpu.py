"""Workaround 7, target_engine/sglang_cpu_compat/dflash_on_cpu.py: DFLASH speculative decoding on CPU."""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
from compat_subprocess import PY  # this folder is on sys.path (pytest's default prepend import mode)


_DFLASH = """
    import ast, inspect, sys, types, torch
    from specforge_k25.target_engine import sglang_cpu_compat as compat
    from specforge_k25.target_engine.sglang_cpu_compat.dflash_on_cpu import record_stream_on_cpu
    compat.apply()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.arg_groups import choices, speculative_hook as hook
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    def resolve():  # 7a, 7b: the engine's argument resolution of DFLASH on cpu
        args = ServerArgs(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                          disable_cuda_graph=True, speculative_algorithm="DFLASH",
                          speculative_draft_model_path=sys.argv[2], speculative_num_draft_tokens=4)
        try:
            args.resolve_once()
        except ValueError as e:
            return "error " + str(e).splitlines()[0]
        view = resolved_view(args)
        return f"ok {view.speculative_draft_attention_backend} {view.speculative_num_draft_tokens} {view.device}"

    patched, hook._handle_dflash = hook._handle_dflash, hook._handle_dflash.__wrapped__
    print("RESOLVE_SGLANG", resolve())
    hook._handle_dflash = patched
    print("RESOLVE_PATCHED", resolve())
    shipped = next(node.value for node in ast.walk(ast.parse(inspect.getsource(choices)))
                   if isinstance(node, ast.Assign) and node.targets[0].id == "DRAFT_ATTENTION_BACKEND_CHOICES")
    print("CHOICES", "torch_native" in ast.literal_eval(shipped), "torch_native" in choices.DRAFT_ATTENTION_BACKEND_CHOICES)

    cpu_stream = torch.get_device_module("cpu").current_stream()  # 7c
    try:
        torch.zeros(2).record_stream(cpu_stream)
        print("RECORD_STREAM ok")
    except RuntimeError as e:
        print("RECORD_STREAM error", e)
    original = torch.Tensor.record_stream
    with record_stream_on_cpu():
        torch.zeros(2).record_stream(cpu_stream)
    source = inspect.getsource(DFlashWorkerV2.forward_batch_generation.__wrapped__)
    print("RECORD_STREAM_PATCHED", "batch.seq_lens.record_stream(" in source, torch.Tensor.record_stream is original)

    runner = types.SimpleNamespace(_pp_kwargs=lambda proxy: {}, is_generation=True,  # 7d
                                   model=types.SimpleNamespace(get_input_embeddings=lambda: None))
    embeds = torch.randn(3, 4)
    for kind, method in (("SGLANG", ModelRunner._extend_forward_kwargs.__wrapped__),
                         ("PATCHED", ModelRunner._extend_forward_kwargs)):
        batch = types.SimpleNamespace(input_embeds=embeds, replace_embeds=None, replace_positions=None)
        print("EMBEDS_" + kind, method(runner, batch, None)["input_embeds"] is embeds,
              method(runner, batch, None)["input_embeds"].dtype)
"""


@pytest.mark.slow
def test_dflash_on_cpu_needed_and_working(smollm2_path, tmp_path):
    """Workaround 7 against SGLang's own functions (each patch's `__wrapped__`, the shipped choices
    list): needed, SGLang refuses DFLASH on cpu, has no torch_native draft backend, record_stream
    raises on a CPU tensor, input_embeds become bf16; works, DFLASH resolves on cpu with a
    torch_native draft block of 4 and the fp32 embeddings pass as they are. That a DFLASH engine
    then serves a head correctly: tests/eval/test_eval_dflash.py."""
    import torch

    from specforge_k25.draft.dflash.method import DFlashMethod
    from specforge_k25.draft.dflash.model import DFlashConfig, DFlashDraft
    from specforge_k25.draft.export_folder import publish_folder

    method = DFlashMethod()
    draft = DFlashDraft(DFlashConfig(hidden_size=576, intermediate_size=8, num_hidden_layers=1, num_attention_heads=9,
                                     num_key_value_heads=3, head_dim=64, vocab_size=49152, target_hidden_size=576,
                                     num_aux_hidden_states=1, block_size=4, mask_token_id=49151))
    config = method.serving_config(draft.cfg, sglang_layer_ids=[], vllm_layer_ids=[2], bos_token_id=1, eos_token_id=2,
                                   dtype="float32")
    export = publish_folder(tmp_path / "dflash", method.serving_tensors(draft, torch.float32), config,
                            method.validate_export)
    out = subprocess.run([PY, "-c", textwrap.dedent(_DFLASH), smollm2_path, str(export)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["RESOLVE_SGLANG"] == "error DFLASH speculative decoding is not supported by CpuSRTPlatform on device 'cpu'.", out.stdout
    assert lines["RESOLVE_PATCHED"] == "ok torch_native 4 cpu", out.stdout
    assert lines["CHOICES"] == "False True", out.stdout
    assert lines["RECORD_STREAM"].startswith("error"), out.stdout
    assert lines["RECORD_STREAM_PATCHED"] == "True True", out.stdout
    assert lines["EMBEDS_SGLANG"] == "False torch.bfloat16" and lines["EMBEDS_PATCHED"] == "True torch.float32", out.stdout
