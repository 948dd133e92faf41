"""AdamW on fp32 master weights with a linear warm-up + cosine schedule, and the update every training loop runs."""

from __future__ import annotations

import logging
import math

import torch

from ..config import TrainConfig
from ..errors import UserError

log = logging.getLogger("dflash_train")


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


class Updater:
    """clip -> AdamW -> schedule -> zero grads: the one update sequence of the trainer and every pipeline replica.

    A step whose gradient norm is not finite (a NaN/Inf loss) leaves the weights and optimizer state as they were
    (the schedule still advances, so the LR stays a function of the step); with train.nonfinite=stop it raises
    NonFiniteError naming the step instead. Replicas run this on identical averaged gradients, so all of them decide
    the same. Where the decision is made:
    - on the device, when the optimizer is fused AdamW (CUDA) and nonfinite=skip: "not finite" goes to the fused
      kernel as `found_inf` (the protocol torch's GradScaler uses), which then changes nothing, and a device counter
      adds it up. No host sync per step: the count is read by `skipped(step)`, at log steps and at the end.
    - on the host otherwise (CPU's foreach AdamW, or nonfinite=stop, which must raise at that very step): one
      bool() per step, and the skip is announced at once.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer, scheduler, grad_clip: float, nonfinite: str,
                 announce: bool = True, where: str = ""):
        self.params, self.optimizer, self.scheduler = params, optimizer, scheduler
        self.grad_clip, self.nonfinite = grad_clip, nonfinite
        self.announce, self.where = announce, where  # log a warning per skip; " on every replica" etc.
        fused = any(g.get("fused") for g in optimizer.param_groups)
        self.on_device = fused and nonfinite == "skip"
        self._count = torch.zeros((), dtype=torch.float32, device=params[0].device) if self.on_device else None
        self._host_count = 0   # host mode: the count; device mode: the count at the last read

    def __call__(self, step: int) -> None:
        """Update after 1-based training step `step`."""
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if self.on_device:
            bad = (~torch.isfinite(norm)).to(torch.float32)
            self.optimizer.found_inf = bad    # read by fused AdamW: skip the whole update when 1
            self.optimizer.step()
            self._count += bad
        elif bool(torch.isfinite(norm)):      # a host sync: this mode decides on the host (class docstring)
            self.optimizer.step()
        elif self.nonfinite == "stop":
            raise NonFiniteError(f"Step {step} has a non-finite loss or gradients (gradient norm {float(norm)}) "
                                 "and train.nonfinite=stop; lower train.lr, check the data, or set "
                                 "train.nonfinite=skip to skip such steps.")
        else:
            self._host_count += 1
            if self.announce:
                log.warning(f"step {step}: non-finite loss or gradients, update skipped{self.where} "
                            f"({self._host_count} so far)")
        self.scheduler.step()
        # Keep .grad allocated: with CUDA graphs (reduce-overhead) a None grad would *steal* the graph's static output
        # buffer, which a later replay may overwrite (see training/step.py). Zeroed in place instead.
        self.optimizer.zero_grad(set_to_none=False)

    def skipped(self, step: int) -> int:
        """Steps skipped so far (device mode: a host sync, and the skips since the last read are announced)."""
        if self._count is not None:
            total = int(self._count.item())
            if total > self._host_count and self.announce:
                log.warning(f"by step {step}: {total - self._host_count} more step(s) with a non-finite loss or "
                            f"gradients, update skipped{self.where} ({total} so far)")
            self._host_count = total
        return self._host_count
