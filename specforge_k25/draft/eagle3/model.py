"""EAGLE-3 draft head (serving name `LlamaForCausalLMEagle3`), plain PyTorch.

One decoder layer whose attention input is cat(norm(token embedding), norm(hidden)) [2H];
the hidden input is fc(aux) at TTT step 0 and the layer's own output afterwards: pre-norm by
default, post-norm with `norm_output` (EAGLE-3.1). `fc_norm` (EAGLE-3.1) puts one RMSNorm on each
aux state before fc. Both are off by default, and then nothing of them exists in the module.
Parameter names follow the serving checkpoint (docs/EAGLE3.md §1) so export is a rename-free copy.

Shapes: B batch, T positions, H hidden, Ht target hidden, nh/nkv heads, hd head dim,
V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..layers import MLP, RMSNorm, apply_rope, rope_cos_sin
from .ttt_attention import ttt_attention


NUM_AUX = 3  # captured target states fused by fc (docs/EAGLE3.md §4)


@dataclass
class DraftConfig:
    hidden_size: int  # H (must equal the target's hidden size: the embedding is the target's)
    intermediate_size: int  # I
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V, target vocab
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm `fc_norm.{i}` [Ht] on each aux state before fc
    norm_output: bool = False  # EAGLE-3.1: the next step reads norm(h), not the pre-norm h


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        in_dim = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: list,
                seq=None) -> tuple[torch.Tensor, tuple]:
        """TTT attention for one unroll step k = len(past).

        x [B, T, 2H]; positions [B, T] (already offset by k); `past` holds (K_j, V_j) of the earlier
        steps, each [B, nkv, T, hd]. With `seq` (context parallelism, train/context_parallel.py) x
        holds this rank's L positions of the sequences and `past` [B, nkv/C, C L, hd] this rank's
        heads over all positions (KV heads that do not split over C are first repeated to nh). Query i attends to step-0 keys at positions <= i (causal) and,
        for each step j in 1..k, to the key of position i only. Returns (out [B, T, H], (K_k, V_k)).

        Exact TTT attention without a [T, (k+1)T] mask (draft/eagle3/ttt_attention.py): one causal SDPA
        call over step 0's keys (flash / memory-efficient kernels, no [B, nh, T, T] kept) merged with
        the k diagonal terms, O(kT) per head.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.hd, self.theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if seq is not None:
            seq.check_heads(self.nh, "attention heads")
            if self.nkv % seq.size:  # GQA -> MHA: exact, each query head keeps its KV head
                k, v = (t.repeat_interleave(self.nh // self.nkv, dim=1) for t in (k, v))
            q, k, v = seq.to_heads(q), seq.to_heads(k), seq.to_heads(v)  # [B, h/C, C T, hd]
        steps = [*past, (k, v)]
        out = ttt_attention(q, [kj for kj, _ in steps], [vj for _, vj in steps], 1.0 / math.sqrt(self.hd))
        if seq is not None:
            out = seq.to_positions(out)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd)), (k, v)


class DecoderLayer(nn.Module):
    """The EAGLE-3 draft layer; `self_attn` defaults to GQA attention (the MLA head passes its own)."""

    def __init__(self, cfg: DraftConfig, self_attn: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn if self_attn is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, past, seq=None):
        """embeds, hidden [B, T, H] -> (pre-norm output [B, T, H], this step's (K, V))."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # [B, T, 2H]
        attn, kv = self.self_attn(x, positions, past, seq)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), kv


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError("draft.num_attention_heads must be a multiple of draft.num_key_value_heads")
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise ValueError(f"draft.vocab_size={cfg.draft_vocab_size} exceeds the target vocab {cfg.vocab_size}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        if cfg.fc_norm:  # registered only when on: the default draft keeps its parameter names and order
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(NUM_AUX))
        self.fc = nn.Linear(NUM_AUX * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Draft vocab maps (draft/vocab.py): target_id = draft_id + d2t[draft_id]; t2d[v] = v is a draft token.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3Ht] -> hidden [B, T, H] (TTT step 0 input). With fc_norm, aux state i (the
        i-th Ht-wide slice, capture-point order) goes through fc_norm[i] first."""
        if self.cfg.fc_norm:
            aux_hidden = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux_hidden.chunk(NUM_AUX, -1))], -1)
        return self.fc(aux_hidden)

    def step(self, input_ids, hidden, positions, past, seq=None):
        """One TTT step k = len(past): input_ids [B, T], hidden [B, T, H], past [(K_j, V_j)] of steps < k
        -> (the hidden the next step reads [B, T, H], (K_k, V_k)). Pure: the caller keeps the list of steps.
        seq: this rank's share of the positions (context parallelism; T = its L positions).

        That hidden is what the servers hand their next draft step: the layer's pre-norm output h,
        or norm(h) with norm_output. `logits` takes it as is."""
        out, kv = self.midlayer(self.embed_tokens(input_ids).to(hidden.dtype), hidden, positions, past, seq)
        return (self.norm(out) if self.cfg.norm_output else out), kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`step`'s hidden [B, T, H] -> draft-vocab logits [B, T, Vd]: lm_head(norm(h)) in both modes,
        the norm being already applied with norm_output (the servers norm once, not twice)."""
        return self.lm_head(hidden if self.cfg.norm_output else self.norm(hidden))
