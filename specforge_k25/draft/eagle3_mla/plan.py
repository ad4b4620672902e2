"""The MLA EAGLE-3 head's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters
per module, the bytes each TTT step keeps for backward (tests/draft/test_eagle3_mla_plan.py
measures them with saved-tensor hooks), and the analytic FLOPs of a training step (torch's flop
counter checks them in the same file).

What a TTT step of `Eagle3MLADraft` keeps (model.py, MLAAttention.forward): its cache entry is the
latent c [T, r] and the roped kpe [T, dr]; K and V are expanded from the latents of steps 0..k
(kv_b_proj over (k+1)T rows) at every step, so the expanded keys [nh, (k+1)T, dn+dr] and the
kv_b output [(k+1)T, nh(dn+dv)] (the values are a view of it) are saved per step, and the step's
kv_b_proj costs (k+1)T rows of FLOPs.

The attention is counted as a fused kernel (q, K, V, out and a logsumexp per query saved; no
[nh, T, S] probabilities). On a GPU, with the TTT mask and dv != dn+dr (Kimi: 128 vs 192), flash
attention is not eligible but torch's memory-efficient kernel is (it requires equal q/k head dims
only; cuDNN, where torch prefers it, is fused too). torch's CPU kernel needs all three equal, so
the CPU tests use dv = dn+dr; with dv != dn+dr the CPU falls back to the math path, which keeps
the probabilities. One tensor is counted that a GPU may not keep: SDPA's output follows q's
layout on the CPU ([B, nh, T, dv], q being a cat along the head dim), so o_proj's input is a copy
of it; the memory-efficient kernel writes [B, T, nh, dv] and the reshape is a view (the plan is
then a*nh*dv bytes per token per step high there). Not yet measured on a GPU.

Shapes: N = B*T tokens, K TTT steps, S_k = (k+1)T keys at step k, a = 2 under bf16 autocast, 4 in
fp32; H hidden, Ht target hidden, Kx captured target states, nh heads, r kv_lora_rank, rq
q_lora_rank, dn/dr/dv nope/rope/value head dims, I MLP width, V target vocab, Vd draft vocab.
"""
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


def ttt_step_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(bytes, mask bytes) TTT step k saves for backward (draft/loss.py::ttt_loss, one step).

    Per token:
      the layer outside the attention, as the EAGLE-3 head's less one projection input:
        bf16: 34H (norm inputs fp32 + outputs bf16, the bf16 input casts of q_a_proj, kv_a_proj
        [2H each], gate, up, lm_head) | fp32: 40H
        + 4a*I MLP (gate, up, silu, product) + 8*Vd (log-probs, teacher probs, fp32) + 12 (3 rsqrt) + 1
      q_a_layernorm: bf16 8rq (fp32 input, bf16 output, q_b_proj's cast) | fp32 12rq; + 4 (rsqrt)
      kv_a_layernorm: bf16 6r (fp32 copy of c, bf16 output) | fp32 8r + 4dr (kv_a_proj's whole
        output, c being a slice of it, and the norm's output); + 4 (rsqrt)
      2a*dr cos/sin
      + a*r*(k+1) kv_b_proj's input: the latents of steps 0..k (bf16: its cast; the latents are fp32)
      + a*nh*(dn+dr) q + a*nh*(dn+dr)*(k+1) the keys [nope | shared rope] of steps 0..k
      + a*nh*(dn+dv)*(k+1) kv_b_proj's output (the values are a view of it)
      + 4*nh logsumexp (fp32) + 2a*nh*dv the attention output and o_proj's input (see the module doc)
    Per step: the [T, (k+1)T] additive mask (a bytes), shared by the batch.
    """
    H, I, Vd, nh = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.num_attention_heads
    r, rq, dn, dr, dv = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a, S = (2 if bf16 else 4), k + 1
    layer = (34 if bf16 else 40) * H + 4 * a * I + 8 * Vd + 12 + 1
    q_lora = (8 if bf16 else 12) * rq + 4
    kv_lora = (6 * r if bf16 else 8 * r + 4 * dr) + 4
    attention = (2 * a * dr + a * r * S + a * nh * (dn + dr) * (1 + S) + a * nh * (dn + dv) * S + 4 * nh
                 + 2 * a * nh * dv)
    per_token = layer + q_lora + kv_lora + attention
    return per_token * batch * seq_len, a * seq_len * seq_len * S


def ttt_saved_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the TTT forward leaves saved for backward, all K steps (`ttt_step_bytes` each).

    Once: bf16: the fc input cast [T, Kx*Ht] (2Kx*Ht per token); fp32: fc's output (4H per token).
    checkpoint=True (train.activation_checkpointing): a step keeps only its inputs: the hidden
    [B, T, H] entering every step (a bytes; step 0's is fc's output) and the cache of steps
    0..K-2: the latent c (fp32 also under autocast: the RMSNorm's fp32 weight promotes it, 4r) and
    the roped kpe (a*dr); backward recomputes one step at a time (`ttt_step_bytes`).
    Returns {"per_token": linear bytes, "attention_mask": quadratic bytes, "total": both}.
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
            step, mask = ttt_step_bytes(cfg, batch, seq_len, k, bf16)
            linear += step
            quadratic += mask
    return {"per_token": linear, "attention_mask": quadratic, "total": linear + quadratic}


def ttt_backward_working_bytes(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, bf16: bool) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors, in the last
    step's backward: the grads of its attention inputs (q, the keys of all K steps and their kv_b
    output) and of the latents, of its [B, T, Vd] log-softmax (8 bytes) and of its MLP (3 [B, T, I])."""
    a, K, nh = (2 if bf16 else 4), ttt_length, cfg.num_attention_heads
    dq, dkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    per_token = (a * (nh * dq * (1 + K) + nh * dkv * K + cfg.kv_lora_rank * K) + 8 * cfg.draft_vocab_size
                 + 3 * a * cfg.intermediate_size)
    return per_token * batch * seq_len


def draft_step_flops(cfg: MLADraftConfig, batch: int, seq_len: int, ttt_length: int, checkpoint: bool = False) -> dict:
    """Analytic FLOPs of one draft training step (multiply-adds x 2) of N = B*T tokens, K TTT steps,
    S_k = (k+1)T keys at step k; torch.utils.flop_counter counts the same step exactly
    (tests/draft/test_eagle3_mla_plan.py, its SDPA formulas included).

      forward  = N*2*(Kx*Ht*H)                                   fc, once
               + K*N*2*(2H*rq + rq*nh*(dn+dr) + 2H*(r+dr) + nh*dv*H + 3H*I + H*Vd)
                                                                 q_a, q_b, kv_a (input 2H), o, SwiGLU, lm_head
               + sum_k S_k*B*2*r*nh*(dn+dv)                      kv_b over the latents of steps 0..k
               + sum_k B*2*nh*T*S_k*((dn+dr) + dv)               QK^T and PV of step k's fused SDPA
      backward = fc: weight grad only (aux needs no grad) = 1 x its forward
               + linears (kv_b included): 2 x forward (input and weight grads)
               + attention: B*2*nh*T*S_k*(3(dn+dr) + 2dv) (QK^T recomputed, dP and dV over dv,
                 dQ and dK over dn+dr)
      recompute (checkpoint: train.activation_checkpointing) = one more forward of every TTT step
      teacher  = 2*N*V*Ht (the target's lm_head over the final hidden states; no backward)
    Element-wise work (norms, softmax, RoPE, AdamW) is not counted."""
    H, Ht, I, Vd, V = (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.draft_vocab_size,
                       cfg.vocab_size)
    nh, r, rq, dr, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim,
                         cfg.v_head_dim)
    dq, dkv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    N, T, K = batch * seq_len, seq_len, ttt_length
    fc = 2 * N * cfg.num_aux_hidden_states * Ht * H
    per_step = 2 * N * (2 * H * rq + rq * nh * dq + 2 * H * (r + dr) + nh * dv * H + 3 * H * I + H * Vd)
    linear = K * per_step + sum(2 * batch * (k + 1) * T * r * nh * dkv for k in range(K))
    attention_fwd = sum(batch * 2 * nh * T * (k + 1) * T * (dq + dv) for k in range(K))
    attention_bwd = sum(batch * 2 * nh * T * (k + 1) * T * (3 * dq + 2 * dv) for k in range(K))
    fwd = fc + linear + attention_fwd
    bwd = fc + 2 * linear + attention_bwd
    recompute = linear + attention_fwd if checkpoint else 0
    teacher = 2 * N * V * Ht
    return {"teacher": teacher, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
            "attention_fwd": attention_fwd, "attention_bwd": attention_bwd,
            "total": teacher + fwd + bwd + recompute}
