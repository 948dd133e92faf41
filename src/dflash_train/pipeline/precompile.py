"""Compile validation's forward and the target's forward in a child process while the training step compiles here.

On a cold compile cache the pipeline starts with three compiles, one after the other because a CUDA graph capture
must not meet another thread's allocations: the drafter's training step (~200 s at the Qwen3-8B shape on one H200),
its forward-only validation step, then the target's feature forward (~50 s). What they compile depends on shapes and
settings only, not on weights or data. So a child process, whose CUDA context is its own (its captures cannot meet
this process's), compiles the last two from the run's config on inputs of the real shapes while this process
compiles the first, and leaves their kernels in the shared compile cache (training/startup.py). This process then
compiles those two as it always does, finding their kernels there: dynamo still traces and graphs are still
captured here; only inductor's and Triton's work is saved.

  parts = precompile_parts(cfg, validating)     # validation (first: it is needed first), target
  precompile = start_precompile(cfg, drafter_config, parts, target_device, drafter_device, scratch, child_bytes)
      None with pipeline.precompile=never, and (auto) where it cannot pay: not CUDA, nothing compiled, a cache warm
      at the run's start, or less free device memory than 3x the child's weights (it loads its own copy of the
      target, and frees it when it exits)
  ... the drafters compile their training step ...
  precompile.finish(timeout_s, beat)   before the target workers start; a child still running then is stopped

Off by default (pipeline.precompile=never): the one GPU measurement, the Qwen3-8B-shaped start-up benchmark of
2026-12-03 on one H200, had not reached its first step after 388 s with the child, against 304 s without it the run
before. Both compiles share the host's cores (each process its own pool of compile workers), and the training step's
compile is the long one; whether a child with fewer workers pays is not measured.

A failed or stopped child is a warning: this process compiles whatever the cache lacks itself, nothing else changes.
The child: `python -m dflash_train.pipeline.precompile CONFIG DRAFTER_CONFIG PARTS TARGET_DEVICE DRAFTER_DEVICE`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
import yaml

from ..config import Config, load_config
from ..models.checkpoint import drafter_class, drafter_config_from_json, drafter_config_json
from ..models.drafter import DrafterConfig
from ..models.target import FeatureForward
from ..training.cudagraphs import configure_cudagraphs
from ..training.run import load_training_target
from ..training.startup import compile_cache_dir, started_cold, use_compile_cache
from ..training.step import DrafterStep
from ..training.warmup import CompileWarmup
from .loader import dummy_batch

log = logging.getLogger("dflash_train")

MEMORY_FACTOR = 3  # free device memory needed, in multiples of the child's own weights (target + fp32 drafter x 2)


class Precompile(CompileWarmup):
    """The child process (module docstring); CompileWarmup's start, log, stop and clean-up."""

    def __init__(self, cfg: Config, drafter_config: DrafterConfig, parts: list[str], target_device: torch.device,
                 drafter_device: torch.device, scratch: Path):
        self.parts, self.devices = parts, (target_device, drafter_device)
        self.drafter_json = drafter_config_json(drafter_config)
        super().__init__(cfg, scratch, Path(scratch).parent / f"{Path(scratch).name}.log", name="precompile",
                         what=f"compiles the {' and the '.join(parts)} forward while the training step compiles here",
                         until="the training step compiled")

    def command(self, cfg: Config) -> list[str]:
        config, drafter = self.scratch / "config.yaml", self.scratch / "drafter_config.json"
        settings = cfg.to_dict()
        settings["train"]["compile_cache_dir"] = str(compile_cache_dir(cfg))  # this run's, wherever it came from
        config.write_text(yaml.safe_dump(settings, sort_keys=False))
        drafter.write_text(json.dumps(self.drafter_json))
        return [sys.executable, "-m", "dflash_train.pipeline.precompile", str(config), str(drafter),
                ",".join(self.parts), str(self.devices[0]), str(self.devices[1])]


def precompile_parts(cfg: Config, validating: bool) -> list[str]:
    """What a child would compile for this run: validation's forward (when the run validates through a compiled
    graph of its own, train.validation_graph=own) and the target's forward (when model.target_compile compiles it);
    with pipeline.precompile=always, both whatever they compile (the child then runs them as they are). Validation
    through the training graph has nothing of its own to compile: a child would compile the training step's forward
    beside this process. cfg: resolved."""
    forced = cfg.pipeline.precompile == "always"
    parts = []
    if validating and cfg.train.validation_graph == "own" and (forced or cfg.train.compile != "eager"):
        parts.append("validation")
    if forced or cfg.model.target_compile != "eager":
        parts.append("target")
    return parts


def start_precompile(cfg: Config, drafter_config: DrafterConfig, parts: list[str], target_device: torch.device,
                     drafter_device: torch.device, scratch: Path, child_bytes: int) -> Precompile | None:
    """The child (module docstring), or None: pipeline.precompile=never, nothing to compile, or (auto) when it cannot
    pay (a log line says why, except for CPU runs). child_bytes: the child's weights on the device (target + drafter
    in fp32 with its gradients)."""
    if not parts or cfg.pipeline.precompile == "never":
        return None
    if cfg.pipeline.precompile == "always":
        return _start(cfg, drafter_config, parts, target_device, drafter_device, scratch)
    if target_device.type != "cuda" or drafter_device.type != "cuda":
        return None
    if not started_cold(compile_cache_dir(cfg)):  # this process loads what it needs faster than a child could start
        log.info(f"compile: {' and '.join(parts)} compile after the training step (the compile cache was warm at "
                 "the start)")
        return None
    free = min(torch.cuda.mem_get_info(d)[0] for d in {target_device, drafter_device})
    if free < MEMORY_FACTOR * child_bytes:
        log.info(f"compile: {' and '.join(parts)} compile after the training step, not beside it in a child process "
                 f"({free / 2**30:.0f} GiB free on the device, {MEMORY_FACTOR} x {child_bytes / 2**30:.0f} GiB "
                 "wanted)")
        return None
    return _start(cfg, drafter_config, parts, target_device, drafter_device, scratch)


def _start(cfg, drafter_config, parts, target_device, drafter_device, scratch) -> Precompile | None:
    try:
        return Precompile(cfg, drafter_config, parts, target_device, drafter_device, scratch)
    except OSError as e:  # the scratch directory or the process cannot be made: only time is lost
        log.warning(f"compile: no child process for {' and '.join(parts)} ({e}); they compile here, after the "
                    "training step")
        return None


def main(argv: list[str]) -> int:
    """The child: compile `parts` of the run in CONFIG (resolved) into its compile cache, on inputs of the real
    shapes, exactly as the pipeline's workers call them (DrafterWorker._warm_up, TargetWorker.setup)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config, drafter_json, parts, target_device, drafter_device = argv
    cfg = load_config(config)
    configure_cudagraphs()  # the parent's compile policy, before anything compiles
    use_compile_cache(cfg)
    dcfg = drafter_config_from_json(json.loads(Path(drafter_json).read_text()))
    t = cfg.train
    target = load_training_target(cfg, dcfg.target_layer_ids, torch.device(target_device))
    batch = dummy_batch(t.token_budget, t.num_anchors)
    for part in parts.split(","):
        t0 = time.perf_counter()
        if part == "validation":  # replica 0's forward-only step: the same tag, so the same compiled code
            dev = torch.device(drafter_device)
            with torch.device(dev):
                drafter = drafter_class(dcfg)(dcfg).float().train()
            step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, t, dev, tag="0")
            b = batch.to(dev)
            feats = torch.zeros(t.token_budget, step.feats_width, device=dev, dtype=step.dtype)
            for _ in range(2):
                step.evaluate(b, feats)
            del step, drafter, feats  # room for the target's part
        elif part == "target":
            forward = FeatureForward(target, t.token_budget, cfg.model.target_compile, cfg.model.target_graphs,
                                     layers=cfg.model.target_compile_layers)
            b = batch.to(target.device)
            forward(b.input_ids, b.position_ids, b.doc_ids)
        log.info(f"precompile: {part} compiled in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    from ..beside import exit_with_parent

    exit_with_parent()  # a run killed outright leaves no child compiling (beside.py)
    sys.exit(main(sys.argv[1:]))
