"""The MLA EAGLE-3 head's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters
per module, the bytes each TTT step keeps for backward, the FLOPs of a training step."""
from __future__ import annotations

from .model import MLADraftConfig


def param_counts(cfg: MLADraftConfig) -> dict[str, int]:
    """Parameters per module of `Eagle3MLADraft` (draft/eagle3_mla/model.py); `embed_tokens` is frozen."""
    H, Ht, I, nh = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    r, rq, dn, dr, dv = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return {
        "fc": cfg.num_aux_hidden_states * Ht * H,
        "q_a_proj + q_a_layernorm": 2 * H * rq + rq,
        "q_b_proj": rq * nh * (dn + dr),
        "kv_a_proj_with_mqa + kv_a_layernorm": 2 * H * (r + dr) + r,
        "kv_b_proj": r * nh * (dn + dv),
        "o_proj": nh * dv * H,
        "mlp (gate, up, down)": 3 * H * I,
        "norms (4 RMSNorm)": 4 * H,
        "lm_head": cfg.draft_vocab_size * H,
        "embed_tokens (frozen)": cfg.vocab_size * H,
    }
