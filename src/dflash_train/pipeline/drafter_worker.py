"""Stage 4, a drafter worker: one thread per drafter device, each holding a full replica of the drafter.

Per step: wait for the batch on its device -> DrafterStep (compiled fwd + bwd), for train.accumulate batches in a
row, their gradients summed -> average grads with the other replicas -> the rows' mean -> clip -> AdamW ->
schedule (training/optim.Updater). Replicas start from the same weights and optimizer state and see the same averaged gradients, so they
stay bit-identical; a per-step weight checksum lets tests (and the end of the run) prove it. Replica 0 also
reports: log lines and checkpoints happen on its thread, between two steps.
"""

from __future__ import annotations

import copy
import logging
import queue
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import TrainConfig
from ..models.drafter import DFlashDrafter
from ..training.budget import TimeBudget
from ..training.metrics import StepWindow
from ..training.optim import Updater, build_optimizer, build_scheduler
from ..training.step import DrafterStep
from .devices import new_stream, wait_event
from .faults import poison_
from .gradsync import GradAverager
from .loader import dummy_batch
from .reporter import ReplicaState, StepReporter
from .worker import END_OF_DATA, RunControl, StageClock, Worker

log = logging.getLogger("dflash_train")


class RecompileGuard:
    """Counts frames dynamo compiles (a process-wide counter). Armed once every replica has warmed up: shapes never
    change, so a compile after that is a bug (and on GPU, a fresh CUDA-graph capture mid-training): fail loudly."""

    def __init__(self, enabled: bool):
        self.enabled, self.baseline = enabled, None

    @staticmethod
    def frames_compiled() -> int:
        from torch._dynamo.utils import counters
        return counters["frames"]["total"]

    def arm(self) -> None:
        if self.enabled:
            self.baseline = self.frames_compiled()

    def check(self, worker: str, step: int) -> None:
        if self.baseline is not None and self.frames_compiled() != self.baseline:
            extra = self.frames_compiled() - self.baseline
            raise RuntimeError(f"{worker}: {extra} frame(s) recompiled after warm-up (by step {step}); every step "
                               "must have the same shapes and guards (run with TORCH_LOGS=recompiles to see why).")


def weights_checksum(params: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim float64 device tensor: the sum of the parameters' L2 norms (a few kernels, no host sync)."""
    return torch.stack(torch._foreach_norm([p.detach() for p in params])).double().sum()


@dataclass(frozen=True)
class DrafterShared:
    """What every drafter replica of a process is built from: the same objects for all of them."""
    control: RunControl
    train: TrainConfig                  # resolved (no "auto")
    total_steps: int
    start_step: int                     # steps done before this process (resume), 0 for a fresh run
    init_drafter: DFlashDrafter         # CPU weights each replica copies: identical init everywhere
    train_state: dict | None            # optimizer and scheduler state when resuming
    embed_w: torch.Tensor               # the target's frozen embedding and LM head [V, H], borrowed
    head_w: torch.Tensor
    gradsync: GradAverager
    guard: RecompileGuard
    budget: TimeBudget                  # train.max_minutes: every replica stops after the same step
    is_log_step: Callable[[int], bool]  # 1-based step -> whether it ends a log window


class DrafterWorker(Worker):
    """Replica `replica` on `device`, fed through `inbox`; `clock` is the one the step reporter reads. Replica 0 of
    rank 0 gets the reporter and reports on its own thread after each step."""

    def __init__(self, replica: int, device: torch.device, inbox: queue.Queue, shared: DrafterShared,
                 clock: StageClock, reporter: StepReporter | None = None):
        super().__init__(f"drafter{replica}", shared.control, device, clock)
        self.replica, self.inbox, self.shared, self.reporter = replica, inbox, shared, reporter
        self.stream = new_stream(device)  # the prefetcher makes batches wait-able on this stream
        self.steps_done = shared.start_step
        self.checksums: list[float] = []  # one per step trained by this replica
        self.batch_indices: list[int] = []  # the data positions it trained on, in order
        self._pending_checksums: list[torch.Tensor] = []
        self.state: ReplicaState | None = None  # made in setup(), on this thread
        self.window = StepWindow()  # this replica's steps since the last log step (averaged over replicas there)

    def setup(self) -> None:
        s, cfg = self.shared, self.shared.train
        # Identical init on every replica: a private copy of the same CPU weights (and optimizer state, if resuming).
        drafter = copy.deepcopy(s.init_drafter).float().to(self.device).train()
        params = list(drafter.parameters())
        optimizer = build_optimizer(params, cfg, self.device)
        scheduler = build_scheduler(optimizer, cfg, s.total_steps, clock=s.budget)
        if s.train_state is not None:
            # deepcopy: on CPU load_state_dict keeps the given tensors, and replicas must not share Adam moments
            optimizer.load_state_dict(copy.deepcopy(s.train_state["optimizer"]))
            scheduler.load_state_dict(s.train_state["scheduler"])
        update = Updater(params, optimizer, scheduler, cfg.grad_clip, cfg.nonfinite, rows=cfg.accumulate,
                         announce=self.replica == 0,
                         where=" on every replica", track_norms=self.replica == 0)
        # Its own tag -> its own code object -> its own compile cache and CUDA graphs (see training/step.py).
        step_fn = DrafterStep(drafter, s.embed_w, s.head_w, cfg, self.device, tag=str(self.replica))
        self.state = ReplicaState(drafter, params, optimizer, scheduler, update, step_fn)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile (and on CUDA capture graphs) on a dummy batch of the real shapes, twice so that anything
        specialised on a second call happens here too. There is no optimizer step, so weights and optimizer state
        are untouched and warm-up never changes training; the grads are zeroed."""
        cfg, st = self.shared.train, self.state
        batch = dummy_batch(cfg.token_budget, cfg.num_anchors).to(self.device)
        feats = torch.zeros(cfg.token_budget, st.step_fn.feats_width, device=self.device,
                            dtype=st.step_fn.dtype)  # [T, k*H], or [T, (k+1)*H] when distilling
        t0 = time.perf_counter()
        for _ in range(1 if st.step_fn.compile_mode == "eager" else 2):
            metrics = st.step_fn(batch, feats)
        ready = f"{self.name}: training step ready in {time.perf_counter() - t0:.1f} s"
        if self.reporter is not None:  # replica 0 validates: its forward-only step compiles now, not mid-run
            t0 = time.perf_counter()
            self.reporter.warm_up(st.step_fn)
            ready += f", validation's forward in {time.perf_counter() - t0:.1f} s"
        # Start-up's largest part on a cold compile cache (minutes at the Qwen3-8B shape): said per stage, so that
        # a slow start names its stage (benchmarks/cases_startup.py reads these lines).
        mode = st.step_fn.compile_mode
        log.info(f"{ready} ({'eager' if mode == 'eager' else f'compile {mode}: compiled or loaded, two calls'})")
        self.shared.gradsync.prepare(self.replica, st.params, metrics)  # the all-reduce layout, before step 1
        st.optimizer.zero_grad(set_to_none=False)  # in place: DrafterStep's .grad buffers are persistent

    def _train_row(self, step: int) -> dict:
        """The next batch of the inbox: forward + backward, its gradients added to the .grad buffers. The batch's
        device memory can be reused once this returns (and the step's kernels are done)."""
        item = self.get(self.inbox)
        if item is END_OF_DATA:
            raise RuntimeError(f"the data ended after {step} steps, before step {self.shared.total_steps}")
        wait_event(item.ready, self.device)  # the prefetcher's copies are done
        self.batch_indices.append(item.batch.index)
        with self.clock.busy():
            return self.state.step_fn(item.batch, item.feats)

    def loop(self) -> None:
        s, st = self.shared, self.state
        rows = s.train.accumulate
        for step in range(self.steps_done, s.total_steps):
            fault = self.inject("step", step)
            for row in range(rows):
                metrics = self._train_row(step)
                if fault and row == rows - 1:  # injected nan/inf: this replica's loss and gradients
                    poison_(fault, metrics["loss"], *(p.grad for p in st.params))
                self.window.add(metrics)
            log_step = s.is_log_step(step + 1)
            metrics = s.gradsync.all_reduce(self.replica, st.params, self.window.take() if log_step else None,
                                            self.wait_for, self.beat)
            with self.clock.busy():  # the single-device trainer's update; the same skip decision on every replica
                st.update(step + 1)
            self.steps_done = step + 1
            self._pending_checksums.append(weights_checksum(st.params))
            s.guard.check(self.name, step + 1)
            if log_step:
                self.flush_checksums()  # .item() syncs this replica's stream: log steps only
            if self.reporter is not None:
                self.reporter.on_step(step + 1, metrics, st)
            if s.budget.should_stop(self.steps_done, decider=self.replica == 0):
                break  # every replica stops after the same step (see training/budget.py)
        self.flush_checksums()
        if self.reporter is not None:
            self.reporter.on_end(self.steps_done, st)
        if self.replica == 0:
            s.gradsync.finish()

    @property
    def skipped_steps(self) -> int:
        """Steps without an update (non-finite averaged gradients, train.nonfinite=skip). Reads a device counter on
        CUDA: call it at log steps and at the end, not every step."""
        return self.state.update.skipped(self.steps_done) if self.state is not None else 0

    def flush_checksums(self) -> None:
        self.checksums += [float(c) for c in self._pending_checksums]
        self._pending_checksums.clear()
