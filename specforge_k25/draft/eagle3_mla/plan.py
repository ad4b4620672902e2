"""The MLA EAGLE-3 head's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters
per module, the bytes each TTT step keeps for backward (tests/draft/test_eagle3_mla_plan.py
measures them with saved-tensor hooks), and the analytic FLOPs of a training step (torch's flop
counter checks them in the same file).

What a TTT step of `Eagle3MLADraft` keeps (model.py, MLAAttention.forward): its cache entry is the
latent c [T, r] and the roped kpe [T, dr]; K and V are expanded from the latents of steps 0..k
(kv_b_proj over (k+1)T rows) at every step, so the step's kv_b_proj costs (k+1)T rows of FLOPs
and the k diagonal keys [nh, T, dn+dr] the attention reads are new tensors at every step.

The attention is draft/eagle3/ttt_attention.py (no [T, (k+1)T] mask): step 0 one causal SDPA, q, k, v
zero-padded to one head dim W0 when dn+dr != dv (Kimi: 192 vs 128, W0 = 192), so flash kernels
take it on the CPU and the GPU; steps k >= 1 the k diagonal scores elementwise (fp32) and one
causal SDPA over T+1 rows at head dim W with a sink key. Each SDPA keeps q, k, v, out and a
logsumexp per query (no [nh, T, S] probabilities). One tensor is counted that a GPU may not keep:
o_proj's input is a copy of the attention output, whose layout follows q's on the CPU ([B, nh, T,
*], q being a cat along the head dim); a kernel writing [B, T, nh, *] would make the reshape a view
at step 0 (the plan is then a*nh*dv bytes per token high there). Not yet measured on a GPU.

Shapes: N = B*T tokens, K TTT steps, a = 2 under bf16 autocast, 4 in
fp32; H hidden, Ht target hidden, Kx captured target states, nh heads, r kv_lora_rank, rq
q_lora_rank, dn/dr/dv nope/rope/value head dims, I MLP width, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

from ..eagle3.plan import sdpa_width
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


def sdpa_widths(cfg: MLADraftConfig, bf16: bool) -> tuple[int, int]:
    """(W0, W): the head dims of the SDPA calls of draft/eagle3/ttt_attention.py. Step 0: dn+dr when it
    equals dv, else q, k, v padded with zero columns to one dim, max(dn+dr, dv) rounded up to 8.
    Steps k >= 1: the augmented call, `draft/eagle3/plan.py::sdpa_width`."""
    dq, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return (dq if dq == dv else -(-max(dq, dv) // 8) * 8), sdpa_width(dq, dv, bf16)


def step_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(bytes, mask bytes) TTT step k saves for backward (draft/eagle3/loss.py::ttt_loss, one step); no
    mask (draft/eagle3/ttt_attention.py builds none), so mask bytes are 0. (W0, W) = `sdpa_widths`;
    N1 = B*(T+1) rows of step k >= 1's augmented SDPA (a leading dummy row).

    Per token:
      the layer outside the attention, as the EAGLE-3 head's less one projection input:
        bf16: 34H (norm inputs fp32 + outputs bf16, the bf16 input casts of q_a_proj, kv_a_proj
        [2H each], gate, up, lm_head) | fp32: 40H
        + 4a*I MLP (gate, up, silu, product) + 8*Vd (log-probs, teacher probs, fp32) + 12 (3 rsqrt) + 1
      q_a_layernorm: bf16 8rq (fp32 input, bf16 output, q_b_proj's cast) | fp32 12rq; + 4 (rsqrt)
      kv_a_layernorm: bf16 6r (fp32 copy of c, bf16 output) | fp32 8r + 4dr (kv_a_proj's whole
        output, c being a slice of it, and the norm's output); + 4 (rsqrt)
      2a*dr cos/sin
      kv_b_proj's input: bf16 2r*(k+1), its casts of the latents of steps 0..k (fp32) | fp32 4r, the
        step's own latent (the earlier ones are the same tensors, counted at their step)
      + a*nh*dv o_proj's input: a copy of the attention output (see the module doc)
    Attention, step 0: q, k and the output at W0 (a*nh*W0 each), v (a view of kv_b_proj's output
      a*nh*(dn+dv) when dv = W0, else its padded copy a*nh*W0), logsumexp 4*nh.
    Step k >= 1: the diagonal scores d and their softmax w [nh, k] (8*nh*k), their log-sum-exp
      (4*nh), the k diagonal values stacked fp32 (4*nh*k*dv), U (4*nh*dv), fp32 q and the k
      diagonal keys (4*nh*(dn+dr)*(k+1): under bf16 copies, in fp32 the tensors themselves, new at
      every step as keys are expanded from the latents at every step), bf16 only the sink weight
      column's fp32 copy (4*nh); per row of N1 q', k', v', out' (4a*nh*W) and a logsumexp (4*nh).
    """
    H, I, Vd, nh = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.num_attention_heads
    r, rq, dn, dr, dv = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a, dq = (2 if bf16 else 4), dn + dr
    N, N1 = batch * seq_len, batch * (seq_len + 1)
    W0, W = sdpa_widths(cfg, bf16)
    layer = (34 if bf16 else 40) * H + 4 * a * I + 8 * Vd + 12 + 1
    q_lora = (8 if bf16 else 12) * rq + 4
    kv_lora = (6 * r if bf16 else 8 * r + 4 * dr) + 4
    outside = layer + q_lora + kv_lora + 2 * a * dr + (2 * r * (k + 1) if bf16 else 4 * r) + a * nh * dv
    if k == 0:
        v = a * nh * (dn + dv) if dv == W0 else a * nh * W0
        return (outside + 3 * a * nh * W0 + v + 4 * nh) * N, 0
    diagonal = (8 * nh * k + 4 * nh + 4 * nh * k * dv + 4 * nh * dv  # d, w [nh, k]; lse_d; values [nh, k, dv]; U
                + 4 * nh * dq * (k + 1) + (4 * nh if bf16 else 0))  # fp32 q and keys; sink weight column copy
    augmented = 4 * a * nh * W + 4 * nh  # q', k', v', out' [nh, W]; logsumexp
    return (outside + diagonal) * N + augmented * N1, 0


def saved_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the TTT forward leaves saved for backward, all K steps (`step_bytes` each).

    Once: bf16: the fc input cast [T, Kx*Ht] (2Kx*Ht per token); fp32: fc's output (4H per token).
    checkpoint=True (train.activation_checkpointing): a step keeps only its inputs: the hidden
    [B, T, H] entering every step (a bytes; step 0's is fc's output) and the cache of steps
    0..K-2: the latent c (fp32 also under autocast: the RMSNorm's fp32 weight promotes it, 4r) and
    the roped kpe (a*dr); backward recomputes one step at a time (`step_bytes`).
    Returns {"per_token": bytes linear in T, "attention_mask": 0 (no mask; the key stays for the
    plan's API, draft/dflash/plan.py has masks), "total": both}.
    """
    a, N, K = (2 if bf16 else 4), batch * seq_len, ttt_length
    once = 2 * cfg.num_aux_hidden_states * cfg.target_hidden_size if bf16 else 0
    quadratic = 0
    if checkpoint:
        cache = 4 * cfg.kv_lora_rank + a * cfg.qk_rope_head_dim
        linear = (once + K * a * cfg.hidden_size + (K - 1) * cache) * N
    else:
        linear = (once if bf16 else 4 * cfg.hidden_size) * N
        for k in range(K):
            step, mask = step_bytes(cfg, batch, seq_len, k, bf16)
            linear += step
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def backward_working_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors, in the last
    step's backward (k = K-1; (W0, W) = `sdpa_widths`): the SDPA's input grads dq', dk', dv' (over
    N1 = B*(T+1) rows at W, or N rows at W0 when K = 1), the fp32 grads of q, U and the k diagonal
    keys and values, the grads of the k+1 keys and kv_b outputs in the compute dtype and of the
    latents, of its [B, T, Vd] log-softmax (8 bytes) and of its MLP (3 [B, T, I])."""
    a, k, nh = (2 if bf16 else 4), ttt_length - 1, cfg.num_attention_heads
    dq, dv, dkv = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.qk_nope_head_dim + cfg.v_head_dim)
    N, N1 = batch * seq_len, batch * (seq_len + 1)
    W0, W = sdpa_widths(cfg, bf16)
    sdpa = 3 * a * nh * W * N1 if k else 3 * a * nh * W0 * N
    diagonal = 4 * nh * (dq + dv + k * (dq + dv))
    per_token = (diagonal + a * (nh * dq * (k + 1) + nh * dkv * (k + 1) + cfg.kv_lora_rank * (k + 1))
                 + 8 * cfg.draft_vocab_size + 3 * a * cfg.intermediate_size)
    return sdpa + per_token * N


def context_parallel_values(cfg: MLADraftConfig, size: int, depth: int) -> float:
    """Values one rank sends per position it holds in the forward of `depth` TTT steps, with the sequences split
    over `size` ranks (train/context_parallel.py): q all-to-all to heads ((size - 1)/size of nh(dn+dr)),
    the latent and rope key all-gathered (size - 1 copies of r + dr), the output back ((size - 1)/size
    of nh dv). The backward sends as much again (the gather's backward is an all-to-all of as many)."""
    nh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
    return depth * ((size - 1) / size * nh * (dn + dr + dv) + (size - 1) * (r + dr))


def draft_step_flops(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, checkpoint: bool = False,
                     bf16: bool = True) -> dict:
    """Analytic FLOPs of one draft training step (multiply-adds x 2) of N = B*T tokens, K TTT steps;
    torch.utils.flop_counter counts the same step exactly (tests/draft/test_eagle3_mla_plan.py, its
    SDPA formulas included). bf16: the autocast the trainer runs under (it can widen W, below).

      forward  = N*2*(Kx*Ht*H)                                   fc, once
               + K*N*2*(2H*rq + rq*nh*(dn+dr) + 2H*(r+dr) + nh*dv*H + 3H*I + H*Vd)
                                                                 q_a, q_b, kv_a (input 2H), o, SwiGLU, lm_head
               + sum_k (k+1)T*B*2*r*nh*(dn+dv)                   kv_b over the latents of steps 0..k
               + B*4*nh*T*T*W0                                   step 0's causal SDPA (QK^T and PV at W0)
               + (K-1)*B*4*nh*(T+1)^2*W                          steps k >= 1: the augmented SDPA over T+1
                                                                 rows at W ((W0, W) = `sdpa_widths`)
                 (counted as torch counts a fused SDPA: every block, the causal half included)
      backward = fc: weight grad only (aux needs no grad) = 1 x its forward
               + linears (kv_b included): 2 x forward (input and weight grads)
               + attention: 2.5 x forward (QK^T recomputed, then dP, dV, dQ, dK: 5 matmuls of 2;
                 q, k and v share one head dim in both calls)
      recompute (checkpoint: train.activation_checkpointing) = one more forward of every TTT step
      teacher  = 2*N*V*Ht (the target's lm_head over the final hidden states; no backward)
    Element-wise work (norms, softmax, RoPE, the k diagonal scores of step k, AdamW) is not counted."""
    H, Ht, I, Vd, V = (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.draft_vocab_size,
                       cfg.vocab_size)
    nh, r, rq, dr, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim,
                         cfg.v_head_dim)
    dq, dkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    N, T, K = batch * seq_len, seq_len, ttt_length
    W0, W = sdpa_widths(cfg, bf16)
    fc = 2 * N * cfg.num_aux_hidden_states * Ht * H
    per_step = 2 * N * (2 * H * rq + rq * nh * dq + 2 * H * (r + dr) + nh * dv * H + 3 * H * I + H * Vd)
    linear = K * per_step + sum(2 * batch * (k + 1) * T * r * nh * dkv for k in range(K))
    # QK^T and PV per batch row and head: [T, W0] x [W0, T] at step 0, [T+1, W] x [W, T+1] after
    attention_fwd = batch * 4 * nh * (T * T * W0 + (K - 1) * (T + 1) * (T + 1) * W)
    attention_bwd = attention_fwd * 5 // 2  # 5 matmuls of the same size
    fwd = fc + linear + attention_fwd
    bwd = fc + 2 * linear + attention_bwd
    recompute = linear + attention_fwd if checkpoint else 0
    teacher = 2 * N * V * Ht
    return {"teacher": teacher, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
            "attention_fwd": attention_fwd, "attention_bwd": attention_bwd,
            "total": teacher + fwd + bwd + recompute}
