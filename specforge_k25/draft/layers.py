"""Layers every draft method builds from (plain PyTorch): RMSNorm, RoPE in the rotate-half
layout (Llama / SGLang), the gated MLP, and the fp32-at-least rule of the losses' softmaxes."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 inputs, float64 stays float64 (the reference tests run in float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(at_least_fp32(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, 1, T, hd] (rotate-half layout, as Llama/SGLang)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    freqs = positions.double()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], -1)[:, None]  # [B, 1, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, cfg):  # cfg.hidden_size H, cfg.intermediate_size I
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
