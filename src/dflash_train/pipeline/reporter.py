"""Step reports of the pipeline: one log line per log step with the stages' wait/busy fractions, validation, and
checkpoints.

Runs on drafter replica 0's thread right after its optimizer step, so a checkpoint (or a validation) always sees the
weights and optimizer state of one completed step while the other replicas wait at the next gradient average.
"""

from __future__ import annotations

import queue
import time

from ..training.checkpointing import CheckpointManager
from ..training.metrics import MetricsLogger
from ..training.startup import log_first_step
from ..training.validation import Validator
from .worker import Worker


class StepReporter:
    def __init__(self, logger: MetricsLogger, ckpt: CheckpointManager, checkpoint_every: int, total_steps: int,
                 batches_per_step: int, batch_queue: queue.Queue, feats_queue: queue.Queue,
                 targets: list[Worker], drafters: list[Worker], validator: Validator):
        self.logger, self.ckpt, self.checkpoint_every = logger, ckpt, checkpoint_every
        self.validator = validator
        self._validated = -1  # the last step validated
        self._stepped = False  # the first step of this process is logged with the start-up time
        self.total_steps, self.batches_per_step = total_steps, batches_per_step
        self.batch_queue, self.feats_queue = batch_queue, feats_queue
        self.targets, self.drafters = targets, drafters
        self._t = self._t0 = time.perf_counter()
        self._seen: dict[str, tuple] = {}
        self._seen0: dict[str, tuple] = {}

    def restart_window(self) -> None:
        """Called when training starts: warm-up is not part of any window."""
        self._t = self._t0 = time.perf_counter()
        self._seen = self._seen0 = {w.name: self._counters(w) for w in self.targets + self.drafters}

    @staticmethod
    def _counters(w: Worker) -> tuple[float, float, float]:
        return w.clock.get_wait_s, w.clock.put_wait_s, w.clock.busy_s()

    def _fractions(self, since_t: float, since: dict[str, tuple]) -> tuple[dict, dict]:
        """Fractions of the wall time since `since_t` (drafters waiting for data, targets waiting for room, each
        stage busy), averaged over each stage's workers, and each worker's own busy fraction ('busy_by_worker');
        plus the counters now."""
        dt = max(time.perf_counter() - since_t, 1e-9)
        now = {w.name: self._counters(w) for w in self.targets + self.drafters}
        frac = {n: [(c - o) / dt for c, o in zip(now[n], since.get(n, (0.0, 0.0, 0.0)))] for n in now}

        def mean(workers, i):
            return sum(frac[w.name][i] for w in workers) / len(workers)

        return {"drafter_wait": mean(self.drafters, 0), "target_wait": mean(self.targets, 1),
                "drafter_busy": mean(self.drafters, 2), "target_busy": mean(self.targets, 2),
                "busy_by_worker": {n: f[2] for n, f in frac.items()}}, now

    def run_fractions(self) -> dict:
        """The same fractions over the whole training phase (for the result), plus each worker's own busy fraction
        under 'busy_by_worker' ({'target0': .., 'drafter0': ..}): a stage's mean hides an idle or a slow device."""
        return self._fractions(self._t0, self._seen0)[0]

    def on_step(self, worker, step: int, metrics: dict | None) -> None:
        if not self._stepped:
            self._stepped = True
            log_first_step(step)
        if metrics is not None:
            extra, self._seen = self._fractions(self._t, self._seen)
            self._t = time.perf_counter()
            extra["queues"] = f"{self.batch_queue.qsize()}/{self.feats_queue.qsize()}"
            extra["skipped"] = worker.skipped_steps
            self.logger.log(step, metrics, worker.scheduler.get_last_lr()[0], extra=extra)
        if self.validator.due(step):
            self._validate(worker, step)
        if self.checkpoint_every and step % self.checkpoint_every == 0 and step < self.total_steps:
            self.ckpt.save(step, worker.drafter, worker.optimizer, worker.scheduler,
                           data_position=step * self.batches_per_step)
            self.validator.mark_checkpoint(self.ckpt, step)

    def on_end(self, worker) -> None:
        """After replica 0's last step (the last of the schedule, or a time-budget stop): validate it if not yet;
        the last periodic checkpoint is complete (a failed write fails this replica, the one that asked for it)."""
        if self.validator.enabled and self._validated != worker.steps_done:
            self._validate(worker, worker.steps_done)
        self.ckpt.wait()

    def _validate(self, worker, step: int) -> None:
        train_tau = self.logger.history[-1]["tau_est"] if self.logger.history else None
        with worker.clock.busy():
            self.validator(step, worker.step_fn, worker.drafter, train_tau)
        self._validated = step
