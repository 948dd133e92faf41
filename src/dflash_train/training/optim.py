"""The optimizer on fp32 master weights (AdamW, or Muon for the matrices: train.optimizer), a linear warm-up + cosine
schedule, and the update every training loop runs."""

from __future__ import annotations

import logging
import math

import torch

from ..config import TrainConfig
from ..errors import UserError
from .muon import MuonAdamW

log = logging.getLogger("dflash_train")


class NonFiniteError(UserError):
    """A step's gradients were NaN/Inf and train.nonfinite=stop; the message names the step."""


def build_optimizer(params, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    if cfg.optimizer == "muon":
        return MuonAdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                         momentum=cfg.muon_momentum)
    # fused AdamW is one kernel per step on CUDA; on CPU the default (foreach) implementation is used.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up then cosine to min_lr_ratio."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    return _cosine(min(1.0, (step - warmup) / max(1, total_steps - warmup)), min_lr_ratio)


def _cosine(progress: float, min_lr_ratio: float) -> float:
    """The cosine decay from 1 to min_lr_ratio over progress 0..1 (after the warm-up)."""
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def progress_factor(progress: float, step: int, total_steps: int, warmup_ratio: float,
                    min_lr_ratio: float = 0.0) -> float:
    """lr_factor over the run's progress (0..1) instead of its step: warm-up over the first warmup_ratio of it
    (at least one step's worth, so the first step's LR is not zero), then cosine to min_lr_ratio."""
    if warmup_ratio > 0 and progress < warmup_ratio:
        return min(1.0, max(progress, (step + 1) / total_steps) / warmup_ratio)
    return _cosine(min(1.0, (progress - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)), min_lr_ratio)


def follows_clock(cfg: TrainConfig) -> bool:
    """train.max_minutes with neither max_steps nor budget_steps_per_s: the schedule's progress is the larger of
    steps / total_steps (total_steps = `epochs` passes, the most the run may train) and the share of the time spent.
    A run that follows the clock is not reproducible step for step (its LR depends on the machine's speed); set
    train.max_steps for that."""
    return cfg.max_minutes is not None and not cfg.max_steps and cfg.budget_steps_per_s is None


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up + cosine, over steps (lr_factor) or, given the run's TimeBudget as `clock`, over the larger of
    the step and the time progress (progress_factor). Its saved state is the step and the progress reached: a
    resumed run that follows the clock spreads the rest of the schedule over its own train.max_minutes. The length
    is not saved: a resumed run with a new max_steps or epochs follows the new length from its resume step."""

    def __init__(self, optimizer, cfg: TrainConfig, total_steps: int, clock=None):
        self.total_steps, self.clock = total_steps, clock
        self.warmup_ratio, self.min_lr_ratio = cfg.warmup_ratio, cfg.min_lr_ratio
        self.progress, self.clock_start = 0.0, 0.0
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        if self.clock is None:
            self.progress = min(1.0, step / self.total_steps)
            return lr_factor(step, self.total_steps, self.warmup_ratio, self.min_lr_ratio)
        by_clock = self.clock_start + (1.0 - self.clock_start) * self.clock.spent_share(step)
        self.progress = min(1.0, max(step / self.total_steps, by_clock))
        return progress_factor(self.progress, step, self.total_steps, self.warmup_ratio, self.min_lr_ratio)

    def state_dict(self) -> dict:
        state = super().state_dict()
        for key in ("clock", "total_steps", "warmup_ratio", "min_lr_ratio", "clock_start"):
            state.pop(key, None)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.clock_start = max(self.progress, min(1.0, self.last_epoch / self.total_steps)) if self.clock else 0.0


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int, clock=None) -> Schedule:
    """clock: the run's TimeBudget, when follows_clock(cfg)."""
    return Schedule(optimizer, cfg, total_steps, clock if follows_clock(cfg) else None)


class Updater:
    """(mean) -> clip -> AdamW -> schedule -> zero grads: the one update sequence of the trainer and every pipeline
    replica. rows (train.accumulate): the .grad buffers hold the sum over this many rows, scaled to their mean first.

    A step whose gradient norm is not finite (a NaN/Inf loss) leaves the weights and optimizer state as they were
    (the schedule still advances, so the LR stays a function of the step); with train.nonfinite=stop it raises
    NonFiniteError naming the step instead. Replicas run this on identical averaged gradients, so all of them decide
    the same. Where the decision is made:
    - on the device, when the optimizer is fused AdamW (CUDA) or MuonAdamW and nonfinite=skip: "not finite" goes
      to the optimizer as `found_inf` (the protocol torch's GradScaler uses), which then changes nothing, and a
      device counter adds it up. No host sync per step: the count is read by `skipped(step)`, at log steps and at
      the end.
    - on the host otherwise (CPU's foreach AdamW, or nonfinite=stop, which must raise at that very step): one
      bool() per step, and the skip is announced at once.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer, scheduler, grad_clip: float, nonfinite: str,
                 announce: bool = True, where: str = "", track_norms: bool = True, rows: int = 1):
        self.params, self.optimizer, self.scheduler = params, optimizer, scheduler
        self.rows = rows
        self.grad_clip, self.nonfinite = grad_clip, nonfinite
        self.announce, self.where = announce, where  # log a warning per skip; " on every replica" etc.
        on_device = any(g.get("fused") for g in optimizer.param_groups) or getattr(optimizer, "handles_found_inf",
                                                                                   False)
        self.on_device = on_device and nonfinite == "skip"
        self._count = torch.zeros((), dtype=torch.float32, device=params[0].device) if self.on_device else None
        self._host_count = 0   # host mode: the count; device mode: the count at the last read
        # The gradient norms since the last read (grad_norms): sum, max, finite steps, steps over grad_clip; only
        # where they are read (track_norms: the pipeline's other replicas see the same averaged gradients).
        self._norms = torch.zeros(4, dtype=torch.float32, device=params[0].device) if track_norms else None

    def __call__(self, step: int) -> None:
        """Update after 1-based training step `step`."""
        if self.rows > 1:  # the mean over the accumulated rows (the replicas' average, if any, is taken before)
            torch._foreach_mul_([p.grad for p in self.params], 1.0 / self.rows)
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        finite = torch.isfinite(norm)
        if self._norms is not None:
            self._record(norm, finite)
        if self.on_device:
            bad = (~finite).to(torch.float32)
            self.optimizer.found_inf = bad    # read by fused AdamW and MuonAdamW: skip the whole update when 1
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

    def _record(self, norm: torch.Tensor, finite: torch.Tensor) -> None:
        """Add this step's gradient norm (before clipping) to the window, in place on the device: no host sync."""
        value = torch.where(finite, norm.float(), 0.0)
        total, peak, steps, over = self._norms.unbind()
        total.add_(value)
        torch.maximum(peak, value, out=peak)
        steps.add_(finite)
        if self.grad_clip > 0:
            over.add_(value > self.grad_clip)

    def grad_norms(self) -> dict[str, float]:
        """The window's gradient norms before clipping, since the last call (a host sync: log steps only):
        grad_norm (the mean over its finite steps), grad_norm_max, and clipped (the share of its steps whose norm
        train.grad_clip cut; absent when clipping is off). Empty when no finite step was recorded, or with
        track_norms off."""
        if self._norms is None:
            return {}
        total, peak, steps, over = self._norms.tolist()
        self._norms.zero_()
        if not steps:
            return {}
        out = {"grad_norm": total / steps, "grad_norm_max": peak}
        if self.grad_clip > 0:
            out["clipped"] = over / steps
        return out

    def skipped(self, step: int) -> int:
        """Steps skipped so far (device mode: a host sync, and the skips since the last read are announced)."""
        if self._count is not None:
            total = int(self._count.item())
            if total > self._host_count and self.announce:
                log.warning(f"by step {step}: {total - self._host_count} more step(s) with a non-finite loss or "
                            f"gradients, update skipped{self.where} ({total} so far)")
            self._host_count = total
        return self._host_count
