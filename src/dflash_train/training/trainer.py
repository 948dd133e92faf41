"""The simple, single-device, single-thread training loop: the reference the threaded pipeline must reproduce.

  batch -> target.features -> DrafterStep (fwd+bwd) -> clip -> AdamW -> schedule -> log / checkpoint
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path

from ..config import Config
from ..models.checkpoint import save_drafter
from ..devices import parse_device, peak_memory_line, resolve_config
from ..models.build import init_output_norm
from ..models.feature_cache import RowFeatures
from .budget import TimeBudget
from .checkpointing import CheckpointManager, resume_point
from .cudagraphs import configure_cudagraphs
from .heap import frozen_heap
from .metrics import MetricsLogger, StepWindow
from .optim import Updater, build_optimizer, build_scheduler
from .plots import write_training_plots
from .profiling import StepProfiler
from .run import RunSetup, build_run, hold_run_dir, load_training_target
from .startup import log_compile_times, log_first_step
from .step import DrafterStep
from .validation import Validator, build_validation_rows

log = logging.getLogger("dflash_train")


@dataclass
class TrainResult:
    out_dir: Path
    drafter_dir: Path
    steps: int
    history: list[dict]
    skipped_steps: int = 0  # steps whose update was skipped: non-finite loss/gradients, train.nonfinite=skip
    val_history: list[dict] = field(default_factory=list)  # the validations (training/validation.py)
    best: dict | None = None  # {"metric", "step", "value"} of the drafter in drafter_dir; None: the final weights
    last_dir: Path | None = None  # the final weights when drafter_dir holds an earlier, better step
    measured: dict | None = None  # the measurement after training (train.py: EvalReport summary), if any
    data: dict = field(default_factory=dict)  # RunSetup.data_summary: conversations, unique tokens, epochs


def train_single_device(cfg: Config, setup: RunSetup | None = None, regenerate=None) -> TrainResult:
    """regenerate: data.regenerate's step (training.run.build_run), passed in by the caller that owns generation."""
    configure_cudagraphs()  # the compile policy (training/cudagraphs.py), before anything compiles
    setup = setup or build_run(cfg, regenerate=regenerate)
    with hold_run_dir(setup.out_dir):  # the run directory stays locked until training ends, on every path
        # Every "auto" decided once, for this loop's one device (the run directory keeps cfg as written).
        return _train_single_device(resolve_config(cfg, single=True), setup)


def _train_single_device(cfg: Config, setup: RunSetup) -> TrainResult:
    device = parse_device(cfg.pipeline.drafter_devices[0], "pipeline.drafter_devices")
    target = load_training_target(cfg, setup.drafter.config.target_layer_ids, device)
    ckpt = CheckpointManager(setup.out_dir, cfg.train.keep_checkpoints)

    drafter, state = resume_point(cfg.run.resume, ckpt, setup.drafter)
    start_step = state["step"] if state else 0
    if state is None and not cfg.model.drafter_init and cfg.model.drafter_layer_init == "random":
        init_output_norm(drafter, target.lm_head.weight)
    drafter = drafter.float().to(device).train()
    params = list(drafter.parameters())
    optimizer = build_optimizer(params, cfg.train, device)
    budget = TimeBudget(cfg.train.max_minutes)  # started when the loop starts; the LR may follow it (follows_clock)
    scheduler = build_scheduler(optimizer, cfg.train, setup.total_steps, clock=budget)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    step_fn = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, cfg.train, device)
    logger = MetricsLogger(setup.out_dir, setup.total_steps, cfg.train.token_budget * setup.batches_per_step,
                           cfg.train.log_every, start_step=start_step, budget=budget)
    pad_id = getattr(setup.tokenizer, "pad_token_id", None) or 0
    validator = Validator(build_validation_rows(setup.data.heldout, cfg, target, device, pad_id,
                                                sources=setup.data.heldout_sources, keys=setup.data.heldout_keys),
                          setup.out_dir, cfg.train.eval_every, setup.total_steps, logger)
    step, per_step = start_step, setup.batches_per_step  # batches a step: train.accumulate (one replica)
    update = Updater(params, optimizer, scheduler, cfg.train.grad_clip, cfg.train.nonfinite, rows=per_step)
    window = StepWindow()  # the steps since the last log line
    # a row's batches share one target forward (train.steps_per_row), kept rows every epoch's (train.feature_cache_gb)
    rows = RowFeatures(setup.schedule.row_of, cfg.train.feature_cache_gb * 2**30,
                       host_budget_bytes=cfg.train.feature_cache_host_gb * 2**30)
    profiler = StepProfiler(cfg.train.profile_after, cfg.train.profile_steps, setup.out_dir, device, start_step,
                            setup.total_steps)
    try:
        # the heap frozen and the collector timed for the loop (training/heap.py); leaving ckpt waits for the write
        # in flight: its error is raised (logged if another leaves)
        with frozen_heap(), logger.watch_gc(), ckpt:
            budget.start()  # the clock starts here; this loop compiles inside its first step
            batches = setup.schedule.iter_from(start_step * per_step)
            for head in batches:
                for batch in chain([head], islice(batches, per_step - 1)):  # train.accumulate rows, summed
                    b = batch.to(device)
                    feats = rows(batch.index, lambda: target.features(b.input_ids, b.position_ids, b.doc_ids))
                    window.add(step_fn(b, feats))
                update(step + 1)
                step += 1
                first = step == start_step + 1
                if first:
                    log_first_step(step)
                    if cfg.train.checkpoint_every:  # host buffers pinned now rather than at the first checkpoint
                        ckpt.reserve(drafter, optimizer, scheduler)
                stop = budget.should_stop(step)
                if logger.should_log(step) or stop:  # a time-budget stop logs its last window too (log, plots)
                    extra = {"skipped": update.skipped(step), **update.grad_norms()}
                    logger.log(step, window.take(), scheduler.get_last_lr()[0], extra=extra)
                if first:  # the log windows start after the compiling first step (MetricsLogger.start_window)
                    if cfg.train.compile_times:
                        log_compile_times()
                    logger.start_window(step)
                if validator.due(step) or (stop and validator.enabled):
                    validator(step, step_fn, drafter, logger.history[-1]["tau_est"] if logger.history else None)
                if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step < setup.total_steps:
                    ckpt.save(step, drafter, optimizer, scheduler, data_position=step * per_step)
                    validator.mark_checkpoint(ckpt, step)
                profiler.after_step(step)
                if stop:
                    break
            profiler.finish(step)  # a run that ended inside the profiled window
            ckpt.save(step, drafter, optimizer, scheduler, data_position=step * per_step)
            validator.mark_checkpoint(ckpt, step)
        final, best = validator.finish(save_drafter(drafter, setup.out_dir / "drafter"))
    finally:
        logger.close()
    if cfg.run.plots:
        write_training_plots(setup.out_dir, logger.history, logger.val_history)
    log.info(validator.summary(step, budget.elapsed_s))
    if cfg.train.keeps_features:
        log.info(rows.summary())
        rows.release()  # the memory back, and the copier thread (host rows) ended
    if memory := peak_memory_line([device]):
        log.info(memory)
    log.info(f"done: {step} steps; servable drafter in {final}")
    return TrainResult(setup.out_dir, final, step, logger.history, update.skipped(step), logger.val_history, best,
                       setup.out_dir / "drafter_last" if best else None, data=setup.data_summary)
