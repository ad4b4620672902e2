"""Runs SGLang with EAGLE-3 speculation (CPU) and records what SGLang's own draft model
(`LlamaForCausalLMEagle3`, loaded from our export) computes on each of its first forwards:
input ids, positions, the target hidden states it was given, its normed output and its
lm_head. tests/test_eval.py recomputes the same from the export with our draft class.

Usage: python tests/sglang_draft_probe.py <target> <export_dir> <out_dir>
Run as a file: SGLang's spawned scheduler re-imports this module, so the hook below reaches it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["SPECFORGE_SGLANG_CPU"] = "1"
from specforge_k25.target import sglang_cpu_compat  # noqa: E402

sglang_cpu_compat.apply()
OUT = os.environ.get("SPECFORGE_PROBE_DIR")


def _record(module) -> None:
    import torch

    cls = module.LlamaForCausalLMEagle3
    original = cls.forward

    def forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        count = getattr(cls, "_probe_calls", 0)
        if count >= 4:
            return original(self, input_ids, positions, forward_batch, *args, **kwargs)
        cls._probe_calls = count + 1
        seen = {}
        def keep(module, args, out):  # returns None: the output is left as is
            seen["normed"] = out[0].detach().clone()

        handle = self.model.register_forward_hook(keep)
        try:
            result = original(self, input_ids, positions, forward_batch, *args, **kwargs)
        finally:
            handle.remove()
        torch.save({"mode": forward_batch.forward_mode.name, "input_ids": input_ids.clone(),
                    "positions": positions.clone(), "hidden_in": forward_batch.spec_info.hidden_states.clone(),
                    "normed": seen["normed"], "lm_head": self.lm_head.weight.detach().clone(),
                    "hot_token_id": getattr(self, "hot_token_id", None)}, Path(OUT, f"call_{count}.pt"))
        return result

    cls.forward = forward


if OUT:
    sglang_cpu_compat.patch_when_imported("sglang.srt.models.llama_eagle3", _record)

if __name__ == "__main__":
    from specforge_k25.eval.sglang_spec import _run_engine

    target, export, out = sys.argv[1:4]
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018, 411, 5356, 7018, 2, 198, 1, 4093, 198]
    engine = dict(model_path=target, device="cpu", dtype="float32", attention_backend="torch_native",
                  disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static=0.15,
                  max_total_tokens=2048, skip_server_warmup=True, log_level="error", random_seed=0,
                  speculative_algorithm="EAGLE3", speculative_draft_model_path=export, speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    gen = _run_engine(engine, [prompt], max_new_tokens=6, speculative=True)
    print("PROMPT", prompt, "OUTPUT", gen.outputs[0])
