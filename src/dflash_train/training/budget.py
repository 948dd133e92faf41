"""`train.max_minutes`: stop training once a wall-clock budget is spent, at the same step on every replica.

The clock starts when training starts (after loading, tokenizing and compile warm-up). Only the step loop stops
early, and the caller checkpoints and finishes normally. Without train.max_steps the LR schedule follows the clock
too (optim.follows_clock): the share of the budget spent advances it, so the LR reaches its end when the time does,
on any machine, with no steps-per-second figure to guess.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("dflash_train")


class TimeBudget:
    """Decides, once, the step after which every training loop stops.

    With several replicas (pipeline threads) one of them, the `decider`, turns an expired clock into a stop step one
    step ahead: it decides after its step s, before it joins the gradient average of step s+1, which every replica
    must pass to finish step s+1; so every replica reads the decision when it checks after step s+1, and all stop
    there with identical weights. A single loop stops right after the step that ran past the budget.
    """

    def __init__(self, max_minutes: float | None, replicas: int = 1):
        self.max_s = None if max_minutes is None else 60.0 * max_minutes
        self.lag = 0 if replicas == 1 else 1
        self.t0 = time.monotonic()
        self.stop_after: int | None = None  # written once by the decider; a plain int, read by the other threads
        self._shares: dict[int, float] = {}  # steps done -> share of the budget spent then (decider's, recent only)

    def start(self, end_by: float | None = None) -> None:
        """Restart the clock (call when the first training step is about to run). end_by: a time.monotonic() reading
        by which training must end (the GPU demo's 20 minutes): the budget becomes the time left until then where
        that is shorter, so the LR schedule that follows the clock ends then too."""
        self.t0 = time.monotonic()
        if end_by is not None and self.max_s is not None and end_by - self.t0 < self.max_s:
            configured, self.max_s = self.max_s, max(0.0, end_by - self.t0)
            log.info(f"time budget: {self.max_s / 60:.2f} min, the time left to the run's deadline "
                     f"(train.max_minutes={configured / 60:g} is the ceiling)")

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def should_stop(self, steps_done: int, decider: bool = True) -> bool:
        """Called by every replica after each completed step (steps_done counts them)."""
        if decider and self.max_s is not None:
            self._shares[steps_done] = min(1.0, self.elapsed_s / self.max_s) if self.max_s > 0 else 1.0
            self._shares.pop(steps_done - 4, None)
        if decider and self.stop_after is None and self.max_s is not None and self.elapsed_s >= self.max_s:
            self.stop_after = steps_done + self.lag
            log.info(f"time budget of {self.max_s / 60:g} min spent after step {steps_done}: stopping after step "
                     f"{self.stop_after}")
        return self.stop_after is not None and steps_done >= self.stop_after

    def spent_share(self, steps_done: int) -> float:
        """The share of the budget the LR after `steps_done` steps follows: the decider's reading after step
        steps_done - 1. Every replica asks after its own step `steps_done`, i.e. after that step's gradient average,
        which the decider joins only once it has recorded steps_done - 1: all replicas read the same number."""
        return self._shares.get(steps_done - 1, 0.0)

    @property
    def spent(self) -> bool:
        return self.stop_after is not None
