"""Everything a training run needs before its first step, shared by the single-device trainer and the pipeline:
the run directory, tokenizer, data, the batch schedule, target sizes and a freshly sized (or resumed) drafter."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..config import Config, ConfigError
from ..data.dataset import DatasetSplit, load_dataset
from ..data.packing import BatchSchedule
from ..models.build import build_drafter
from ..models.checkpoint import load_drafter
from ..models.drafter import DFlashDrafter
from ..models.target import TargetInfo, load_tokenizer, target_config_info
from .validation import EPOCHS_WARN, data_passes_line

log = logging.getLogger("dflash_train")
RUN_CONFIG_NAME = "run_config.yaml"
# Keys that may differ between a run and its resumption without making it "a different run".
_RESUMABLE_KEYS = {("run", "resume"), ("run", "overwrite"), ("train", "log_every"), ("train", "checkpoint_every"),
                   ("train", "keep_checkpoints"), ("pipeline", "stall_timeout_s"), ("pipeline", "queue_depth"),
                   ("train", "max_minutes"), ("train", "nonfinite"), ("model", "target_graphs"),
                   ("pipeline", "grad_reduce")}


@dataclass
class RunSetup:
    cfg: Config
    out_dir: Path
    info: TargetInfo
    tokenizer: object | None
    data: DatasetSplit
    schedule: BatchSchedule
    total_steps: int
    batches_per_step: int
    drafter: DFlashDrafter


def _comparable(d: dict) -> dict:
    return {s: {k: v for k, v in sec.items() if (s, k) not in _RESUMABLE_KEYS} for s, sec in d.items()}


def _with_defaults(saved: dict) -> dict:
    """A saved run config with the keys it predates at their defaults: a field added to the config since the run
    was written does not make it 'a different run' as long as the resumed run leaves it at its default."""
    full = Config().to_dict()
    for section, values in saved.items():
        full.setdefault(section, {}).update(values if isinstance(values, dict) else {})
    return full


def prepare_out_dir(cfg: Config, owner: bool = True) -> Path:
    """Create the run directory; the owner (rank 0 of a torchrun launch) refuses to mix two different runs in one
    directory and writes run_config.yaml. Other ranks may name per-node paths (model.target, data.source, devices)
    that differ from rank 0's; what must agree is checked by the start gate (pipeline/distributed.py)."""
    out = Path(cfg.run.out_dir)
    if not owner:
        out.mkdir(parents=True, exist_ok=True)
        return out
    saved = out / RUN_CONFIG_NAME
    if saved.is_file() and not cfg.run.overwrite:
        old = yaml.safe_load(saved.read_text()) or {}
        if _comparable(_with_defaults(old)) != _comparable(cfg.to_dict()):
            raise ConfigError(f"{out} already holds a different run; choose another run.out_dir, or pass "
                              "run.overwrite=true to train over it.")
    out.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a reader never sees a partial file.
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{RUN_CONFIG_NAME}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, saved)
    return out


def build_run(cfg: Config, batches_per_step: int = 1, out_dir: Path | None = None) -> RunSetup:
    """out_dir: already made by prepare_out_dir (else made here)."""
    out = out_dir or prepare_out_dir(cfg)
    torch.manual_seed(cfg.train.seed)
    synthetic = cfg.data.source == "synthetic"
    info = target_config_info(cfg.model.target)
    tokenizer = None if synthetic and cfg.model.target is not None else load_tokenizer(cfg.model.target)
    cache = cfg.data.cache_dir or str(out.parent / ".cache")
    data_cfg = cfg.data
    if cfg.data.regenerate:  # the target rewrites the answers first; training then reads <out>/regenerated.jsonl
        from ..data.regenerate import regenerate_for_run
        data_cfg = regenerate_for_run(cfg, out, tokenizer)
    data = load_dataset(data_cfg, tokenizer, seed=cfg.train.seed, cache_dir=cache)
    if not data.train:
        raise ConfigError(f"data.source {cfg.data.source!r} produced no training conversations.")
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    rows = BatchSchedule(data.train, cfg.train.token_budget, cfg.train.num_anchors, cfg.train.seed, 1, pad_id)
    rows_per_epoch = rows.rows_per_epoch
    if cfg.train.max_steps:
        total_steps = cfg.train.max_steps
    else:
        total_steps = max(1, int(cfg.train.epochs * rows_per_epoch) // batches_per_step)
    schedule = BatchSchedule(data.train, cfg.train.token_budget, cfg.train.num_anchors, cfg.train.seed,
                             total_steps * batches_per_step, pad_id)
    if cfg.model.drafter_init:
        drafter = load_drafter(cfg.model.drafter_init).float()
    else:
        drafter = build_drafter(cfg.model, info, tokenizer)
    log.info(f"target: {info.model_type}, {info.num_layers} layers, H={info.hidden_size}, vocab {info.vocab_size}; "
             f"drafter: {drafter.config.num_hidden_layers} layers, taps {drafter.config.target_layer_ids}, "
             f"mask id {drafter.config.mask_token_id}, "
             f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params")
    log.info(f"data: {len(data.train)} train / {len(data.heldout)} held-out conversations, {rows_per_epoch} rows of "
             f"{cfg.train.token_budget} tokens per epoch; {total_steps} steps")
    line, too_many = data_passes_line(len(data.train), sum(len(s.input_ids) for s in data.train),
                                      sum(sum(s.loss_mask) for s in data.train),
                                      total_steps * batches_per_step / rows_per_epoch)
    log.info(line)
    if too_many:
        log.warning(f"{line.removeprefix('data: ')}: past {EPOCHS_WARN:g} epochs a drafter memorises its data and "
                    "does worse on prompts it never saw; add data (data.regenerate with data.self_prompts, more "
                    "conversations) or lower train.max_steps")
    if too_long := sum(len(s.input_ids) > cfg.train.token_budget for s in data.train):
        log.warning(f"{too_long} of {len(data.train)} training samples are longer than train.token_budget="
                    f"{cfg.train.token_budget} tokens: each is truncated to its first {cfg.train.token_budget} "
                    "tokens (raise train.token_budget to train on them whole)")
    return RunSetup(cfg, out, info, tokenizer, data, schedule, total_steps, batches_per_step, drafter)
