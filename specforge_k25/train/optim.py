"""AdamW with linear warmup then cosine decay to zero."""
from __future__ import annotations

import math

import torch


def build_optimizer(params, lr: float, betas, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=1e-8)


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """LR multiplier for step s (0-based): linear warmup over ceil(ratio*total), then cosine to 0."""
    warmup = max(1, math.ceil(round(warmup_ratio * total_steps, 6))) if warmup_ratio > 0 else 0  # 0.07*100 != 7.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_scheduler(optimizer, total_steps: int, warmup_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, warmup_ratio))
