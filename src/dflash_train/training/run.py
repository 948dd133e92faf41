"""Everything a training run needs before its first step, shared by the single-device trainer and the pipeline:
the run directory (training/rundir.py), tokenizer, data, the batch schedule, target sizes and a freshly sized (or
resumed) drafter."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import Config, ConfigError
from ..data.dataset import load_dataset, tokenized_cache_dir
from ..data.packing import DatasetSplit
from ..data.packing import BatchSchedule
from ..models.build import build_drafter, init_layers_from_target
from ..models.checkpoint import load_drafter
from ..models.drafter import DFlashDrafter
from ..models.target import TargetInfo, TargetModel, load_target, load_tokenizer, target_config_info
from .optim import follows_clock
from .rundir import RUN_CONFIG_NAME, hold_run_dir, prepare_out_dir, release_run_dir  # noqa: F401 - re-exported
from .validation import EPOCHS_WARN, data_passes_line

log = logging.getLogger("dflash_train")


# (cfg, run directory, tokenizer) -> (the DataConfig that reads the regenerated data, the regeneration's stats)
RegenerateFn = Callable[[Config, Path, object], tuple]



def load_training_target(cfg: Config, layer_ids: list[int], device: torch.device) -> TargetModel:
    """The frozen target as training uses it: the run's attention, and what its features carry beyond the taps (the
    final hidden state for distillation, train.kd_weight > 0; its own token probabilities for
    train.anchor_sampling=decoding). The single loop, the pipeline's target workers and the precompile child load it
    here, so their features always have the width the drafter step expects."""
    return load_target(cfg.model.target, layer_ids, device=device, attention=cfg.model.target_attention,
                       final_hidden=cfg.train.kd_weight > 0, anchor_weights=cfg.train.anchor_sampling == "decoding")

@dataclass
class RunSetup:
    cfg: Config
    out_dir: Path
    info: TargetInfo
    tokenizer: object | None
    data: DatasetSplit
    schedule: BatchSchedule
    total_steps: int
    batches_per_step: int   # batches one optimizer step consumes: replicas x train.accumulate
    drafter: DFlashDrafter
    data_summary: dict  # conversations, unique/supervised tokens, epochs the steps amount to, share per source


def build_run(cfg: Config, replicas: int = 1, out_dir: Path | None = None,
              regenerate: RegenerateFn | None = None) -> RunSetup:
    """replicas: drafter replicas over all processes, each training train.accumulate batches a step. out_dir:
    already made (and locked) by prepare_out_dir, else made and locked here, and unlocked again if the setup fails
    (on success the caller's hold_run_dir scope unlocks it). regenerate: data.regenerate's step
    (generation.run_data.regenerate_for_run), passed in by the layer that owns generation; needed when
    cfg.data.regenerate is set."""
    if out_dir is None:
        out_dir = prepare_out_dir(cfg)
        try:
            return build_run(cfg, replicas, out_dir, regenerate)
        except BaseException:
            release_run_dir(out_dir)
            raise
    out = out_dir
    torch.manual_seed(cfg.train.seed)
    synthetic = cfg.data.source == "synthetic"
    info = target_config_info(cfg.model.target)
    tokenizer = None if synthetic and cfg.model.target is not None else load_tokenizer(cfg.model.target)
    cache = tokenized_cache_dir(cfg.data, out)
    data_cfg = cfg.data
    if cfg.data.regenerate:  # the target rewrites the answers first; training then reads <out>/regenerated.jsonl
        if regenerate is None:
            raise RuntimeError("build_run: data.regenerate is set but no regenerate step was passed in")
        data_cfg, _ = regenerate(cfg, out, tokenizer)
    data = load_dataset(data_cfg, tokenizer, seed=cfg.train.seed, cache_dir=cache)
    if not data.train:
        raise ConfigError(f"data.source {cfg.data.source!r} produced no training conversations.")
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    rows = BatchSchedule(data.train, cfg.train.token_budget, cfg.train.num_anchors, cfg.train.seed, 1, pad_id)
    rows_per_epoch = rows.rows_per_epoch
    t = cfg.train
    batches_per_step = replicas * t.accumulate
    if t.max_steps:
        total_steps = t.max_steps
    else:
        total_steps = max(1, int(t.epochs * rows_per_epoch * t.steps_per_row) // batches_per_step)
        if t.max_minutes and t.budget_steps_per_s:  # the schedule ends when the time does, at most `epochs` passes
            fit = max(1, int(60 * t.max_minutes * t.budget_steps_per_s))
            if fit < total_steps:
                log.info(f"schedule: {fit} steps fit train.max_minutes={t.max_minutes:g} at "
                         f"train.budget_steps_per_s={t.budget_steps_per_s:g} ({total_steps} would make "
                         f"train.epochs={t.epochs:g})")
                total_steps = fit
        elif follows_clock(t):
            log.info(f"schedule: the LR follows the clock of train.max_minutes={t.max_minutes:g} (warm-up and "
                     f"cosine over the share of the time spent), at most {total_steps} steps "
                     f"(train.epochs={t.epochs:g})")
    schedule = BatchSchedule(data.train, cfg.train.token_budget, cfg.train.num_anchors, cfg.train.seed,
                             total_steps * batches_per_step, pad_id, repeats=t.steps_per_row,
                             fixed_rows=t.keeps_features, flat=rows.flat_samples())
    if cfg.model.drafter_init:
        drafter = load_drafter(cfg.model.drafter_init).float()
    else:
        drafter = build_drafter(cfg.model, info, tokenizer)
        if cfg.model.drafter_layer_init == "target":
            copied = init_layers_from_target(drafter, cfg.model.target)
            log.info(f"drafter layers start from the target's layers {copied}; fc from the identity on layer "
                     f"{max(drafter.config.target_layer_ids)}")
    log.info(f"target: {info.model_type}, {info.num_layers} layers, H={info.hidden_size}, vocab {info.vocab_size}; "
             f"drafter: {drafter.config.num_hidden_layers} layers, taps {drafter.config.target_layer_ids}, "
             f"mask id {drafter.config.mask_token_id}, "
             f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params")
    if t.anchor_sampling == "decoding":
        log.info(f"anchors: {t.num_anchors} a row, drawn where the target was unsure of its own token, as decoding "
                 "starts its blocks (train.anchor_sampling=decoding: weight 0.1 + (1 - p)); the target runs every "
                 "layer and its LM head once a row for p")
    per_row = f", {t.steps_per_row} steps per row (train.steps_per_row)" if t.steps_per_row > 1 else ""
    if t.accumulate > 1:
        per_row += f", {batches_per_step} rows per step ({t.accumulate} accumulated a replica: train.accumulate)"
    log.info(f"data: {len(data.train)} train / {len(data.heldout)} held-out conversations, {rows_per_epoch} rows of "
             f"{cfg.train.token_budget} tokens per epoch; {total_steps} steps{per_row}")
    # A data.mix may repeat a small source: its stats count each distinct conversation once.
    summary = {"conversations": len(data.train),
               "unique_tokens": data.stats.get("unique_tokens", sum(len(s.input_ids) for s in data.train)),
               "supervised_tokens": int(rows.flat_samples().mask.sum()),  # the demo's 27 M: 0.02 s, summing lists 0.8
               # passes over the rows, the schedule's (a clock may stop it); a row trains steps_per_row steps
               "epochs": total_steps * batches_per_step / (rows_per_epoch * t.steps_per_row),
               "rows_per_epoch": rows_per_epoch, "batches_per_step": batches_per_step,
               "steps_per_row": t.steps_per_row,
               "shares": {Path(r["source"]).stem: r["share"] for r in data.stats.get("sources", [])}}
    line, too_many = data_passes_line(summary["conversations"], summary["unique_tokens"],
                                      summary["supervised_tokens"], summary["epochs"], follows_clock(t))
    log.info(line)
    if too_many:
        log.warning(f"{line.removeprefix('data: ')}: past {EPOCHS_WARN:g} epochs a drafter may memorise its data "
                    "and do worse on prompts it never saw (16 epochs of 7.7 M tokens did; the GPU demo's 6 of 32 M "
                    "did not): watch validation's held-out tau, and if it stops rising add data (data.regenerate "
                    "with data.self_prompts, more conversations) or lower train.max_steps")
    if too_long := sum(len(s.input_ids) > cfg.train.token_budget for s in data.train):
        log.warning(f"{too_long} of {len(data.train)} training samples are longer than train.token_budget="
                    f"{cfg.train.token_budget} tokens: each is truncated to its first {cfg.train.token_budget} "
                    "tokens (raise train.token_budget to train on them whole)")
    return RunSetup(cfg, out, info, tokenizer, data, schedule, total_steps, batches_per_step, drafter, summary)
