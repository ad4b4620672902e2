"""`draft=eagle3_mla` (and `draft=kimi_mla`): the EAGLE-3 head with DeepSeek multi-latent
attention; the TTT knobs are EAGLE-3's (draft/eagle3/config.py), the latent sizes its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...fields import doc
from ..eagle3.config import TTTSpec


@dataclass
class Eagle3MLASpec(TTTSpec):
    q_lora_rank: Optional[int] = doc(None, "query latent width; null = an MLA target's (Kimi-K2.5 1536), else 12 x head dim", at_least=1)
    kv_lora_rank: Optional[int] = doc(None, "KV latent width (what a server caches per token); null = an MLA target's (Kimi-K2.5 512), else 4 x head dim", at_least=1)
    qk_nope_head_dim: Optional[int] = doc(None, "per-head query/key width without RoPE; null = an MLA target's (128), else head dim", at_least=1)
    qk_rope_head_dim: Optional[int] = doc(None, "per-head RoPE width (one shared key part); null = an MLA target's (64), else head dim / 2", at_least=1)
    v_head_dim: Optional[int] = doc(None, "per-head value width; null = an MLA target's (128), else head dim", at_least=1)
