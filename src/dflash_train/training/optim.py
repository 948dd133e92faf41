"""AdamW on fp32 master weights with a linear warm-up + cosine schedule, and the update every training loop runs."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from ..errors import UserError


class NonFiniteError(UserError):
    """A step's gradients were NaN/Inf and train.nonfinite=stop; the message names the step."""


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


def apply_update(params: list[torch.nn.Parameter], optimizer, scheduler, grad_clip: float, nonfinite: str,
                 step: int) -> bool:
    """clip -> AdamW -> schedule -> zero grads: the one update sequence of the trainer and every pipeline replica.

    The update is skipped (False returned; the schedule still advances, so the LR stays a function of the step) when
    the gradient norm is not finite, i.e. a NaN/Inf loss; with nonfinite='stop' that raises NonFiniteError naming
    `step` (1-based) instead. Replicas call this on identical averaged gradients, so all of them decide the same.
    """
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    # bool() reads one device scalar: a host sync per step, which lets the skip stay one plain `if` (the step's
    # kernels are long queued by then; the GPU idles only while the few optimizer launches are issued).
    finite = bool(torch.isfinite(norm))
    if finite:
        optimizer.step()
    elif nonfinite == "stop":
        raise NonFiniteError(f"Step {step} has a non-finite loss or gradients (gradient norm {float(norm)}) and "
                             "train.nonfinite=stop; lower train.lr, check the data, or set train.nonfinite=skip to "
                             "skip such steps.")
    scheduler.step()
    # Keep .grad allocated: with CUDA graphs (reduce-overhead) a None grad would *steal* the graph's static output
    # buffer, which a later replay may overwrite (see training/step.py). Zeroed in place instead.
    optimizer.zero_grad(set_to_none=False)
    return finite
