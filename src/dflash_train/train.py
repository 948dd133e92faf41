"""`dflash-train train` as a library call: train (the threaded pipeline, or the single-device reference loop), then
measure the drafter it wrote with speculative decoding on prompts it never trained on (inference/measure.py), and
say how to serve it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .config import Config

log = logging.getLogger("dflash_train")


def train(cfg: Config, single: bool = False):
    """-> TrainResult (PipelineResult for the pipeline) with `.measured` set to the EvalReport summary of the
    measurement after training (None when train.final_eval_prompts is 0, or on ranks other than 0)."""
    from .training.startup import use_compile_cache

    use_compile_cache(cfg)  # first: importing the stages below imports inductor, which settles on a directory
    from .models.checkpoint import load_drafter_config, serve_commands
    from .pipeline.coordinator import run_log_file, train_pipeline
    from .devices import resolve_pipeline_devices
    from .training.trainer import train_single_device

    from .generation.run_data import regenerate_for_run

    result = train_single_device(cfg, regenerate=regenerate_for_run) if single else train_pipeline(cfg)
    if int(os.environ.get("RANK", "0")) != 0:
        return result
    with run_log_file(Path(result.out_dir)):  # appended to the run's log, after training's own lines
        if cfg.train.final_eval_prompts > 0:
            from .inference.measure import measure_acceptance

            device = resolve_pipeline_devices(cfg.pipeline)[1][0]  # the first drafter device
            report = measure_acceptance(cfg, result.drafter_dir, device, result)
            result.measured = report.summary() if report is not None else None
        target = cfg.model.target or "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default's hub name
        commands = serve_commands(load_drafter_config(result.drafter_dir), str(result.drafter_dir), target)
        log.info("serve the drafter:\n" + commands.rstrip())
    return result
