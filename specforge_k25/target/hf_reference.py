"""HF transformers implementation of `TargetEngine`: the independent reference for tests."""
from __future__ import annotations

import torch

from .base import TargetOutput


class HFTarget:
    def __init__(self, model_path: str, capture_points: list[int], dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.capture_points = list(capture_points)

    @torch.no_grad()
    def forward(self, sequences: list[torch.Tensor]) -> TargetOutput:
        aux, final = [], []
        for ids in sequences:
            out = self.model.model(ids[None], output_hidden_states=True)
            aux.append(torch.cat([out.hidden_states[p][0] for p in self.capture_points], -1))  # [T, 3Ht]
            final.append(out.last_hidden_state[0])  # [T, Ht], post-norm
        return TargetOutput(torch.cat(aux), torch.cat(final), [len(s) for s in sequences])

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass
