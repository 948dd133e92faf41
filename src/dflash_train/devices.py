"""One rule for turning a device name a user wrote into a torch.device, shared by every command."""

from __future__ import annotations

import os

import torch

from .config import ConfigError, PipelineConfig


def parse_device(name: str | int, source: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda:N' | N -> torch.device; `source` names where the value came from (for the error).

    'auto' is cuda:LOCAL_RANK when CUDA is visible (under torchrun each process of a node takes its own GPU; plain
    runs get cuda:0), else cpu."""
    name = str(name).strip()
    if name == "auto":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    if name.isdigit():  # `[0]` / `[1, 2, 3]`: GPU indices
        name = f"cuda:{name}"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{source} entry {name!r} is not a device; use 'cpu', 'cuda:N', N or 'auto'.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{source} asks for {name} but no CUDA device is visible; use 'cpu' or 'auto'.")
        dev = torch.device("cuda", dev.index or 0)
        if dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{source} asks for {dev} but only {torch.cuda.device_count()} CUDA device(s) are "
                              "visible.")
    elif dev.type != "cpu":
        raise ConfigError(f"{source} entry {name!r}: only 'cpu' and CUDA devices are supported.")
    return dev


def resolve_pipeline_devices(cfg: PipelineConfig) -> tuple[list[torch.device], list[torch.device]]:
    """(target devices, drafter devices). One drafter replica per CUDA device (each captures its own CUDA graphs
    on its device); CPU may repeat, which is how the tests run several replicas on one machine."""
    targets = [parse_device(d, "pipeline.target_devices") for d in cfg.target_devices]
    drafters = [parse_device(d, "pipeline.drafter_devices") for d in cfg.drafter_devices]
    cuda = [d for d in drafters if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        raise ConfigError(f"pipeline.drafter_devices {[str(d) for d in drafters]} repeats a CUDA device; use one "
                          "drafter replica per GPU.")
    if len({d.type for d in drafters}) > 1:
        raise ConfigError("pipeline.drafter_devices mixes CPU and CUDA devices; replicas must be on the same kind of "
                          "device to stay bit-identical.")
    return targets, drafters
