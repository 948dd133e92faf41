"""What "auto" means on this machine, decided in one place: a device name a user wrote -> torch.device
(parse_device, shared by every command), and a run's Config with every device-dependent "auto" replaced by a concrete
value (resolve_config), called once at the start of a run: the stages below it only ever see concrete values."""

from __future__ import annotations

import dataclasses
import os

import torch

from .config import Config, ConfigError, PipelineConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Each device-dependent "auto": (on CUDA, elsewhere). Off CUDA there are no CUDA graphs for reduce-overhead to
# capture, flex attention would compile a kernel per shape for no gain, and bf16 matmuls are slower than fp32.
AUTO = {"compile": ("reduce-overhead", "eager"), "attention": ("flex", "sdpa"), "dtype": ("bf16", "fp32")}


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


def choose(key: str, value: str, devices: list[torch.device]) -> str:
    """`value`, or for "auto" AUTO[key]'s CUDA choice when every one of `devices` is a CUDA device, else the other."""
    if value != "auto":
        return value
    on_cuda, elsewhere = AUTO[key]
    return on_cuda if all(d.type == "cuda" for d in devices) else elsewhere


def compute_dtype(value: str, device: torch.device) -> torch.dtype:
    """bf16 | fp32 | auto -> the torch dtype computed in on `device`."""
    return DTYPES[choose("dtype", value, [device])]


def resolve_config(cfg: Config, single: bool = False) -> Config:
    """cfg with every "auto" decided for this machine: the pipeline's devices (parse_device), train.compile,
    train.attention and train.dtype for the drafter devices (one kind: resolve_pipeline_devices), and
    model.target_attention for the devices the target runs on (the first drafter device in the single-device loop,
    `single`). The run directory keeps the config as written, so a resume on another machine decides again."""
    targets, drafters = resolve_pipeline_devices(cfg.pipeline)
    if single:
        targets = drafters[:1]
    t = cfg.train
    train = dataclasses.replace(t, compile=choose("compile", t.compile, drafters),
                                attention=choose("attention", t.attention, drafters),
                                dtype=choose("dtype", t.dtype, drafters))
    model = dataclasses.replace(cfg.model, target_attention=choose("attention", cfg.model.target_attention, targets))
    pipeline = dataclasses.replace(cfg.pipeline, target_devices=[str(d) for d in targets],
                                   drafter_devices=[str(d) for d in drafters])
    return dataclasses.replace(cfg, model=model, train=train, pipeline=pipeline)


def cuda_memory_available(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA device: the driver's free memory plus what this process's
    caching allocator holds reserved but unused. Freed tensors (a finished training's, say) stay reserved until
    torch.cuda.empty_cache(), and mem_get_info alone counts them as taken."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def peak_memory_line(devices: list[torch.device]) -> str | None:
    """The run's peak of allocated memory on each CUDA device it used (what a batch size or train.feature_cache_gb
    can still take), or None without one."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not cuda:
        return None
    gib = 2**30
    parts = [f"{d} {torch.cuda.max_memory_allocated(d) / gib:.1f} of "
             f"{torch.cuda.get_device_properties(d).total_memory / gib:.0f} GiB" for d in cuda]
    return "peak GPU memory allocated: " + ", ".join(parts)

