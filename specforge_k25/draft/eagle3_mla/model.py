"""EAGLE-3 draft head with DeepSeek multi-latent attention (MLA), served as
`Eagle3DeepseekV2ForCausalLM` (SGLang's kimi_k25_eagle3.py, vLLM's deepseek_eagle3.py).

The EAGLE-3 layout of draft/eagle3/model.py (fc over the K captured target states, one decoder layer
fed cat(input_layernorm(embedding), hidden_norm(hidden)) [2H], dense SiLU MLP, norm, lm_head
over the draft vocab, d2t/t2d) with the attention of a DeepSeek-V3 / Kimi layer:

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))            per head [nope | rope]
    c, kpe = kv_a_proj_with_mqa(x) split [kv_lora_rank | rope]
    c      = kv_a_layernorm(c)                               the latent a server caches
    k, v   = kv_b_proj(c) per head [nope | v];  key = [k_nope | rope(kpe)], kpe shared by all heads

RoPE acts on the rope part of q and on kpe only, in DeepSeek's interleaved layout (pairs
(2i, 2i+1) rotate together, GPT-J style; both servers build DeepSeek rope with
is_neox_style=False), with DeepSeek YaRN frequencies. With YaRN factor > 1 the softmax scale
is (qk_nope + qk_rope)^-1/2 times mscale(factor, mscale_all_dim)^2, as both servers do.

Parameter names follow draft/eagle3/model.py (`midlayer.*`); the export renames the layer to `layers.0.*`.
TTT (draft/eagle3/loss.py) runs over this head unchanged: a step's cache entry is (latent c, roped kpe),
the two tensors MLA keeps per token, and attention at step k sees step 0's keys causally and the
diagonal of steps 1..k (draft/eagle3/ttt_attention.py).

Shapes: B batch, T positions, H hidden, Ht target hidden, K aux states, nh heads, dn/dr/dv
nope/rope/value head dims, r kv_lora_rank, rq q_lora_rank, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..eagle3.model import DecoderLayer
from ..layers import RMSNorm
from ..eagle3.ttt_attention import ttt_attention

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "extrapolation_factor", "attn_factor")


@dataclass
class MLADraftConfig:
    hidden_size: int  # H (equal to the target's: the embedding is the target's)
    intermediate_size: int  # I
    num_attention_heads: int  # nh
    q_lora_rank: int  # rq (required: SGLang's draft layer refuses q_lora_rank None)
    kv_lora_rank: int  # r
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    v_head_dim: int  # dv
    vocab_size: int  # V
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    num_aux_hidden_states: int = 3  # K captured target states fed to fc
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # DeepSeek YaRN fields as in a DeepSeek-V3 config's `rope_scaling` (factor,
    # original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, ...);
    # empty = factor 1, which is plain RoPE
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096


def yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(cfg: MLADraftConfig) -> dict:
    """The YaRN fields with the servers' defaults filled in."""
    y = cfg.rope_scaling or {}
    kind = y.get("rope_type", y.get("type", "yarn"))
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"draft rope_scaling type {kind!r}: the MLA draft takes DeepSeek YaRN only")
    unknown = set(y) - set(YARN_KEYS) - {"type", "rope_type", "rope_theta"}
    if unknown:  # e.g. apply_yarn_scaling: vLLM then switches to another rope type
        raise ValueError(f"draft rope_scaling fields {sorted(unknown)} are not supported")
    if y.get("rope_theta", cfg.rope_theta) != cfg.rope_theta:
        raise ValueError(f"draft rope_scaling.rope_theta={y['rope_theta']} differs from rope_theta={cfg.rope_theta}")
    return {"factor": 1.0, "original_max_position_embeddings": cfg.max_position_embeddings, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "extrapolation_factor": 1.0,
            "attn_factor": 1.0, **y}


def rope_inv_freq(cfg: MLADraftConfig) -> torch.Tensor:
    """[dr/2] float64 DeepSeek YaRN frequencies: the original ones for fast-rotating pairs, divided
    by `factor` for slow ones, a linear ramp between the correction dims of beta_fast and beta_slow."""
    y, d, base = _yarn(cfg), cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (y["factor"] * pos_freqs)

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over the context
        return d * math.log(y["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(y["beta_slow"])), d - 1)
    if low == high:
        high += 0.001  # the servers' guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * y["extrapolation_factor"]  # 1 = the original frequency
    return interpolated * (1 - keep) + extrapolated * keep


def rope_mscale(cfg: MLADraftConfig) -> float:
    """What cos and sin are multiplied by (1 for DeepSeek-V3/Kimi: mscale == mscale_all_dim)."""
    y = _yarn(cfg)
    f = y["factor"]
    return yarn_get_mscale(f, y["mscale"]) / yarn_get_mscale(f, y["mscale_all_dim"]) * y["attn_factor"]


def softmax_scale(cfg: MLADraftConfig) -> float:
    """(dn + dr)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    y = _yarn(cfg)
    m = yarn_get_mscale(y["factor"], y["mscale_all_dim"])
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * m * m


def rope_cos_sin(positions: torch.Tensor, cfg: MLADraftConfig, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, 1, T, dr], each frequency repeated for its pair (2i, 2i+1)."""
    inv_freq = rope_inv_freq(cfg).to(positions.device)
    freqs = positions.double()[..., None] * inv_freq  # [B, T, dr/2]
    m = rope_mscale(cfg)
    cos = (freqs.cos() * m).repeat_interleave(2, -1)[:, None]
    sin = (freqs.sin() * m).repeat_interleave(2, -1)[:, None]
    return cos.to(dtype), sin.to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., dr]: (x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin)."""
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return x * cos + rotated * sin


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLADraftConfig):
        super().__init__()
        self.cfg = cfg
        nh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.v_head_dim, cfg.kv_lora_rank)
        in_dim = 2 * cfg.hidden_size  # cat(norm(embedding), norm(hidden))
        self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, r + dr, bias=False)
        self.kv_a_layernorm = RMSNorm(r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(r, nh * (dn + dv), bias=False)
        self.o_proj = nn.Linear(nh * dv, cfg.hidden_size, bias=False)
        self.scale = softmax_scale(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: list,
                seq=None) -> tuple[torch.Tensor, tuple]:
        """TTT attention for one unroll step k = len(past).

        x [B, T, 2H]; positions [B, T] (already offset by k); `past` holds (c_j [B, T, r],
        kpe_j [B, T, dr]) of the earlier steps. Returns (out [B, T, H], (c_k, kpe_k)).
        With `seq` (context parallelism, train/context_parallel.py) x holds this rank's L positions;
        the latents are gathered over all C L positions (`past` holds them so) and expanded for
        this rank's nh/C heads only.

        Keys and values are expanded from every step's latent here (kv_b_proj over each step's T
        rows, cheap next to the layer's other matmuls), so a step keeps only what MLA caches; then
        the exact TTT attention of draft/eagle3/ttt_attention.py (no [T, (k+1)T] mask).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        nh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.v_head_dim, cfg.kv_lora_rank)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, nh, dn + dr).transpose(1, 2)  # [B, nh, T, dn+dr]
        kv_a = self.kv_a_proj_with_mqa(x)  # [B, T, r+dr]
        latent = self.kv_a_layernorm(kv_a[..., :r])  # [B, T, r]
        cos, sin = rope_cos_sin(positions, cfg, q.dtype)  # [B, 1, T, dr]
        q = torch.cat([q[..., :dn], apply_rope_interleaved(q[..., dn:], cos, sin)], -1)
        k_pe = apply_rope_interleaved(kv_a[:, None, :, r:], cos, sin)[:, 0]  # [B, T, dr]
        if seq is not None:
            seq.check_heads(nh, "attention heads")
            q = seq.to_heads(q)  # [B, nh/C, C T, dn+dr]
            latent, k_pe = seq.gather_positions(latent), seq.gather_positions(k_pe)  # [B, C T, r], [B, C T, dr]
        heads = seq.head_slice(nh) if seq is not None else slice(0, nh)
        n, S = heads.stop - heads.start, latent.shape[1]
        if seq is None:
            expand = self.kv_b_proj
        else:  # this rank's heads' rows of kv_b_proj
            w_b = self.kv_b_proj.weight.view(nh, dn + dv, r)[heads].reshape(-1, r)
            expand = lambda c: F.linear(c, w_b)  # noqa: E731

        keys, values = [], []
        for c, p in [*past, (latent, k_pe)]:
            kv = expand(c).view(B, S, n, dn + dv).transpose(1, 2)  # [B, n, S, dn+dv]
            rope_key = p[:, None].expand(B, n, S, dr).to(kv.dtype)  # one rope key for all heads
            keys.append(torch.cat([kv[..., :dn], rope_key], -1))  # [B, n, S, dn+dr]
            values.append(kv[..., dn:])  # [B, n, S, dv]
        out = ttt_attention(q, keys, values, self.scale)  # [B, n, S, dv]
        if seq is not None:
            out = seq.to_positions(out)  # [B, nh, T, dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nh * dv)), (latent, k_pe)


class Eagle3MLADraft(nn.Module):
    """Same surface as draft/eagle3/model.py::Eagle3Draft (project / step / logits, frozen embed_tokens,
    d2t / t2d), so draft/eagle3/loss.py::ttt_loss and draft_state take it as they take that one."""

    def __init__(self, cfg: MLADraftConfig):
        super().__init__()
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise ValueError(f"draft.vocab_size={cfg.draft_vocab_size} exceeds the target vocab {cfg.vocab_size}")
        if not cfg.q_lora_rank or cfg.q_lora_rank <= 0:
            raise ValueError("the MLA draft needs q_lora_rank > 0 (SGLang's Eagle3 MLA layer requires it)")
        if cfg.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if cfg.num_aux_hidden_states < 1:
            raise ValueError("num_aux_hidden_states must be >= 1")
        _yarn(cfg)  # reject an unusable rope_scaling now, not at the first forward
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg, MLAAttention(cfg))  # step returns (c, k_pe) as its cache
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d[v] = v is a draft token (draft/vocab.py)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux [B, T, K*Ht] -> hidden [B, T, H] (TTT step 0 input)."""
        return self.fc(aux_hidden)

    def step(self, input_ids, hidden, positions, past, seq=None):
        """One TTT step k = len(past): input_ids [B, T], hidden [B, T, H], past [(c_j, kpe_j)] of
        steps < k -> (pre-norm hidden [B, T, H], (c_k, kpe_k)). Pure: the caller keeps the steps.
        seq: this rank's share of the positions (context parallelism; T = its L positions)."""
        return self.midlayer(self.embed_tokens(input_ids).to(hidden.dtype), hidden, positions, past, seq)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> draft-vocab logits [B, T, Vd]."""
        return self.lm_head(self.norm(hidden))
