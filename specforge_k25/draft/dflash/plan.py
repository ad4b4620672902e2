"""The DFlash draft's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters per
module, the bytes the block loss keeps for backward (tests/draft/test_dflash_plan.py measures them
with saved-tensor hooks) and the analytic FLOPs of one training step (torch's flop counter checks
them in the same file).

A "step" (`ttt_step_bytes`) is one draft layer: what the plan's TTT items count per step is what
one layer keeps, and with train.activation_checkpointing (one checkpoint per layer) the step that
backward recomputes at a time. `depth` / `ttt_length` arguments are not used: the block size and
the anchors set the positions.

Shapes the plan assumes per sequence of T tokens (an upper bound, every position supervised):
A = min(num_anchors, T - 2) anchors (anchor candidates are 1..T-2), Q = A*Bk block tokens,
P = A*(Bk-1) counted rows (blocks near the end count fewer). Ht = H target hidden, K captured
states, N draft layers, nh / nkv heads, hd head dim, I MLP width, V target vocab, a = 2 under bf16
autocast, 4 in fp32.

What the loss keeps (draft/dflash/model.py, loss.py), per layer:
  block tokens: input_layernorm and post_attention_layernorm (fp32 input, fp32 normalized, rsqrt;
  the first layer's input needs no grad: no input, no rsqrt), what their outputs feed (fp32: the
  outputs themselves; bf16: the casts of the q/k/v and gate/up inputs), q_norm / k_norm (an fp32
  input, normalized in a, rsqrt per head), the roped q, the attention output (o_proj's input is a
  view of it) and its logsumexp, the MLP's 4 [Q, I];
  every key (T + Q): K and V expanded to nh heads (the repeat_interleave before SDPA), in a;
  context tokens: k_norm on the context keys, and in bf16 the casts of the context for k_proj and
  v_proj; the mask: SDPA converts the boolean [Q, T+Q] mask to an additive one in a, per layer.
Once: the fc input cast (bf16), hidden_norm's input, normalized and rsqrt, the context itself (fp32:
the layers' k/v input), RoPE cos/sin of context and block (fp32), the final norm, and for the
logits the counted hidden rows [P, H] fp32 (each logits chunk is recomputed in backward), their
labels, indices and CE.
With activation checkpointing a layer keeps only its inputs: the hidden entering it, and shared by
all layers the context, the RoPE tables and the boolean mask.

On a GPU (not yet measured there): with a boolean mask SDPA runs the memory-efficient kernel (or
cuDNN), which also keeps q, K, V, the output, a logsumexp (padded to 32 queries) and the additive
mask (its last dim padded to a multiple of 16); the plan counts the CPU kernel's exact tensors.
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


def anchors_per_sequence(cfg: DFlashConfig, seq_len: int) -> int:
    """A: the blocks the plan counts per sequence (all of num_anchors, unless the sequence has fewer
    candidates)."""
    return max(1, min(cfg.num_anchors, seq_len - 2))


def _tokens(cfg: DFlashConfig, seq_len: int) -> tuple[int, int, int]:
    """(T context tokens, Q block tokens, P counted rows) of one sequence."""
    A = anchors_per_sequence(cfg, seq_len)
    return seq_len, A * cfg.block_size, A * (cfg.block_size - 1)


def ttt_step_bytes(cfg: DFlashConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(bytes, mask bytes) draft layer k keeps for backward (k = 0: the first layer, whose input
    needs no grad; any other k: a later layer).

    Per block token: 2 norms x (8H + 4); their outputs as read: fp32 8H | bf16 10H (5 casts);
      q_norm + k_norm (4 + a)(nh + nkv)hd + 4(nh + nkv); roped q, attention output a*nh*hd each,
      logsumexp 4nh; MLP 4a*I; its own K, V expanded 2a*nh*hd. First layer: 4H + 4 less.
    Per context token: bf16 4H (the context cast for k_proj and v_proj; fp32 reads the context
      itself, counted once); k_norm (4 + a)nkv*hd + 4nkv; K, V expanded 2a*nh*hd.
    Mask: the additive [Q, T+Q] mask in a per sequence."""
    H, I, nh, nkv, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim)
    a = 2 if bf16 else 4
    T, Q, _ = _tokens(cfg, seq_len)
    kv = 2 * a * nh * hd
    block = (2 * (8 * H + 4) + (10 * H if bf16 else 8 * H) + (4 + a) * (nh + nkv) * hd + 4 * (nh + nkv)
             + 2 * a * nh * hd + 4 * nh + 4 * a * I + kv)
    if k == 0:
        block -= 4 * H + 4
    context = (4 * H if bf16 else 0) + (4 + a) * nkv * hd + 4 * nkv + kv
    return batch * (Q * block + T * context), batch * a * Q * (T + Q)


def ttt_saved_bytes(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, bf16: bool = False,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the block loss's forward leaves for backward: the N layers (`ttt_step_bytes`) and once

      per context token: bf16 the fc input cast 2K*Ht; hidden_norm 4H + aH + 4; fp32 the context
        4H (the layers' input); RoPE cos/sin 8hd
      per block token: RoPE cos/sin 8hd; the final norm 8H + 4
      per counted row: the hidden row 4H, label 8, CE index 8, row indices 16, CE 4;
      per batch: the position weights and normalizer, 8(Bk-1).
    checkpoint=True (train.activation_checkpointing, per layer): instead of the layers, each one's
    input hidden (4H per block token and layer) and, shared, the context 4H per context token and
    the boolean mask [Q, T+Q] (1 byte). `depth` is not used.
    Returns {"per_token": linear bytes, "attention_mask": quadratic bytes, "total": both}."""
    H, N, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    a = 2 if bf16 else 4
    T, Q, P = _tokens(cfg, seq_len)
    context = (2 * cfg.num_aux_hidden_states * cfg.target_hidden_size if bf16 else 0) + 4 * H + a * H + 4 + 8 * hd
    block = 8 * hd + 8 * H + 4
    linear = batch * (T * context + Q * block + P * (4 * H + 36)) + 8 * (cfg.block_size - 1)
    if checkpoint:
        linear += batch * (T * 4 * H + Q * N * 4 * H)
        quadratic = batch * Q * (T + Q)
    else:
        linear += batch * T * (0 if bf16 else 4 * H)
        quadratic = 0
        for k in range(N):
            step, mask = ttt_step_bytes(cfg, batch, seq_len, k, bf16)
            linear += step
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def ttt_backward_working_bytes(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, bf16: bool = False) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors at the peak of
    backward: one logits chunk recomputed ([c, V] logits in a, their fp32 copy, log-softmax, and
    the grads of both: (2a + 12) bytes per element, c = min(logits_chunk, counted rows)), the grad
    of the counted hidden rows, and the last layer's grads (expanded K/V of every key, q, its MLP's
    3 [Q, I], the context's fp32 grad)."""
    H, I, V, nh, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_attention_heads,
                       cfg.head_dim)
    a = 2 if bf16 else 4
    T, Q, P = _tokens(cfg, seq_len)
    chunk = min(cfg.logits_chunk, batch * P)
    layer = (T + Q) * 2 * a * nh * hd + Q * (a * nh * hd + 3 * a * I + 4 * H) + T * 4 * H
    return chunk * V * (2 * a + 12) + batch * (P * 4 * H + layer)


def draft_step_flops(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, checkpoint: bool = False) -> dict:
    """Analytic FLOPs (multiply-adds x 2) of one training step over `batch` sequences of `seq_len`
    tokens, A anchors each (`anchors_per_sequence`; Q block tokens, P counted rows); torch's flop
    counter counts the same step exactly (tests/draft/test_dflash_plan.py).

      forward  = fc over T tokens                      2T*K*Ht*H
               + context K/V, N layers                 2T*N*H*2nkv*hd
               + block tokens, N layers                2Q*N*(2H*nh*hd + 2H*nkv*hd + 3H*I)
               + attention (the masked SDPA computes every key of T + Q)   N*4*nh*Q*(T+Q)*hd
               + logits of the counted rows            2P*H*V
      backward = fc: weight grad only (the aux states need none) = 1 x its forward
               + the layers' linears: 2 x forward (input and weight grads)
               + attention: 2.5 x its forward (QK^T recomputed, dV, dP, dQ, dK)
               + logits: the hidden's grad only (the lm_head is frozen) = 1 x forward
      recompute = the logits (each chunk is recomputed in backward), and with checkpointing
                  (train.activation_checkpointing) one more forward of the layers but their last
                  matmul (down_proj: torch's checkpoint stops once every saved tensor is back)
    No teacher. `depth` is unused. Element-wise work (norms, softmax, RoPE, AdamW) is not counted."""
    H, Ht, I, V, N = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T, Q, P = _tokens(cfg, seq_len)
    fc = 2 * T * cfg.num_aux_hidden_states * Ht * H
    linear = 2 * T * N * H * 2 * nkv * hd + 2 * Q * N * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I)
    attention = N * 4 * nh * Q * (T + Q) * hd
    logits = 2 * P * H * V
    fwd = fc + linear + attention + logits
    bwd = fc + 2 * linear + attention * 5 // 2 + logits
    recompute = logits + (linear + attention - 2 * Q * N * H * I if checkpoint else 0)
    per = {"teacher": 0, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
           "attention_fwd": attention, "attention_bwd": attention * 5 // 2}
    out = {k: v * batch for k, v in per.items()}
    out["total"] = out["draft_fwd"] + out["draft_bwd"] + out["draft_recompute"]
    return out
