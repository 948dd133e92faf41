"""The threaded training pipeline: build the stages, start them in order, supervise, shut down on every exit path.

  loader --batches--> target workers --features--> prefetch (reorder, copy) --inbox per replica--> drafter workers
  (1 thread)  [queue]  (1 thread per target device) [queue]  (1 thread)      [1-deep queues]    (1 thread per replica,
                                                                                                 grads averaged)
Startup: drafters one at a time (each compiles and warms up; `ready` when done), then the target workers (one warm
forward each), then the recompile guard is armed and the prefetcher and loader start. The main thread only
supervises: the first worker failure, a stalled worker or a signal (SIGINT/SIGTERM) stops every thread; a failure
is re-raised naming the worker with its full traceback (one sentence for a UserError: data, disk, a non-finite loss),
a signal writes a checkpoint first. The coordinator fails like a worker (named "coordinator"), and a `Watchdog`
thread reports it when it stalls. docs/RELIABILITY.md lists every fault and its outcome.

Under torchrun every process runs all of this over its own devices; pipeline/distributed.py ties them together
(sharded data, one gradient all-reduce per step, a start gate, statuses so that one rank's failure stops all).
Only global rank 0 logs step lines and writes checkpoints, plots and the final drafter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import Config, ConfigError
from ..devices import peak_memory_line, resolve_config, resolve_pipeline_devices
from ..generation.run_data import regenerate_for_run
from ..errors import UserError
from ..models.checkpoint import save_drafter
from ..models.build import init_output_norm
from ..training.budget import TimeBudget
from ..training.checkpointing import CheckpointManager, resume_point
from ..training.cudagraphs import configure_cudagraphs
from ..training.heap import frozen_heap
from ..training.metrics import MetricsLogger
from ..training.optim import follows_clock
from ..training.plots import write_training_plots
from ..training.profiling import StepProfiler
from ..training.run import build_run, hold_run_dir, load_training_target, prepare_out_dir
from ..training.startup import log_compile_times
from ..training.validation import Validator, build_validation_rows
from ..training.trainer import TrainResult
from .devices import cpu_threads_per_worker
from .distributed import DistributedSync, config_fingerprint
from .drafter_worker import DrafterShared, DrafterWorker, RecompileGuard, weights_checksum
from .faults import FaultPlan
from .gradsync import GradAverager
from .loader import DataShard, LoaderWorker, dummy_batch
from .precompile import Precompile, precompile_parts, start_precompile
from .prefetch import Prefetcher
from .reporter import StepReporter
from .target_worker import TargetWorker
from .worker import (THREAD_PREFIX, RunControl, RunInterrupted, StageClock, Stopped, Watchdog, Worker,
                     describe_failure, describe_stall, stop_on_signals)

log = logging.getLogger("dflash_train")
JOIN_TIMEOUT_S = 10.0  # after stop, every thread leaves its wait within POLL_S; only a hung kernel takes longer
SUPERVISE_POLL_S = 0.1


@dataclass
class PipelineResult(TrainResult):
    replica_checksums: list[list[float]] = field(default_factory=list)  # [step][replica], equal within a step
    stage_fractions: dict = field(default_factory=dict)                 # wait/busy fractions over the run
    replica_batches: list[list[int]] = field(default_factory=list)      # [replica][step]: batch index trained
    target_forwards: list[int] = field(default_factory=list)            # [target worker]: rows it computed


def train_pipeline(cfg: Config, end_by: float | None = None) -> PipelineResult:
    """Train a drafter with the pipeline. end_by: a time.monotonic() reading by which the training steps must end
    (TimeBudget.start; the GPU demo's deadline), None: train.max_minutes alone."""
    configure_cudagraphs()  # the compile policy for steps in worker threads, before anything compiles
    # Under torchrun, join the other processes before anything can fail: whatever fails below then reaches them.
    with DistributedSync.from_env(cfg.pipeline.stall_timeout_s) as peers:
        if peers.enabled and cfg.data.regenerate:
            raise ConfigError("data.regenerate would regenerate the data on every rank: run `dflash-train regenerate` "
                              "once and point data.source at its output, or data.regenerate=false.")
        if peers.enabled and follows_clock(cfg.train):  # rank 0's clock alone decides (training/budget.py)
            raise ConfigError("train.max_minutes without train.max_steps makes the LR schedule follow the clock, "
                              "which one process decides alone: with several processes set train.max_steps (or "
                              "train.budget_steps_per_s) so that every rank runs the same schedule.")
        resolved = resolve_config(cfg)  # every "auto" decided once; the run directory keeps cfg as written
        target_devices, drafter_devices = resolve_pipeline_devices(resolved.pipeline)
        if cfg.pipeline.grad_reduce == "nccl" and len(drafter_devices) > 1:
            if any(d.type != "cuda" for d in drafter_devices):
                raise ConfigError("pipeline.grad_reduce=nccl needs CUDA drafter devices; use grad_reduce=host on CPU.")
            if peers.enabled:
                raise ConfigError("pipeline.grad_reduce=nccl averages the replicas of one process; under torchrun "
                                  "run one drafter replica per process, or set pipeline.grad_reduce=host.")
        if cfg.train.steps_per_row > 1 and (len(target_devices) > 1 or len(drafter_devices) > 1 or peers.enabled):
            raise ConfigError(f"train.steps_per_row={cfg.train.steps_per_row} needs one target device and one drafter "
                              "device in one process (the batches of a row must meet the target that computed its "
                              "features); set train.steps_per_row=1 for this layout.")
        peers.use_device(drafter_devices[0])
        faults = FaultPlan.from_env()  # None unless a fault-injection test set DFLASH_FAULT for this rank
        out = prepare_out_dir(cfg, owner=peers.is_rank0)
        log_name = "run.log" if peers.is_rank0 else f"run.rank{peers.rank}.log"
        # The processes of one node share its cores as well.
        with hold_run_dir(out), run_log_file(out, log_name), \
                cpu_thread_budget((target_devices + drafter_devices) * peers.local_world):
            return _Pipeline(resolved, target_devices, drafter_devices, faults, peers, out, end_by).run()


class _Pipeline:
    """One process's run. The constructor builds every stage, each complete when made (its config values and the
    objects it needs passed in); run() starts them in order, supervises, stops them and writes the final drafter."""

    def __init__(self, cfg: Config, target_devices, drafter_devices, faults: FaultPlan | None,
                 peers: DistributedSync, out_dir: Path, end_by: float | None = None):
        self.cfg, self.n, self.peers, self.faults = cfg, len(drafter_devices), peers, faults
        self.end_by = end_by
        self.control = RunControl(faults)
        self.phase = "startup"
        self._thread = threading.current_thread()
        self.watchdog = Watchdog(self.control, cfg.pipeline.stall_timeout_s)
        self.shard = DataShard(self.n, peers.rank, peers.world)
        self.run_setup = build_run(cfg, replicas=self.shard.global_replicas, out_dir=out_dir,
                                   regenerate=regenerate_for_run)
        self.ckpt = CheckpointManager(self.run_setup.out_dir, cfg.train.keep_checkpoints,
                                      mid_save=self._mid_checkpoint if faults is not None else None)
        init, state = resume_point(cfg.run.resume, self.ckpt, self.run_setup.drafter)
        self.start_step = self._steps_seen = state["step"] if state else 0
        if cfg.model.target_graphs and any(d.type != "cuda" for d in target_devices):
            raise ConfigError("model.target_graphs=true needs CUDA target devices (CUDA graphs); set it to false "
                              "on CPU.")
        targets = [load_training_target(cfg, init.config.target_layer_ids, d) for d in target_devices]
        if state is None and not cfg.model.drafter_init and cfg.model.drafter_layer_init == "random":
            init_output_norm(init, targets[0].lm_head.weight)  # before replicas copy it: the same on every rank
        # Rank 0's clock alone decides; its decision reaches the other ranks in the next step's all-reduce.
        self.budget = TimeBudget(cfg.train.max_minutes if peers.is_rank0 else None,
                                 replicas=self.shard.global_replicas)
        self.logger = MetricsLogger(self.run_setup.out_dir if peers.is_rank0 else None, self.run_setup.total_steps,
                                    cfg.train.token_budget * self.run_setup.batches_per_step, cfg.train.log_every,
                                    start_step=self.start_step, budget=self.budget)
        try:
            # Rank 0's replica 0 validates (the replicas are identical); its rows' features come from the target now.
            rows = None
            if peers.is_rank0:
                pad_id = getattr(self.run_setup.tokenizer, "pad_token_id", None) or 0
                rows = build_validation_rows(self.run_setup.data.heldout, cfg, targets[0], drafter_devices[0], pad_id,
                                             sources=self.run_setup.data.heldout_sources,
                                             keys=self.run_setup.data.heldout_keys)
            self.validator = Validator(rows, self.run_setup.out_dir, cfg.train.eval_every,
                                       self.run_setup.total_steps, self.logger)
            self._build_workers(targets, target_devices, drafter_devices, init, state)
        except BaseException:
            self.logger.close()  # no thread has started yet: the open metrics file is all there is to close
            raise

    def _build_workers(self, targets, target_devices, drafter_devices, init, state) -> None:
        cfg, c = self.cfg, self.control
        start_batch = state["data_position"] if state else 0
        depth = cfg.pipeline.queue_depth
        batches, feats = queue.Queue(depth), queue.Queue(depth)  # TrainBatch (CPU) | FeatureItem (target device)
        inboxes = [queue.Queue(1) for _ in drafter_devices]     # DrafterInput: 1 here + 1 being trained
        in_flight = threading.Semaphore(2 * depth + len(targets) + 1)  # bounds the prefetcher's reorder buffer
        warm = dummy_batch(cfg.train.token_budget, cfg.train.num_anchors)
        self.targets = [TargetWorker(i, c, t, d, batches, feats, warm, graphs=cfg.model.target_graphs,
                                     compile=cfg.model.target_compile,
                                     compile_layers=cfg.model.target_compile_layers,
                                     row_of=self.run_setup.schedule.row_of,
                                     feature_cache_bytes=cfg.train.feature_cache_gb * 2**30,
                                     feature_cache_host_bytes=cfg.train.feature_cache_host_gb * 2**30)
                        for i, (t, d) in enumerate(zip(targets, target_devices))]
        # The drafters' clocks exist before the drafters: the reporter that replica 0 holds reads all of them.
        clocks = [StageClock(d) for d in drafter_devices]
        self.reporter = StepReporter(self.logger, self.ckpt, self.validator,
                                     checkpoint_every=cfg.train.checkpoint_every,
                                     total_steps=self.run_setup.total_steps,
                                     batches_per_step=self.run_setup.batches_per_step, queues=(batches, feats),
                                     target_clocks={t.name: t.clock for t in self.targets},
                                     drafter_clocks={f"drafter{r}": clock for r, clock in enumerate(clocks)},
                                     busy=clocks[0],
                                     profiler=StepProfiler(cfg.train.profile_after, cfg.train.profile_steps,
                                                           self.run_setup.out_dir if self.peers.is_rank0 else None,
                                                           drafter_devices[0], self.start_step,
                                                           self.run_setup.total_steps))
        self.guard = RecompileGuard(cfg.train.compile != "eager" or cfg.model.target_compile != "eager")
        self.gradsync = GradAverager(self.n, c, self.peers, cfg.pipeline.grad_reduce, budget=self.budget)
        embed_w, head_w = targets[0].embed_tokens.weight, targets[0].lm_head.weight  # frozen, borrowed
        shared = DrafterShared(c, cfg.train, self.run_setup.total_steps, self.start_step, init, state, embed_w,
                               head_w, self.gradsync, self.guard, self.budget, self.logger.should_log)
        reporter0 = self.reporter if self.peers.is_rank0 else None  # only rank 0 logs and checkpoints
        self.drafters = [DrafterWorker(r, d, inboxes[r], shared, clocks[r], reporter=reporter0 if r == 0 else None)
                         for r, d in enumerate(drafter_devices)]
        self.prefetch = Prefetcher(c, feats, inboxes, drafter_devices, [w.stream for w in self.drafters],
                                   len(targets), start_batch, in_flight, shard=self.shard)
        uses_cuda = any(d.type == "cuda" for d in target_devices + drafter_devices)
        self.loader = LoaderWorker(c, self.run_setup.schedule, start_batch, batches, in_flight, len(targets),
                                   pin_memory=uses_cuda, shard=self.shard)
        self.workers: list[Worker] = [*self.drafters, *self.targets, self.prefetch, self.loader]

    # ------------------------------------------------------------------ run
    def run(self) -> PipelineResult:
        # Until the end: signals stop cleanly (a second one at once), the watchdog watches this thread.
        with stop_on_signals(self.control, "the current step to write a checkpoint", ", without a checkpoint"), \
                self.watchdog:
            return self._run()

    def _run(self) -> PipelineResult:
        try:
            self._as_coordinator(self._start_and_supervise)
        finally:
            alive = self._shutdown()
            self._as_coordinator(self.ckpt.wait)  # a periodic write still in flight (a failed run) ends here
            self.logger.close()
        if self.control.failure is not None:
            raise self._failure(alive)
        d0 = self.drafters[0]
        if self.control.interrupted:
            raise self._interrupted(d0)
        self._check_replicas_identical()
        self.peers.bye([float(weights_checksum(d0.state.params)), sum(d0.checksums)],  # identical on every rank
                       beat=self.watchdog.beat)
        final, best = self.run_setup.out_dir / "drafter", None
        if self.peers.is_rank0:
            self._save(d0)
            self.validator.mark_checkpoint(self.ckpt, d0.steps_done)
            final, best = self.validator.finish(save_drafter(d0.state.drafter, final))
            if self.cfg.run.plots:
                write_training_plots(self.run_setup.out_dir, self.logger.history, self.logger.val_history)
            log.info(self.validator.summary(d0.steps_done, self.budget.elapsed_s))
        if self.cfg.train.keeps_features:
            for t in self.targets:
                log.info(t.rows.summary())
                t.rows.release()
        if memory := peak_memory_line([w.device for w in self.workers]):
            log.info(memory)
        ranks = f" x {self.peers.world} processes" if self.peers.enabled else ""
        log.info(f"done: {d0.steps_done} steps on {self.n} replica(s){ranks}; servable drafter in {final}")
        checksums = [list(c) for c in zip(*(d.checksums for d in self.drafters))]
        return PipelineResult(self.run_setup.out_dir, final, d0.steps_done, self.logger.history, d0.skipped_steps,
                              self.logger.val_history, best,
                              self.run_setup.out_dir / "drafter_last" if best else None,
                              data=self.run_setup.data_summary,
                              replica_checksums=checksums, stage_fractions=self.reporter.run_fractions(),
                              replica_batches=[d.batch_indices for d in self.drafters],
                              target_forwards=[t.rows.computed for t in self.targets])

    def _start_and_supervise(self) -> None:
        with self._precompile() or nullcontext() as child:
            for d in self.drafters:  # one at a time: each compiles and captures alone
                d.start()
                if not self._supervise(d.ready.is_set):
                    return
            if child is not None:  # the targets then find their compiled forward in the cache
                child.finish(self.cfg.pipeline.stall_timeout_s / 2, beat=self.watchdog.beat,
                             stopping=self.control.stop.is_set)
        for t in self.targets:
            t.start()
        if not self._supervise(lambda: all(t.ready.is_set() for t in self.targets)):
            return
        if self.cfg.train.compile_times:  # every stage has compiled by now
            log_compile_times()
        self.peers.gate({"local replicas": self.n, "start step": self.start_step,  # every rank is ready and agrees
                         "total steps": self.run_setup.total_steps, "gradient + metric size": self.gradsync.step_numel,
                         "run config": config_fingerprint(self.cfg)}, beat=self.watchdog.beat)
        if self.control.stop.is_set():
            return
        self._inject("startup")
        # The dataset, models and compiled graphs out of the collector's reach (training/heap.py): a full collection
        # walking them stops every worker for ~1 s at a step nobody chose.
        with frozen_heap(), self.logger.watch_gc():
            self.phase = "steady"
            self.guard.arm()
            self.reporter.restart_window()
            self.budget.start(self.end_by)
            self.prefetch.start()
            self.loader.start()
            # Out of time (train.max_minutes), the drafters stop early; _shutdown then stops the stages feeding them.
            self._supervise(lambda: all(w.finished.is_set()
                                        for w in (self.drafters if self.budget.spent else self.workers)))

    def _precompile(self) -> Precompile | None:
        """The child process that compiles validation's and the target's forward while the drafters compile their
        training step (pipeline/precompile.py), or None; single-process runs only (under torchrun each rank would
        start its own)."""
        if self.peers.enabled:
            return None
        shared, target = self.drafters[0].shared, self.targets[0]
        drafter_bytes = 4 * sum(p.numel() for p in shared.init_drafter.parameters())  # fp32
        target_bytes = sum(p.numel() * p.element_size() for p in target.target.parameters())
        parts = precompile_parts(self.cfg, self.validator.enabled)
        return start_precompile(self.cfg, shared.init_drafter.config, parts, target.device, self.drafters[0].device,
                                self.run_setup.out_dir / "precompile", child_bytes=target_bytes + 2 * drafter_bytes)

    def _supervise(self, done) -> bool:
        """Wait until done(); False when the run is stopping (failure, stall or signal). Stall = a started worker
        whose heartbeat is older than pipeline.stall_timeout_s (waiting workers keep beating; one found inside its
        polling wait was only not scheduled)."""
        timeout = self.cfg.pipeline.stall_timeout_s
        while not done():
            if self.control.stop.is_set():
                return False
            self._coordinator_points()
            now = time.monotonic()
            if stale := [w for w in self.workers if w.running and now - w.last_beat > timeout
                         and not w.in_polling_wait()]:  # a starved poller is late, not stuck
                w = min(stale, key=lambda w: w.last_beat)  # silent the longest: others may be stuck behind it
                self.control.fail(w.name, describe_stall(w.name, now - w.last_beat, timeout, w.thread))
                return False
            self.control.stop.wait(SUPERVISE_POLL_S)
        return not self.control.stop.is_set()

    def _shutdown(self) -> list[str]:
        """Stop every thread and join it; returns the names of threads that did not finish in time."""
        self.phase = "shutdown"
        self.control.stop.set()
        self._as_coordinator(self._inject, "shutdown")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for w in self.workers:
            while w.thread.ident is not None and w.thread.is_alive() and time.monotonic() < deadline:
                self.watchdog.beat()
                w.thread.join(SUPERVISE_POLL_S)
        return [w.thread.name for w in self.workers if w.thread.is_alive()]

    # ------------------------------------------------------------------ the coordinator's own faults and failures
    def _as_coordinator(self, work: Callable[..., object], *args) -> None:
        """work(*args); what it raises fails the run like a worker's exception: named, with its traceback."""
        try:
            work(*args)
        except Stopped:
            pass  # an injected stall of the coordinator, ended by the watchdog's failure report
        except Exception as e:  # noqa: BLE001 - raised by _run as the run's failure
            self._coordinator_failed(e)

    def _coordinator_failed(self, e: Exception) -> None:
        if self.control.failure is not None:  # another failure is the run's; this one (e.g. a checkpoint write's
            # error that only the final wait sees) goes to the log instead of being dropped
            log.error(f"coordinator: also failed: {type(e).__name__}: {e}")
        self.control.fail("coordinator", describe_failure("coordinator", e, self.phase), e)

    def _inject(self, phase: str, n: int | None = None) -> None:
        if self.faults is not None:
            self.faults.check("coordinator", phase, self.control.failed, n)

    def _coordinator_points(self) -> None:
        """Each supervision poll: beat the watchdog; with faults, the coordinator's step and checkpoint points."""
        self.watchdog.beat()
        if self.faults is None:
            return
        if self.phase == "steady":
            while self._steps_seen < self.drafters[0].steps_done:
                self._steps_seen += 1
                self._inject("step", self._steps_seen)
        self.faults.check_checkpoint("coordinator", self.control.failed)

    def _mid_checkpoint(self) -> None:
        """CheckpointManager.mid_save (with faults only): the `checkpoint` fault point of the thread taking one."""
        me = threading.current_thread()
        if me is self._thread:
            self.faults.in_checkpoint("coordinator", self.control.failed, any(w.running for w in self.workers))
        else:
            self.faults.in_checkpoint(me.name.removeprefix(THREAD_PREFIX), self.control.stop)

    def _failure(self, alive: list[str]) -> Exception:
        """The exception that reports the run's first failure (alive: threads that outlived the stop), logged."""
        worker, message, exc = self.control.failure
        if isinstance(exc, UserError):  # data, a full disk, a non-finite loss with train.nonfinite=stop
            log.error(f"{worker}: {exc}")
            error = UserError(f"{worker}: {exc}")
            error.__cause__ = exc
            return error
        if alive:
            message += f"\n(threads still running after stop: {', '.join(alive)})"
        log.error(message)  # last in the log, so its tail always shows the cause
        return RuntimeError(message)

    def _interrupted(self, d0: DrafterWorker) -> RunInterrupted:
        """After a signal: checkpoint the last complete step; the exception carries the one-line summary."""
        why = self.control.interrupted
        log.warning(f"{why}: stopped after step {d0.steps_done}; writing a checkpoint")
        if d0.steps_done == self.start_step:
            latest = self.ckpt.latest()
            saved = f"no new step since the checkpoint at {latest}" if latest else "no step trained, no checkpoint"
        else:
            saved = f"checkpoint at {self._save(d0)}" if self.peers.is_rank0 else "rank 0 writes the checkpoint"
        summary = f"stopped by {why} at step {d0.steps_done}; {saved}; resume with run.resume=auto"
        log.warning(summary)
        return RunInterrupted(why, summary)

    def _save(self, d0: DrafterWorker) -> Path:
        """The coordinator's checkpoint (final, or after a signal); a failure here fails the run like any other."""
        self.watchdog.beat()
        self.phase = "checkpoint"
        st = d0.state
        try:
            self.ckpt.save(d0.steps_done, st.drafter, st.optimizer, st.scheduler,
                           data_position=d0.steps_done * self.run_setup.batches_per_step)
            return self.ckpt.wait()  # complete before the summary names it or the final export starts
        except Stopped:
            pass  # an injected stall, ended by the watchdog's failure report
        except Exception as e:  # noqa: BLE001 - the run's failure, raised next
            self._coordinator_failed(e)
        raise self._failure([])

    def _check_replicas_identical(self) -> None:
        ref = self.drafters[0].state.drafter.state_dict()
        for d in self.drafters[1:]:
            for name, t in d.state.drafter.state_dict().items():
                if not torch.equal(t.to(ref[name].device), ref[name]):
                    raise RuntimeError(f"replica {d.replica} diverged from replica 0 at {name}: a gradsync bug")


# ---------------------------------------------------------------------------------------------- run scope

@contextmanager
def run_log_file(out_dir: Path, name: str = "run.log"):
    """Everything the 'dflash_train' logger says during the run also goes to <out_dir>/<name>."""
    logger = logging.getLogger("dflash_train")
    handler = logging.FileHandler(out_dir / name)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)


@contextmanager
def cpu_thread_budget(devices: list[torch.device]):
    """Split the cores between the workers computing on the CPU at once (restored afterwards)."""
    n, old = cpu_threads_per_worker(devices), torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
