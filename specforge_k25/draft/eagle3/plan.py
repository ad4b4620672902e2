"""The EAGLE-3 head's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters per
module, the bytes each TTT step keeps for backward (tests/plan/test_memory_plan.py measures them
with saved-tensor hooks), and the analytic FLOPs of a training step (torch's flop counter checks
them, tests/benchmarks/test_benchmarks.py).
"""
from __future__ import annotations

from ..model import NUM_AUX, DraftConfig


def param_counts(cfg: DraftConfig) -> dict[str, int]:
    """Parameters per module of `Eagle3Draft` (draft/model.py); `embed_tokens` is frozen."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fc_norm = {f"fc_norm ({NUM_AUX} RMSNorm)": NUM_AUX * Ht} if cfg.fc_norm else {}  # EAGLE-3.1 option, off by default
    return {
        **fc_norm,
        "fc": NUM_AUX * Ht * H,
        "q_proj": 2 * H * q_out,
        "k_proj": 2 * H * kv_out,
        "v_proj": 2 * H * kv_out,
        "o_proj": q_out * H,
        "mlp (gate, up, down)": 3 * H * I,
        "norms (4 RMSNorm)": 4 * H,
        "lm_head": cfg.draft_vocab_size * H,
        "embed_tokens (frozen)": cfg.vocab_size * H,
    }


def ttt_step_bytes(cfg: DraftConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(per-token bytes, mask bytes) TTT step k saves for backward (draft/loss.py::ttt_loss, one step).

    Per token (a = 2 under bf16 autocast, 4 in fp32; qw = nh*hd):
      bf16: 38H (norm inputs fp32 + outputs bf16, per-linear bf16 input casts) | fp32: 40H
      + a*qw q + 2a*qw*(k+1) the K/V of steps 0..k repeated to nh heads + a*qw attention output
      (= o_proj input) + 4*nh logsumexp (fp32) of the fused attention
      + 4a*I MLP (gate, silu, up, product) + 2a*hd cos/sin
      + 8*Vd (log-probs and renormalised teacher probs, both fp32) + 12 (rsqrt) + 1 (counted mask)
    Per step: the [T, (k+1)T] attention mask, as SDPA's additive float mask (a bytes), shared by
    the batch. No [B, nh, T, T] probabilities: the fused kernel recomputes them in backward.
    """
    H, I, hd, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.draft_vocab_size
    qw, nh = cfg.num_attention_heads * cfg.head_dim, cfg.num_attention_heads
    a = 2 if bf16 else 4
    per_token = ((38 if bf16 else 40) * H + a * qw + 2 * a * qw * (k + 1) + a * qw + 4 * nh
                 + 4 * a * I + 2 * a * hd + 8 * Vd + 12 + 1)
    return per_token * batch * seq_len, a * seq_len * seq_len * (k + 1)


def ttt_saved_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the TTT forward leaves saved for backward, all K steps (`ttt_step_bytes` each).

    Once: bf16: the fc input cast [T, 3Ht] (6Ht per token); fp32: fc's output (4H per token).
    checkpoint=True (train.activation_checkpointing): a step keeps only its inputs: the hidden
    [B, T, H] entering every step (a bytes; step 0's is fc's output) and the K/V [B, nkv, T, hd]
    of steps 0..K-2 (a bytes each); backward then recomputes one step at a time
    (`ttt_step_bytes`, counted by the plan as a transient of the TTT phase).
    Returns {"per_token": linear bytes, "attention_mask": quadratic bytes, "total": both}.
    """
    a = 2 if bf16 else 4
    N = batch * seq_len
    quadratic = 0
    if checkpoint:
        kv = 2 * a * cfg.num_key_value_heads * cfg.head_dim
        linear = ((6 * cfg.target_hidden_size if bf16 else 0) + ttt_length * a * cfg.hidden_size
                  + (ttt_length - 1) * kv) * N
    else:
        linear = (6 * cfg.target_hidden_size if bf16 else 4 * cfg.hidden_size) * N
        for k in range(ttt_length):
            per_token, mask = ttt_step_bytes(cfg, batch, seq_len, k, bf16)
            linear += per_token
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def ttt_backward_working_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors, in the last
    step's backward: the grads of its attention inputs (q and the K/V of all K steps at nh heads),
    of its [B, T, Vd] log-softmax (8 bytes) and of its MLP activations (3 [B, T, I])."""
    a = 2 if bf16 else 4
    N = batch * seq_len
    qw = cfg.num_attention_heads * cfg.head_dim
    return (a * qw * (1 + 2 * ttt_length) + 8 * cfg.draft_vocab_size + 3 * a * cfg.intermediate_size) * N


def draft_step_flops(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, checkpoint: bool = False) -> dict:
    """Analytic FLOPs of one draft training step (multiply-adds x 2) of N = B*T tokens, K TTT steps,
    S_k = (k+1)*T keys at step k; torch.utils.flop_counter counts the same step exactly
    (tests/benchmarks/test_benchmarks.py, its SDPA formulas included).

      forward  = N*2*(3Ht*H)                                 fc, once
               + K*N*2*(2H*(nh+2nkv)*hd + nh*hd*H + 3H*I + H*Vd)  q,k,v (input 2H), o, SwiGLU, lm_head
               + sum_k B*4*nh*T*S_k*hd                        QK^T and PV of step k's fused SDPA: the
                                                              masked kernel computes every block
      backward = fc: weight grad only (aux needs no grad) = 1 x its forward
               + linears: 2 x forward (input and weight grads)
               + attention: 2.5 x forward (QK^T recomputed, then dP, dV, dQ, dK: 5 matmuls of 2)
      recompute (checkpoint: train.activation_checkpointing) = one more forward of every TTT step
      teacher  = 2*N*V*Ht (the target's lm_head over the final hidden states; no backward)
    Element-wise work (norms, softmax, RoPE, AdamW) is not counted."""
    H, Ht, I, Vd, V = (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.draft_vocab_size,
                       cfg.vocab_size)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N, T, K = batch * seq_len, seq_len, ttt_length
    fc = 2 * N * 3 * Ht * H
    linear_per_step = 2 * N * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * Vd)
    # step k: QK^T and PV, [T, hd] x [hd, (k+1)T] and [T, (k+1)T] x [(k+1)T, hd] per batch row and head
    attention_fwd = sum(batch * 4 * nh * T * (k + 1) * T * hd for k in range(K))
    attention_bwd = sum(batch * 10 * nh * T * (k + 1) * T * hd for k in range(K))  # 5 matmuls of the same size
    fwd = fc + K * linear_per_step + attention_fwd
    bwd = fc + 2 * K * linear_per_step + attention_bwd
    recompute = K * linear_per_step + attention_fwd if checkpoint else 0
    teacher = 2 * N * V * Ht
    return {"teacher": teacher, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
            "attention_fwd": attention_fwd, "attention_bwd": attention_bwd,
            "total": teacher + fwd + bwd + recompute}
