"""The `draft.*` fields every method's config has: the draft layer's sizes, null = the target's.
Each method's own config (`draft/<method>/config.py`) extends `DraftSpec` with that method's
knobs; the `draft` config group selects one (`draft=dflash`), `DraftMethod.spec_class` names it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from ..fields import doc


@dataclass
class DraftSpec:
    intermediate_size: Optional[int] = doc(None, "MLP width; null = the target's", at_least=1)
    num_attention_heads: Optional[int] = doc(None, "null = the target's (text) attention heads", at_least=1)
    head_dim: Optional[int] = doc(None, "null = hidden / heads", at_least=1)
    rope_theta: float = doc(10000.0, "RoPE base of the draft (written to the export)", above=0)
    max_position_embeddings: Optional[int] = doc(None, "null = the target's", at_least=1)


KV_HEADS_HELP = "null = the target's KV heads"


def carried_over(spec: DraftSpec, spec_class: type) -> DraftSpec:
    """Another method's config in this one's place: every field both configs have keeps this
    spec's value (sizes, vocab, TTT knobs), the rest their defaults (the plan's method comparison)."""
    if type(spec) is spec_class:
        return spec
    own = {f.name for f in fields(spec_class)}
    return spec_class(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.name in own})
