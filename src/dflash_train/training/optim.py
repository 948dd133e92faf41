"""AdamW on fp32 master weights with a linear warm-up + cosine schedule."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def build_optimizer(params, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # fused AdamW is one kernel per step on CUDA; on CPU the default (foreach) implementation is used.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up then cosine to min_lr_ratio."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
