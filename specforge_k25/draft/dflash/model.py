"""The DFlash drafter as SGLang 0.5.23 computes it (srt/models/dflash.py `DFlashDraftModel`, the
draft step of srt/speculative/dflash_worker_v2.py), in plain PyTorch.

One forward drafts a whole block. For a sequence whose committed tokens are x[0..p-1] (their
K captured target states known) and whose last accepted token is x[p]:

    ctx    = hidden_norm(fc(cat of the K target states of x[0..p-1]))     [p, H], once for all layers
    block  = embed([x[p], MASK, ..., MASK])  at positions p..p+B-1       [B, H], the TARGET's embedding
    every decoder layer (Qwen3 layout, pre-norm):
        q, k, v  = proj(input_layernorm(h)); q_norm / k_norm per head; RoPE at the block positions
        k_c, v_c = k_norm(k_proj(ctx)), v_proj(ctx); RoPE at the context positions 0..p-1
                   (the same ctx in every layer; no input_layernorm on it)
        h += o_proj(attention of the block's queries over [k_c ; k], [v_c ; v]), no causal mask
        h += mlp(post_attention_layernorm(h))
    logits = norm(h) @ lm_head.T   with the TARGET's lm_head; block position j (1..B-1) drafts x[p+j]

H is the target's hidden size (fc is [H, K*H] in SGLang, and the block goes through the target's
embedding). The model keeps the target's embedding (`embed_tokens`, frozen, as every draft method
does) and the target's lm_head as a non-persistent buffer (`lm_head_weight`, attached with
`attach_lm_head`, never checkpointed nor exported: SGLang and vLLM take the target's own).

There is no draft vocabulary: `d2t` (zeros [V]: draft id == target id) and `t2d` (all True) are
the identity maps of a full-vocab draft, which is what draft/vocab.py's build_vocab_maps returns
for Vd = V, so code that reads them (setup, eval) sees a draft that proposes any target token.

Training (draft/dflash/loss.py) runs many blocks of one sequence in one forward: `forward` takes
A blocks of Bk tokens (Q = A*Bk) with their positions and `prefix` [B, A], the context tokens each
block sees (block i: context 0..prefix_i - 1 and its own Bk tokens), and computes that attention
exactly in bounded tiles (draft/dflash/block_attention.py; cfg.attention_tile_rows x
attention_tile_keys scores at a time, no [Q, T+Q] tensor). `draft_block` (eval, SGLang checks) is
the same path with one block, and eval's replay of every root one block per root
(replay.py `block_proposals`). The block size is that of the call (Q / A), so the
replay may draft at the served block sizes rather than the trained one.

Shapes: B batch, T context positions, Q block tokens (blocks x block size), H hidden, K aux states,
nh / nkv heads, hd head dim, V target vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..layers import MLP, RMSNorm, apply_rope, rope_cos_sin
from .block_attention import Tiling, block_attention, make_tiling
from .config import DFlashSpec, default_gamma


@dataclass
class DFlashConfig:
    hidden_size: int  # H (= Ht: SGLang's fc is [H, K*H] and the block is the target's embedding)
    intermediate_size: int  # I
    num_hidden_layers: int  # N draft layers
    num_attention_heads: int  # nh
    num_key_value_heads: int  # nkv
    head_dim: int  # hd
    vocab_size: int  # V (the target's)
    target_hidden_size: int  # Ht
    num_aux_hidden_states: int = 5  # K target states per context token
    block_size: int = DFlashSpec.block_size  # B: the anchor token + B-1 drafted tokens
    mask_token_id: int = 0  # id of the MASK slots (< V, never in real input; method.py chooses it)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # training only (draft/dflash/loss.py): anchors drawn per sequence, CE weight exp(-(j-1)/gamma)
    # at block position j, positions per logits chunk; defaults: config.py's DFlashSpec
    num_anchors: int = DFlashSpec.num_anchors
    loss_gamma: float = default_gamma(DFlashSpec.block_size)
    logits_chunk: int = DFlashSpec.logits_chunk
    # the block attention's tile (block_attention.py): block-token rows (rounded down to whole
    # blocks) x context keys scored at a time; memory, not results, depends on them
    attention_tile_rows: int = DFlashSpec.attention_tile_rows
    attention_tile_keys: int = DFlashSpec.attention_tile_keys

    @property
    def draft_vocab_size(self) -> int:
        """The full target vocab: DFlash proposes with the target's lm_head."""
        return self.vocab_size


def check_config(cfg: DFlashConfig) -> None:
    problems = []
    if cfg.hidden_size != cfg.target_hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden {cfg.target_hidden_size} "
                        "(SGLang's fc is [H, K*H] and the block uses the target's embedding)")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append(f"{cfg.num_attention_heads} heads are not a multiple of {cfg.num_key_value_heads} KV heads")
    if cfg.head_dim % 2:
        problems.append(f"head_dim {cfg.head_dim} must be even (RoPE rotates pairs)")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} < 2 drafts nothing")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocab [0, {cfg.vocab_size})")
    if cfg.num_aux_hidden_states < 1 or cfg.num_hidden_layers < 1:
        problems.append("need >= 1 aux state and >= 1 layer")
    if cfg.attention_tile_rows < 1 or cfg.attention_tile_keys < 1:
        problems.append(f"attention tiles {cfg.attention_tile_rows} x {cfg.attention_tile_keys} must be positive")
    if problems:
        raise ValueError("DFlash config: " + "; ".join(problems))


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def _keys(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> roped normed keys, values [B, nkv, S, hd]."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_block, rope_ctx, prefix: torch.Tensor,
                tiling: Tiling, seq=None) -> torch.Tensor:
        """x [B, Q, H] (normed block), ctx [B, T, H] (projected context, not normed again),
        rope_* (cos, sin) [B, 1, S, hd]; prefix [B, A] int64 with its `tiling` -> [B, Q, H].
        seq (context parallelism): ctx is this rank's window [B, L, H] of the positions; its keys and
        values are gathered along the sequence (every rank's, in order) before the attention."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)  # [B, nh, Q, hd]
        q = apply_rope(q, *rope_block)
        k_c, v_c = self._keys(ctx, rope_ctx)  # [B, nkv, T, hd] (seq: [B, nkv, L, hd])
        if seq is not None:  # -> [B, nkv, C L, hd]; backward returns each rank its positions' grads
            k_c, v_c = (seq.gather_positions(t.transpose(1, 2)).transpose(1, 2) for t in (k_c, v_c))
        k_b, v_b = self._keys(x, rope_block)  # [B, nkv, Q, hd]
        scale = 1.0 / math.sqrt(self.hd)
        out = block_attention(q, k_c, v_c, k_b, v_b, prefix, scale, tiling)  # [B, nh, Q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, ctx, rope_block, rope_ctx, prefix, tiling, seq=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_block, rope_ctx, prefix, tiling, seq)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(cfg.num_aux_hidden_states * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        # the target's lm_head [V, Ht], attached by reference (attach_lm_head); not in state_dict
        self.register_buffer("lm_head_weight", torch.empty(0, cfg.target_hidden_size), persistent=False)
        self.vocab_shard = None  # the head's rows split over ranks (attach_lm_head)
        # identity vocab maps of a full-vocab draft (module doc)
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def attach_lm_head(self, weight) -> None:
        """The target's lm_head [V, Ht] (any dtype; kept as given, shared, never trained), or this
        rank's rows of it (train/vocab_parallel.py VocabShard: `weight` [Vs, Ht] rows of the
        `vocab_size`; the loss then scores tokens with the ranks of its group, through its
        `token_losses`, and `logits` is not available)."""
        shard = None if isinstance(weight, torch.Tensor) else weight
        rows = shard.vocab_size if shard is not None else weight.shape[0]
        width = (shard.weight if shard is not None else weight).shape[1]
        if (rows, width) != (self.cfg.vocab_size, self.cfg.target_hidden_size):
            raise ValueError(f"lm_head {(rows, width)}, expected {(self.cfg.vocab_size, self.cfg.target_hidden_size)}")
        self.vocab_shard = shard
        self.lm_head_weight = (shard.weight if shard is not None else weight).detach()

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux [B, T, K*Ht] -> context [B, T, H] = hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(aux_hidden))

    def forward(self, aux_hidden: torch.Tensor, ctx_positions: torch.Tensor, block_ids: torch.Tensor,
                block_positions: torch.Tensor, prefix: torch.Tensor, checkpoint: bool = False, seq=None) -> torch.Tensor:
        """aux [B, T, K*Ht], ctx_positions [B, T], block_ids / block_positions [B, Q] (A blocks of
        Bk = Q / A tokens), prefix [B, A] int64: block i (rows i*Bk..(i+1)*Bk-1) sees the context
        tokens 0..prefix[:, i]-1 and its own Bk tokens, both directions
        -> final-normed hidden [B, Q, H]. checkpoint: recompute each layer in backward.
        seq (context parallelism, train/context_parallel.py SeqShard): aux and ctx_positions are
        this rank's window [B, L] of the positions; each layer gathers the context's keys and values
        of the whole sequence, and prefix counts positions of the whole sequence."""
        Q, A = block_ids.shape[1], prefix.shape[1]
        if A == 0 or Q % A:
            raise ValueError(f"DFlashDraft.forward: {Q} block tokens do not split into {A} blocks")
        ctx = self.project(aux_hidden)
        h = self.embed_tokens(block_ids).to(ctx.dtype)
        rope_ctx = rope_cos_sin(ctx_positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)
        rope_block = rope_cos_sin(block_positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)
        # the tiles' key ranges, once for every layer (and their recomputes)
        tiling = make_tiling(prefix, Q // A, self.cfg.attention_tile_rows, self.cfg.attention_tile_keys)
        for layer in self.layers:
            if checkpoint and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, ctx, rope_block, rope_ctx, prefix, tiling, seq,
                                                      use_reentrant=False)
            else:
                h = layer(h, ctx, rope_block, rope_ctx, prefix, tiling, seq)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """normed hidden [..., H] -> target-vocab logits [..., V] through the target's lm_head."""
        w = self.lm_head_weight
        if w.numel() == 0:
            raise RuntimeError("DFlashDraft has no lm_head: call attach_lm_head(target lm_head) first")
        if self.vocab_shard is not None:
            raise RuntimeError("DFlashDraft holds 1/W of the lm_head's rows (VocabShard): its loss scores tokens "
                               "with its group (train/vocab_parallel.py); attach the whole head for logits")
        return F.linear(hidden.to(w.dtype), w)

    def draft_block(self, aux_hidden: torch.Tensor, last_token: int | torch.Tensor) -> torch.Tensor:
        """What the server drafts after a prefix of p tokens: aux [p, K*Ht] (their target states),
        last_token = x[p] -> normed hidden [B, H] of the block [x[p], MASK x (B-1)] at positions
        p..p+B-1, every key visible (SGLang's ENCODER_ONLY attention over context + block)."""
        p, B = aux_hidden.shape[0], self.cfg.block_size
        dev = aux_hidden.device
        ids = torch.full((1, B), self.cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[0, 0] = torch.as_tensor(last_token)
        prefix = torch.full((1, 1), p, dtype=torch.int64, device=dev)  # one block seeing all p context tokens
        return self(aux_hidden[None], torch.arange(p, device=dev)[None], ids,
                    torch.arange(p, p + B, device=dev)[None], prefix=prefix)[0]
