"""Step reports of the pipeline: one log line per log step with the stages' wait/busy fractions, validation, and
checkpoints.

Runs on drafter replica 0's thread right after its optimizer step, so a checkpoint (or a validation) always sees the
weights and optimizer state of one completed step while the other replicas wait at the next gradient average.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch

from ..models.drafter import DFlashDrafter
from ..training.checkpointing import CheckpointManager
from ..training.metrics import MetricsLogger
from ..training.optim import Schedule, Updater
from ..training.profiling import StepProfiler
from ..training.startup import log_first_step
from ..training.step import DrafterStep
from ..training.validation import Validator
from .worker import StageClock


@dataclass(frozen=True)
class ReplicaState:
    """One drafter replica's training objects, made on its own thread (DrafterWorker.setup): what it trains, and
    what a report logs, validates and checkpoints."""
    drafter: DFlashDrafter
    params: list[torch.nn.Parameter]  # drafter.parameters(), in order
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    update: Updater                   # clip -> AdamW -> schedule, with the skipped-step count
    step_fn: DrafterStep              # the compiled forward + backward


class StepReporter:
    """queues: (batches, features), whose sizes each log line shows. target_clocks, drafter_clocks: the stages'
    clocks by worker name, for the wait/busy fractions; the reporter runs on replica 0's thread, so its validations
    count as busy time on `busy` (replica 0's clock)."""

    def __init__(self, logger: MetricsLogger, ckpt: CheckpointManager, validator: Validator, *, checkpoint_every: int,
                 total_steps: int, batches_per_step: int, queues: tuple[queue.Queue, queue.Queue],
                 target_clocks: dict[str, StageClock], drafter_clocks: dict[str, StageClock], busy: StageClock,
                 profiler: StepProfiler | None = None):
        self.logger, self.ckpt, self.checkpoint_every = logger, ckpt, checkpoint_every
        self.profiler = profiler  # train.profile_after: a trace of a few steps, started and stopped here
        self.validator = validator
        self._validated = -1  # the last step validated
        self._stepped = False  # the first step of this process is logged with the start-up time
        self.total_steps, self.batches_per_step = total_steps, batches_per_step
        self.batch_queue, self.feats_queue = queues
        self.target_clocks, self.drafter_clocks, self.busy = target_clocks, drafter_clocks, busy
        self._t = self._t0 = time.perf_counter()
        self._seen: dict[str, tuple] = {}
        self._seen0: dict[str, tuple] = {}

    def restart_window(self) -> None:
        """Called when training starts: warm-up is not part of any window."""
        self._t = self._t0 = time.perf_counter()
        self._seen = self._seen0 = self._counters()

    def _counters(self) -> dict[str, tuple[float, float, float]]:
        clocks = {**self.target_clocks, **self.drafter_clocks}
        return {name: (c.get_wait_s, c.put_wait_s, c.busy_s()) for name, c in clocks.items()}

    def _fractions(self, since_t: float, since: dict[str, tuple]) -> tuple[dict, dict]:
        """Fractions of the wall time since `since_t` (drafters waiting for data, targets waiting for room, each
        stage busy), averaged over each stage's workers, and each worker's own busy fraction ('busy_by_worker');
        plus the counters now."""
        dt = max(time.perf_counter() - since_t, 1e-9)
        now = self._counters()
        frac = {n: [(c - o) / dt for c, o in zip(now[n], since.get(n, (0.0, 0.0, 0.0)))] for n in now}

        def mean(clocks, i):
            return sum(frac[name][i] for name in clocks) / len(clocks)

        return {"drafter_wait": mean(self.drafter_clocks, 0), "target_wait": mean(self.target_clocks, 1),
                "drafter_busy": mean(self.drafter_clocks, 2), "target_busy": mean(self.target_clocks, 2),
                "busy_by_worker": {n: f[2] for n, f in frac.items()}}, now

    def run_fractions(self) -> dict:
        """The same fractions over the whole training phase (for the result), plus each worker's own busy fraction
        under 'busy_by_worker' ({'target0': .., 'drafter0': ..}): a stage's mean hides an idle or a slow device."""
        return self._fractions(self._t0, self._seen0)[0]

    def warm_up(self, step_fn: DrafterStep) -> None:
        """Replica 0's warm-up: the validation's forward-only step compiles now, not mid-run."""
        self.validator.warm_up(step_fn)

    def on_step(self, step: int, metrics: dict | None, replica: ReplicaState) -> None:
        """After replica 0's optimizer step `step` (1-based); metrics: the window's averages on log steps, else None."""
        first = not self._stepped
        if first:
            self._stepped = True
            log_first_step(step)
            if self.checkpoint_every:  # the periodic checkpoints' host buffers, pinned now rather than mid-run
                self.ckpt.reserve(replica.drafter, replica.optimizer, replica.scheduler)
        if metrics is not None:
            extra, self._seen = self._fractions(self._t, self._seen)
            self._t = time.perf_counter()
            extra["queues"] = f"{self.batch_queue.qsize()}/{self.feats_queue.qsize()}"
            extra["skipped"] = replica.update.skipped(step)
            extra.update(replica.update.grad_norms())
            self.logger.log(step, metrics, replica.scheduler.get_last_lr()[0], extra=extra)
        if first:  # the log windows start after the first step: start-up is no window's (MetricsLogger.start_window)
            self.logger.start_window(step)
            self._t, self._seen = time.perf_counter(), self._counters()
        if self.validator.due(step):
            self._validate(step, replica)
        if self.checkpoint_every and step % self.checkpoint_every == 0 and step < self.total_steps:
            self.ckpt.save(step, replica.drafter, replica.optimizer, replica.scheduler,
                           data_position=step * self.batches_per_step)
            self.validator.mark_checkpoint(self.ckpt, step)
        if self.profiler is not None:
            self.profiler.after_step(step)

    def on_end(self, steps_done: int, replica: ReplicaState) -> None:
        """After replica 0's last step (the last of the schedule, or a time-budget stop): validate it if not yet;
        the last periodic checkpoint is complete (a failed write fails this replica, the one that asked for it)."""
        if self.profiler is not None:
            self.profiler.finish(steps_done)  # a run that ended inside the profiled window
        if self.validator.enabled and self._validated != steps_done:
            self._validate(steps_done, replica)
        self.ckpt.wait()

    def _validate(self, step: int, replica: ReplicaState) -> None:
        train_tau = self.logger.history[-1]["tau_est"] if self.logger.history else None
        with self.busy.busy():
            self.validator(step, replica.step_fn, replica.drafter, train_tau)
        self._validated = step
