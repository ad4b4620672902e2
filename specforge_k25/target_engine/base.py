"""The interface every target implementation satisfies (SGLang engine, HF reference)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


# SGLang's mem_fraction_static for an engine on CPU. SGLang sizes the KV pool from free memory
# measured before and after the weight load (KVCacheConfigurator._profile_available_bytes) and
# fails when more than this share of it vanished meanwhile; on CPU that is system memory, which
# every other process (a second engine loading, a trainer, a parallel test) draws on too, and
# 0.15 failed under two test workers. The pool stays capped by max_total_tokens, so a large value
# costs nothing on CPU; on a GPU the run passes hw.mem_fraction_static, derived by the plan.
CPU_MEM_FRACTION_STATIC = 0.6

@dataclass
class TargetOutput:
    """Hidden states of a batch of sequences, packed along tokens (no padding).

    aux_hidden:   [sum(lengths), K*Ht]  residual stream at the K capture points, concatenated in order
    final_hidden: [sum(lengths), Ht]    after the final norm (the input of lm_head)
    """

    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor
    lengths: list[int]


@dataclass
class TargetInfo:
    """Static facts about a target the trainer needs (no weights)."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None


class TargetEngine(Protocol):
    """One TP rank of a frozen target, as the target process (stream/target_stream.py) drives it."""

    max_total_tokens: int | None  # tokens the engine's KV pool holds (None: unbounded)

    def share_batch(self, sequences: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """TP > 1: every rank gets TP rank 0's batch (None = the plan is done); TP 1: identity."""
        ...

    def forward(self, sequences: list[torch.Tensor]) -> TargetOutput:
        """sequences: list of [T_i] int64 token ids -> packed hidden states."""
        ...

    def generate(self, prompts: list[torch.Tensor], budgets: list[int], regen) -> list[list[int]]:
        """Answers (new token ids) to `prompts`, at most budgets[i] each (target_engine/sampling.py rules)."""
        ...

    def warmup(self) -> None:
        """Run whatever one-off compilation the engine needs before the first real batch."""
        ...

    def close(self) -> None: ...
