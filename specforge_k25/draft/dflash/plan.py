"""The DFlash draft's arithmetic for the plan (plan/memory.py, plan/throughput.py): parameters per
module, the bytes the block loss keeps for backward (tests/draft/test_dflash_plan.py measures them
with saved-tensor hooks) and the analytic FLOPs of one training step (torch's flop counter checks
them in the same file).

A "step" (`step_bytes`) is one draft layer: what the plan's TTT items count per step is what
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
  input, normalized in a, rsqrt per head), and what the block attention (draft/dflash/block_attention.py)
  saves: the roped q, its own K and V at nkv heads (bf16: the autocast casts, as SDPA's were),
  the output (o_proj's input is a view of it) and its logsumexp (fp32); the MLP's 4 [Q, I];
  context tokens: k_norm on the context keys, their roped K and V at nkv heads (in a), and in bf16
  the casts of the context for k_proj and v_proj. No mask: the attention reads each block's
  prefix [B, A] int64 (one tensor shared by every layer, counted once).
Once: the fc input cast (bf16), hidden_norm's input, normalized and rsqrt, the context itself (fp32:
the layers' k/v input), RoPE cos/sin of context and block (fp32), the final norm, and for the
logits the counted hidden rows [P, H] fp32 (each logits chunk is recomputed in backward), their
labels, indices and CE.
With activation checkpointing a layer keeps only its inputs: the hidden entering it, and shared by
all layers the context, the RoPE tables and the prefixes.

The block attention's own transient memory is bounded by its tile, R = whole blocks of
cfg.attention_tile_rows rows x C = cfg.attention_tile_keys context keys (`attention_tile`): forward
holds one [B, nh, R, C] score tile (softmax in place), backward two (p, then dP -> dS in place)
plus a [B, R, C] bool visibility mask, besides the fp32 grads of the context K/V it accumulates
(`backward_working_bytes`). The former dense path (a [Q, T+Q] boolean mask and SDPA's additive
copy of it per layer, K/V repeated to nh heads, every query scored against all T+Q keys) is gone
from training; eval's replay still passes a mask (model.py).

FLOPs of the attention depend on where the anchors fall (a tile reads the context up to its largest
prefix); the plan assumes A anchors spread evenly over 1..T-Bk (`planned_anchors`).
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


def planned_anchors(cfg: DFlashConfig, seq_len: int) -> list[int]:
    """The A anchors the plan's FLOPs assume: spread evenly over 1..T-Bk (every block position
    counts, as the plan's P does), or 1..A when the sequence has fewer positions than that."""
    A, span = anchors_per_sequence(cfg, seq_len), max(anchors_per_sequence(cfg, seq_len), seq_len - cfg.block_size)
    return [1 + i * (span - 1) // (A - 1) for i in range(A)] if A > 1 else [1]


def attention_tile(cfg: DFlashConfig, seq_len: int) -> tuple[int, int]:
    """(R, C): the block attention's score tile per sequence and head, R rows (whole blocks, at most
    Q) by C context keys (at most T); block_attention.make_tiling's rule."""
    T, Q, _ = _tokens(cfg, seq_len)
    G = max(1, min(Q // cfg.block_size, cfg.attention_tile_rows // cfg.block_size))
    return G * cfg.block_size, min(cfg.attention_tile_keys, T)


def attention_scores(cfg: DFlashConfig, seq_len: int) -> int:
    """Query-key pairs the block attention scores per sequence and head at `planned_anchors`: each
    row against its block's Bk keys, and each tile's R rows against the context keys 0..P-1, P the
    tile's largest prefix (its last anchor: they are sorted)."""
    anchors, Bk = planned_anchors(cfg, seq_len), cfg.block_size
    G = attention_tile(cfg, seq_len)[0] // Bk
    context = sum(len(anchors[i:i + G]) * Bk * anchors[i:i + G][-1] for i in range(0, len(anchors), G))
    return len(anchors) * Bk * Bk + context


def step_bytes(cfg: DFlashConfig, batch: int, seq_len: int, k: int, bf16: bool) -> tuple[int, int]:
    """(bytes, mask bytes = 0) draft layer k keeps for backward (k = 0: the first layer, whose input
    needs no grad; any other k: a later layer).

    Per block token: 2 norms x (8H + 4); their outputs as read: fp32 8H | bf16 10H (5 casts);
      q_norm + k_norm (4 + a)(nh + nkv)hd + 4(nh + nkv); roped q, attention output a*nh*hd each,
      logsumexp 4nh; MLP 4a*I; its own K, V 2a*nkv*hd. First layer: 4H + 4 less.
    Per context token: bf16 4H (the context cast for k_proj and v_proj; fp32 reads the context
      itself, counted once); k_norm (4 + a)nkv*hd + 4nkv; K, V 2a*nkv*hd.
    No mask (the prefixes, shared by all layers, are counted once in `saved_bytes`)."""
    H, I, nh, nkv, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim)
    a = 2 if bf16 else 4
    T, Q, _ = _tokens(cfg, seq_len)
    kv = 2 * a * nkv * hd
    block = (2 * (8 * H + 4) + (10 * H if bf16 else 8 * H) + (4 + a) * (nh + nkv) * hd + 4 * (nh + nkv)
             + 2 * a * nh * hd + 4 * nh + 4 * a * I + kv)
    if k == 0:
        block -= 4 * H + 4
    context = (4 * H if bf16 else 0) + (4 + a) * nkv * hd + 4 * nkv + kv
    return batch * (Q * block + T * context), 0


def saved_bytes(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, bf16: bool = False,
                    checkpoint: bool = False) -> dict[str, int]:
    """Bytes the block loss's forward leaves for backward: the N layers (`step_bytes`) and once

      per context token: bf16 the fc input cast 2K*Ht; hidden_norm 4H + aH + 4; fp32 the context
        4H (the layers' input); RoPE cos/sin 8hd
      per block token: RoPE cos/sin 8hd; the final norm 8H + 4
      per counted row: the hidden row 4H, label 8, CE index 8, row indices 16, CE 4;
      per anchor: its prefix, 8 (int64; every layer's attention reads the same tensor);
      per batch: the position weights and normalizer, 8(Bk-1).
    checkpoint=True (train.activation_checkpointing, per layer): instead of the layers, each one's
    input hidden (4H per block token and layer) and, shared, the context 4H per context token.
    `depth` is not used.
    Returns {"per_token": bytes, "attention_mask": 0 (no mask), "total": both}."""
    H, N, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    a = 2 if bf16 else 4
    T, Q, P = _tokens(cfg, seq_len)
    context = (2 * cfg.num_aux_hidden_states * cfg.target_hidden_size if bf16 else 0) + 4 * H + a * H + 4 + 8 * hd
    block = 8 * hd + 8 * H + 4
    linear = (batch * (T * context + Q * block + P * (4 * H + 36) + 8 * anchors_per_sequence(cfg, seq_len))
              + 8 * (cfg.block_size - 1))
    if checkpoint:
        linear += batch * (T * 4 * H + Q * N * 4 * H)
    else:
        linear += batch * T * (0 if bf16 else 4 * H)
        linear += sum(step_bytes(cfg, batch, seq_len, k, bf16)[0] for k in range(N))
    return {"per_token": linear, "attention_mask": 0, "total": linear}


def backward_working_bytes(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, bf16: bool = False) -> int:
    """Estimate (not measured) of the transient memory on top of the saved tensors at the peak of
    backward: one logits chunk recomputed ([c, V] logits in a, their fp32 copy, log-softmax, and
    the grads of both: (2a + 12) bytes per element, c = min(logits_chunk, counted rows)), the grad
    of the counted hidden rows, and the last layer's grads: the block attention's (two fp32 score
    tiles [nh, R, C] and a bool [R, C] at a time, `attention_tile`; fp32 accumulators of the
    context's K/V grads and their cast, q's and the block K/V's grads), its MLP's 3 [Q, I], the
    context's fp32 grad."""
    H, I, V, nh, nkv, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim)
    a = 2 if bf16 else 4
    T, Q, P = _tokens(cfg, seq_len)
    R, C = attention_tile(cfg, seq_len)
    chunk = min(cfg.logits_chunk, batch * P)
    tiles = 2 * 4 * nh * R * C + R * C
    layer = (T * (8 + 2 * a) * nkv * hd + Q * (a * nh * hd + 2 * a * nkv * hd + 3 * a * I + 4 * H) + T * 4 * H
             + tiles)
    return chunk * V * (2 * a + 12) + batch * (P * 4 * H + layer)


def split_head_bytes(cfg: DFlashConfig, shards: int, bf16: bool = False) -> int:
    """The lm_head's rows split over `shards` co-located ranks (train/vocab_parallel.py): one chunk's
    exchange buffers beside its logits slice [shards*c, V/shards] (as large as one replicated chunk's
    [c, V], in `backward_working_bytes`): the gathered rows of the hidden states and of the target's
    final states [shards*c, Ht] fp32, the fp32 grad part before its reduce-scatter and the rank's
    own share [c, Ht]; c = logits_chunk."""
    rows = shards * cfg.logits_chunk
    return 4 * cfg.target_hidden_size * (3 * rows + cfg.logits_chunk)


def context_parallel_values(cfg: DFlashConfig, size: int, depth: int = 0) -> float:
    """Values one rank sends per position it holds in a forward with the sequences split over
    `size` ranks (train/context_parallel.py): each of the N layers all-gathers the context's roped
    keys and values (2 nkv hd per position) to the size - 1 other ranks. The backward returns as many
    (the gather's backward is an all-to-all of the grads). `depth` is not used (no TTT steps)."""
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * (size - 1)


def draft_step_flops(cfg: DFlashConfig, batch: int, seq_len: int, depth: int = 0, checkpoint: bool = False) -> dict:
    """Analytic FLOPs (multiply-adds x 2) of one training step over `batch` sequences of `seq_len`
    tokens, A anchors each at `planned_anchors` (Q block tokens, P counted rows); torch's flop
    counter counts the same step exactly (tests/draft/test_dflash_plan.py).

      forward  = fc over T tokens                      2T*K*Ht*H
               + context K/V, N layers                 2T*N*H*2nkv*hd
               + block tokens, N layers                2Q*N*(2H*nh*hd + 2H*nkv*hd + 3H*I)
               + attention: S = `attention_scores` query-key pairs per head (QK^T and PV)
                                                       N*4*nh*S*hd
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
    attention = N * 4 * nh * attention_scores(cfg, seq_len) * hd
    logits = 2 * P * H * V
    fwd = fc + linear + attention + logits
    bwd = fc + 2 * linear + attention * 5 // 2 + logits
    recompute = logits + (linear + attention - 2 * Q * N * H * I if checkpoint else 0)
    per = {"teacher": 0, "draft_fwd": fwd, "draft_bwd": bwd, "draft_recompute": recompute,
           "attention_fwd": attention, "attention_bwd": attention * 5 // 2}
    out = {k: v * batch for k, v in per.items()}
    out["total"] = out["draft_fwd"] + out["draft_bwd"] + out["draft_recompute"]
    return out
