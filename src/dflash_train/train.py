"""`dflash-train train` as a library call: train (the threaded pipeline, or the single-device reference loop), then
measure the drafter it wrote with speculative decoding on prompts it never trained on (inference/measure.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .config import Config

log = logging.getLogger("dflash_train")


def train(cfg: Config, single: bool = False):
    """-> TrainResult (PipelineResult for the pipeline) with `.measured` set to the EvalReport summary of the
    measurement after training (None when train.final_eval_prompts is 0, or on ranks other than 0)."""
    from .pipeline.coordinator import run_log_file, train_pipeline
    from .pipeline.devices import resolve_pipeline_devices
    from .training.trainer import train_single_device

    result = train_single_device(cfg) if single else train_pipeline(cfg)
    if cfg.train.final_eval_prompts > 0 and int(os.environ.get("RANK", "0")) == 0:
        from .inference.measure import measure_acceptance

        device = resolve_pipeline_devices(cfg.pipeline)[1][0]  # the first drafter device
        with run_log_file(Path(result.out_dir)):
            report = measure_acceptance(cfg, result.drafter_dir, device, result)
            result.measured = report.summary() if report is not None else None
    return result
