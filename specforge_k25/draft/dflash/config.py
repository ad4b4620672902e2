"""`draft=dflash` (and `draft=kimi_dflash`): block drafting's knobs, the one home of their
defaults (the model config, draft/dflash/model.py, takes them from here)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...fields import doc
from ..spec import KV_HEADS_HELP, DraftSpec


def default_gamma(block_size: int) -> float:
    """The position-weight rule: gamma 7 for blocks >= 16, 5 for >= 10, else 4."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


@dataclass
class DFlashSpec(DraftSpec):
    num_key_value_heads: Optional[int] = doc(None, KV_HEADS_HELP, at_least=1)
    block_size: int = doc(8, "tokens per drafted block (the last accepted token + block_size-1 drafts; SGLang's speculative_num_draft_tokens, vLLM's num_speculative_tokens + 1); the loss counts positions 1..block_size-1", at_least=2)
    num_layers: Optional[int] = doc(None, "draft decoder layers; null = one per capture point (K = len(target.aux_layers))", at_least=1)
    num_anchors: int = doc(512, "training blocks per sequence, anchored at random supervised positions drawn per batch (fewer when a sequence has fewer)", at_least=1)
    loss_gamma: Optional[float] = doc(None, "block position j's CE weighs exp(-(j-1)/gamma); null = 7 for blocks >= 16, 5 for >= 10, else 4", above=0)
    loss_weights: Optional[list] = doc(None, "weight of block position j's CE for j = 1..block_size-1 (block_size-1 numbers > 0, e.g. [4,1,1,1,1,1,1] to weigh the first drafted token, which sets most of a young head's acceptance, 4x); null = the loss_gamma rule")
    distill: float = doc(0.0, "share of each position's loss that is the soft CE against the target's distribution at that position (its lm_head on the target's final state, the full vocab), the rest the CE against the sequence's token: 0 = hard labels only, 1 = distillation only (the target's whole distribution, not only its greedy choice)", at_least=0)
    mask_token_id: Optional[int] = doc(None, "token id of the block's MASK slots, < the target vocab and absent from real input (a run whose data holds it is refused); null = the tokenizer's highest-id special token the data never holds (not bos/eos/pad/end of turn), else vocab - 1", at_least=0)
    logits_chunk: int = doc(2048, "block positions per chunk of [chunk, V] logits in the loss (each chunk recomputed in backward)", at_least=1)
    attention_tile_rows: int = doc(512, "block queries per tile of the exact block attention (whole blocks; bounds its [rows, keys] fp32 scores per head)", at_least=1)
    attention_tile_keys: int = doc(1024, "context keys per chunk of the block attention's tile", at_least=1)
