"""`draft=eagle3` (and `draft=small`, `draft=kimi`): the EAGLE-3 head with Llama attention and
its TTT objective. `TTTSpec` holds what both EAGLE-3 heads share (draft vocabulary, the TTT unroll
and its step weights); eagle3_mla extends it with its latent sizes. The defaults are the public
recipe for DeepSeek-V3 / Kimi-class targets (docs/EAGLE3.md §3.8); `conf/draft/small.yaml` is the
CPU embedded default's choice."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...fields import doc
from ..spec import KV_HEADS_HELP, DraftSpec


@dataclass
class TTTSpec(DraftSpec):
    vocab_size: int = doc(32000, "draft vocabulary size Vd (most frequent supervised target tokens)", at_least=1)
    ttt_length: int = doc(7, "TTT unroll steps K: the draft steps trained per token (the serving chain's length)", at_least=1)
    loss_decay: float = doc(0.8, "weight of TTT step k is decay^k", above=0)
    head_from_target: bool = doc(False, "start the draft lm_head from the target's lm_head rows of the draft "
                                        "vocabulary (d2t) instead of a random init (docs/PERFORMANCE.md §0.2)")


@dataclass
class Eagle3Spec(TTTSpec):
    num_key_value_heads: Optional[int] = doc(None, KV_HEADS_HELP, at_least=1)
    fc_norm: bool = doc(False, "EAGLE-3.1: one RMSNorm per captured target state before fc (export: fc_norm, fc_norm.{0,1,2}.weight)")
    norm_output: bool = doc(False, "EAGLE-3.1: each draft step hands the next its final-normed state instead of the pre-norm one (export: norm_output)")
