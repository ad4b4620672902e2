"""The EAGLE-3 head's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters per
module, the bytes each TTT step keeps for backward (tests/plan/test_memory_plan.py measures them
with saved-tensor hooks), and the analytic FLOPs of a training step (torch's flop counter checks
them, tests/benchmarks/test_benchmarks.py).
"""
from __future__ import annotations

from .model import NUM_AUX, DraftConfig


def param_counts(cfg: DraftConfig) -> dict[str, int]:
    """Parameters per module of `Eagle3Draft` (draft/eagle3/model.py); `embed_tokens` is frozen."""
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


def sdpa_width(dq: int, dv: int, bf16: bool) -> int:
    """Head dim W of the augmented SDPA call of TTT steps k >= 1 (draft/eagle3/ttt_attention.py): q's dq
    columns + the sink's score columns (2 under bf16 autocast: hi + lo; 1 in fp32), v's dv + the
    sink's weight column, one width for q', k', v', rounded up to a multiple of 8."""
    n = 2 if bf16 else 1
    return -(-max(dq + n, dv + 1) // 8) * 8


def step_bytes(cfg: DraftConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(bytes, mask bytes) TTT step k saves for backward (draft/eagle3/loss.py::ttt_loss, one step); no
    mask (draft/eagle3/ttt_attention.py builds none), so mask bytes are 0.

    N = B*T tokens, N1 = B*(T+1) rows of step k >= 1's augmented SDPA (a leading dummy row),
    a = 2 under bf16 autocast, 4 in fp32; W = `sdpa_width(hd, hd, bf16)`. Per token:
      bf16: 38H (norm inputs fp32 + outputs bf16, per-linear bf16 input casts) | fp32: 40H
      + 4a*I MLP (gate, silu, up, product) + 2a*hd cos/sin
      + 8*Vd (log-probs and renormalised teacher probs, both fp32) + 12 (rsqrt) + 1 (counted mask)
    Attention, step 0: one causal SDPA (GQA native): q a*nh*hd, K/V 2a*nkv*hd, its output a*nh*hd
      (o_proj's input is a view of it) and a fp32 logsumexp 4*nh. No [B, nh, T, T] probabilities:
      the fused kernel recomputes them in backward.
    Step k >= 1: the diagonal scores d and their softmax w [nh, k] (8*nh*k), their log-sum-exp
      (4*nh), the diagonal values stacked fp32 [nkv, k, hd] (4*nkv*k*hd), U = sum_j w_j v_j
      (4*nh*hd), fp32 q (4*nh*hd: under bf16 its fp32 copy; in fp32 q itself) and the fp32 diagonal
      keys (bf16: copies of all k, 4*nkv*hd*k; fp32: the step's own key 4*nkv*hd, the earlier ones
      were counted at their step), bf16 only the sink weight column's fp32 copy (4*nh), o_proj's
      input (a*nh*hd, a copy: the merged output is [B, nh, T, hd]); and per row of N1 the
      augmented SDPA's q', out' (a*nh*W each), k', v' (a*nkv*W each), logsumexp (4*nh).
    K/V at nkv heads: SDPA broadcasts them (`ttt_attention.native_gqa`: the CPU, and CUDA in bf16 at
    W <= 256, the trainer's case); fp32 on CUDA repeats them to nh heads, which this count does not follow.
    """
    H, I, hd, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.draft_vocab_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    a = 2 if bf16 else 4
    N, N1 = batch * seq_len, batch * (seq_len + 1)
    layer = (38 if bf16 else 40) * H + 4 * a * I + 2 * a * hd + 8 * Vd + 12 + 1
    if k == 0:
        return (layer + a * nh * hd + 2 * a * nkv * hd + a * nh * hd + 4 * nh) * N, 0
    W = sdpa_width(hd, hd, bf16)
    diagonal = (8 * nh * k + 4 * nh + 4 * nkv * k * hd + 4 * nh * hd  # d, w [nh, k]; lse_d; values [nkv, k, hd]; U
                + 4 * nh * hd + 4 * nkv * hd * (k if bf16 else 1)  # fp32 q; fp32 diagonal keys [nkv, hd]
                + (4 * nh if bf16 else 0) + a * nh * hd)  # sink weight column copy; o_proj's input
    augmented = 2 * a * nh * W + 2 * a * nkv * W + 4 * nh  # q', out' [nh, W]; k', v' [nkv, W]; logsumexp
    return (layer + diagonal) * N + augmented * N1, 0


def saved_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the TTT forward leaves saved for backward, all K steps (`step_bytes` each).

    Once: bf16: the fc input cast [T, 3Ht] (6Ht per token); fp32: fc's output (4H per token).
    checkpoint=True (train.activation_checkpointing): a step keeps only its inputs: the hidden
    [B, T, H] entering every step (a bytes; step 0's is fc's output) and the K/V [B, nkv, T, hd]
    of steps 0..K-2 (a bytes each); backward then recomputes one step at a time
    (`step_bytes`, counted by the plan as a transient of the TTT phase).
    Returns {"per_token": bytes linear in T, "attention_mask": 0 (no mask; the key stays for the
    plan's API, draft/dflash/plan.py has masks), "total": both}.
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
            step, mask = step_bytes(cfg, batch, seq_len, k, bf16)
            linear += step
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def backward_working_bytes(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors, in the last
    step's backward (k = K-1 >= 1; W = `sdpa_width`): the augmented SDPA's input grads dq', dk',
    dv' over N1 = B*(T+1) rows, dk'/dv' at nh heads (a GQA backward accumulates per query head
    before the sum over the group), the fp32 grads of q, of the k diagonal keys and values and of
    U (4*(2nh + 2nkv*k)*hd), of its [B, T, Vd] log-softmax (8 bytes) and of its MLP (3 [B, T, I])."""
    a, k = (2 if bf16 else 4), ttt_length - 1
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N, N1 = batch * seq_len, batch * (seq_len + 1)
    augmented = 3 * a * nh * sdpa_width(hd, hd, bf16) if k else 3 * a * nh * hd  # step 0 (K = 1): q, k, v at hd
    diagonal = 4 * (2 * nh + 2 * nkv * k) * hd
    return augmented * (N1 if k else N) + (diagonal + 8 * cfg.draft_vocab_size + 3 * a * cfg.intermediate_size) * N


def context_parallel_values(cfg: DraftConfig, size: int, depth: int) -> float:
    """Values one rank sends per position it holds in the forward of `depth` TTT steps, with the sequences split
    over `size` ranks (train/context_parallel.py, Ulysses): q, k, v all-to-all to heads and the output
    back, (size - 1)/size of each; the KV heads repeated to nh first when nkv % size. The backward
    sends as much again (the reverse exchanges)."""
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    kv = cfg.num_key_value_heads if cfg.num_key_value_heads % size == 0 else nh
    return depth * (size - 1) / size * hd * (2 * nh + 2 * kv)


def draft_step_flops(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, checkpoint: bool = False,
                     bf16: bool = True) -> dict:
    """Analytic FLOPs of one draft training step (multiply-adds x 2) of N = B*T tokens, K TTT steps;
    torch.utils.flop_counter counts the same step exactly (tests/benchmarks/test_benchmarks.py, its
    SDPA formulas included). bf16: the autocast the trainer runs under (it can widen W, below).

      forward  = N*2*(3Ht*H)                                 fc, once
               + K*N*2*(2H*(nh+2nkv)*hd + nh*hd*H + 3H*I + H*Vd)  q,k,v (input 2H), o, SwiGLU, lm_head
               + B*4*nh*T*T*hd                                step 0's causal SDPA: QK^T and PV
               + (K-1)*B*4*nh*(T+1)^2*W                       steps k >= 1: the augmented SDPA over
                                                              T+1 rows at head dim W (`sdpa_width`)
                 (counted as torch counts a fused SDPA: every block, the causal half included)
      backward = fc: weight grad only (aux needs no grad) = 1 x its forward
               + linears: 2 x forward (input and weight grads)
               + attention: 2.5 x forward (QK^T recomputed, then dP, dV, dQ, dK: 5 matmuls of 2)
      recompute (checkpoint: train.activation_checkpointing) = one more forward of every TTT step
      teacher  = 2*N*V*Ht (the target's lm_head over the final hidden states; no backward)
    Element-wise work (norms, softmax, RoPE, the k diagonal scores of step k, AdamW) is not counted."""
    H, Ht, I, Vd, V = (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.draft_vocab_size,
                       cfg.vocab_size)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N, T, K = batch * seq_len, seq_len, ttt_length
    W = sdpa_width(hd, hd, bf16)
    fc = 2 * N * 3 * Ht * H
    linear_per_step = 2 * N * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * Vd)
    # QK^T and PV per batch row and query head: [T, hd] x [hd, T] at step 0, [T+1, W] x [W, T+1] after
    attention_fwd = batch * 4 * nh * (T * T * hd + (K - 1) * (T + 1) * (T + 1) * W)
    attention_bwd = attention_fwd * 5 // 2  # 5 matmuls of the same size
    fwd = fc + K * linear_per_step + attention_fwd
    bwd = fc + 2 * K * linear_per_step + attention_bwd
    recompute = K * linear_per_step + attention_fwd if checkpoint else 0
    teacher = 2 * N * V * Ht
    return {"teacher": teacher, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
            "attention_fwd": attention_fwd, "attention_bwd": attention_bwd,
            "total": teacher + fwd + bwd + recompute}
