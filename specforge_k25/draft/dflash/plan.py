"""The DFlash draft's arithmetic for the plan: parameters per module and the analytic FLOPs of one
training step. Not yet here: the bytes a step keeps for backward (`ttt_step_bytes`,
`ttt_saved_bytes`, `ttt_backward_working_bytes` of the other methods), so plan/memory.py cannot
size a DFlash run yet.

Shapes: Ht = H target hidden, K captured states, N draft layers, nh / nkv heads, hd head dim,
I MLP width, V target vocab, T positions per sequence, A anchors, Bk block size, Q = A*Bk block
tokens per sequence.
"""
from __future__ import annotations

from .model import DFlashConfig


def param_counts(cfg: DFlashConfig) -> dict[str, int]:
    """Parameters per module of `DFlashDraft`; the target's embedding and lm_head are frozen."""
    H, I, N = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        "fc": cfg.num_aux_hidden_states * cfg.target_hidden_size * H,
        "attention (q, k, v, o, q_norm, k_norm) x N": N * (2 * H * nh * hd + 2 * H * nkv * hd + 2 * hd),
        "mlp (gate, up, down) x N": N * 3 * H * I,
        "norms (hidden_norm, norm, 2 per layer)": (2 + 2 * N) * H,
        "embed_tokens (frozen)": cfg.vocab_size * H,
        "lm_head (frozen)": cfg.vocab_size * cfg.target_hidden_size,
    }


def draft_step_flops(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, checkpoint: bool = False) -> dict:
    """Analytic FLOPs (multiply-adds x 2) of one training step over `batch` sequences of `seq_len`
    tokens with min(num_anchors, seq_len) anchors each (every block position counted).

      forward  = fc over T tokens                      2T*K*Ht*H
               + context K/V, N layers                 2T*N*H*2nkv*hd
               + block tokens, N layers                2Q*N*(2H*nh*hd + 2H*nkv*hd + 3H*I)
               + attention (the masked SDPA computes every key of [T + Q])  N*2*nh*Q*(T+Q)*2hd
               + logits of the counted rows            2*Q*(Bk-1)/Bk*H*V
      backward = 2 x the linears and logits (fc: weight grad only), attention 2.5 x its forward
      recompute (checkpoint) = one more forward of the layers; the logits chunks always recompute
    `depth` is unused (the block size sets the positions). Element-wise work is not counted."""
    H, Ht, I, V, N = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    nh, nkv, hd, Bk = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    T = seq_len
    Q = min(cfg.num_anchors, T) * Bk
    fc = 2 * T * cfg.num_aux_hidden_states * Ht * H
    ctx_kv = 2 * T * N * H * 2 * nkv * hd
    block = 2 * Q * N * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I)
    attention = N * 2 * nh * Q * (T + Q) * 2 * hd
    logits = 2 * Q * (Bk - 1) // Bk * H * V
    linear = ctx_kv + block
    fwd = fc + linear + attention + logits
    bwd = fc + 2 * (linear + logits) + attention * 5 // 2
    recompute = logits + (linear + attention if checkpoint else 0)
    per = {"teacher": 0, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
           "attention_fwd": attention, "attention_bwd": attention * 5 // 2}
    out = {k: v * batch for k, v in per.items()}
    out["total"] = out["draft_fwd"] + out["draft_bwd"] + out["draft_recompute"]
    return out
