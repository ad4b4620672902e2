"""HF transformers implementation of `TargetEngine`: the independent reference for tests."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from .base import TargetOutput
from .sampling import Regeneration, generate_with

# Multimodal wrappers whose text backbone is a plain causal LM stored under a weight prefix.
_TEXT_BACKBONE_PREFIX = {"KimiK25ForConditionalGeneration": "language_model."}
_NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")


def load_text_model(model_path: str, dtype: torch.dtype = torch.float32):
    """The target's text causal LM in HF transformers (`.model` = decoder, `.lm_head`).

    For Kimi-K2.5 (`KimiK25ForConditionalGeneration`) this is a `DeepseekV3ForCausalLM` built
    from `text_config`, loaded from the `language_model.`-prefixed weights (the vision tower and
    projector weights are skipped). Nothing of SGLang's is used, so it stays an independent reference.
    """
    from transformers import AutoModelForCausalLM

    config = json.loads(Path(model_path, "config.json").read_text())
    architecture = (config.get("architectures") or [None])[0]
    prefix = _TEXT_BACKBONE_PREFIX.get(architecture)
    if prefix is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text = dict(config["text_config"])
    # Published Kimi copies name the text model_type `kimi_k2`; its schema is DeepSeek-V3's.
    text.pop("model_type", None)
    text_config = DeepseekV3Config(**text)
    # The vision weights are expected leftovers; transformers would print them as a load-report
    # table, so it is silenced here and the load is checked strictly instead.
    hf_logger = logging.getLogger("transformers.modeling_utils")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        model, info = DeepseekV3ForCausalLM.from_pretrained(
            model_path, config=text_config, dtype=dtype, output_loading_info=True,
            key_mapping={"^" + re.escape(prefix): ""},
        )
    finally:
        hf_logger.setLevel(level)
    missing = sorted(info["missing_keys"]) + [k[0] for k in info["mismatched_keys"]]
    foreign = sorted(k for k in info["unexpected_keys"] if not k.startswith(_NON_TEXT_PREFIXES))
    if missing or foreign:
        raise RuntimeError(f"{model_path}: text model did not load cleanly from {prefix!r} weights "
                           f"(missing/mismatched: {missing[:8]}, unexpected: {foreign[:8]})")
    return model.eval()


class HFTarget:
    max_total_tokens = None  # no KV pool: any batch fits

    def __init__(self, model_path: str, capture_points: list[int], dtype: torch.dtype = torch.float32):
        self.model = load_text_model(model_path, dtype)
        self.capture_points = list(capture_points)

    @torch.no_grad()
    def forward(self, sequences: list[torch.Tensor]) -> TargetOutput:
        aux, final = [], []
        for ids in sequences:
            out = self.model.model(ids[None], output_hidden_states=True)
            final.append(out.last_hidden_state[0])  # [T, Ht], post-norm
            aux.append(torch.cat([out.hidden_states[p][0] for p in self.capture_points], -1) if self.capture_points
                       else final[-1].new_empty((len(ids), 0)))  # [T, K*Ht]; no capture point: [T, 0]
        return TargetOutput(torch.cat(aux), torch.cat(final), [len(s) for s in sequences])

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], budgets: list[int], regen: Regeneration) -> list[list[int]]:
        """The same decode loop and sampling rule as the SGLang engine, on HF's model: each request
        alone (no padding), its full sequence recomputed each step (slow, exact: a reference)."""
        running = [p.clone() for p in prompts]

        def step(tokens, rows):
            if tokens is not None:
                for b, t in zip(rows, tokens.tolist()):
                    running[b] = torch.cat([running[b], torch.tensor([t])])
            return torch.stack([self.model(running[b][None]).logits[0, -1] for b in rows])

        return generate_with(step, prompts, budgets, regen)

    def share_batch(self, sequences: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """TP 1 only: nothing to share."""
        return sequences

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass
