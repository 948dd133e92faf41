"""Fast start: torch.compile's caches kept across runs, and the time from the command to the first step.

Inductor keeps what it compiled (the FX graph cache: generated kernels and their wrappers; the AOT autograd cache:
the joint forward/backward graphs; Triton's kernels under it on CUDA) in one directory, TORCHINDUCTOR_CACHE_DIR, by
default a temporary one that a fresh machine does not have. `use_compile_cache` points it at a directory beside the
run's data cache, so a second run of the same shapes loads its kernels instead of compiling them (dynamo still traces
and CUDA graphs are still captured on each start: neither is cacheable). It is called once by the training entry
(train.py), never on import, before anything compiles.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import Config

log = logging.getLogger("dflash_train")
ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"
CACHED_PARTS = ("fxgraph", "aotautograd")  # inductor's subdirectories of reusable compiled graphs
SWITCHES = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")  # torch's own off switches


def compile_cache_dir(cfg: Config) -> Path:
    """train.compile_cache_dir; empty: TORCHINDUCTOR_CACHE_DIR when the environment sets it, else
    <data cache>/torch_compile (data.cache_dir, or <out_dir>/../.cache as for the tokenized data)."""
    if cfg.train.compile_cache_dir:
        return Path(cfg.train.compile_cache_dir).expanduser().resolve()
    if (env := os.environ.get(ENV_VAR)) and env != _torch_default_dir():
        return Path(env).expanduser().resolve()
    data_cache = cfg.data.cache_dir or str(Path(cfg.run.out_dir).expanduser().parent / ".cache")
    return (Path(data_cache).expanduser() / "torch_compile").resolve()


def _torch_default_dir() -> str:
    """Inductor's own default, which it also writes into the environment once imported: not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def use_compile_cache(cfg: Config) -> Path | None:
    """Make inductor read and write its caches in compile_cache_dir(cfg) (process-wide: every later compile of
    this process, in any thread) and log whether it starts warm. Returns the directory, or None when it cannot be
    made (a warning: a cache only saves time; torch's default stays, and a bad run.out_dir is reported by the run
    directory's own check). Through the environment: inductor reads it at each cache lookup, and its two switches
    (SWITCHES) are on unless the environment says 0."""
    d = compile_cache_dir(cfg)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning(f"compile cache: {d} cannot be created ({e.strerror or e}); compiles use torch's default cache "
                    "directory; set train.compile_cache_dir to a writable directory to keep them across machines")
        return None
    os.environ[ENV_VAR] = str(d)  # cache_dir_utils.cache_dir() reads it at every lookup
    cached = compiled_artifacts(d)
    _AT_START[d] = cached
    state = f"warm: {cached} compiled artifacts from earlier runs" if cached else "cold: compiling fills it"
    off = [name for name in SWITCHES if os.environ.get(name) == "0"]
    disabled = f"; turned off by {' and '.join(f'{n}=0' for n in off)}" if off else ""
    log.info(f"compile cache: {d} ({state}{disabled})")
    return d


def compiled_artifacts(d: Path) -> int:
    """How many reusable compiled graphs the compile cache `d` holds (0: cold, or no such directory)."""
    return sum(1 for part in CACHED_PARTS for p in (Path(d) / part).rglob("*") if p.is_file())


_AT_START: dict[Path, int] = {}  # compile cache -> its artifacts when use_compile_cache pointed this process at it


def started_cold(d: Path) -> bool:
    """Whether this process found the compile cache `d` empty when it started using it (use_compile_cache), so
    that what the run compiled itself since (the target's flex kernels while it computed validation's features, for
    one) does not count; a cache this process never set up is judged as it is now."""
    d = Path(d).resolve()
    return (_AT_START[d] if d in _AT_START else compiled_artifacts(d)) == 0


def rebase_cold_start(cfg: Config) -> None:
    """From now on started_cold judges cfg's compile cache as it is at this call: for a caller that filled it on
    purpose before training starts (the demo's warm-up child), so that the pipeline does not compile again what is
    there."""
    d = compile_cache_dir(cfg)
    _AT_START[d] = compiled_artifacts(d)


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started, read from /proc (Linux); None where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        start_ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def log_first_step(step: int) -> None:
    """The start-up cost users wait for: loading, tokenizing, compiling and warming up, until the first step."""
    age = seconds_since_process_start()
    if age is not None:
        log.info(f"first step (step {step}) done {age:.1f} s after the command started")


def log_compile_times() -> None:
    """torch.compile's own account of where this process's compiling went (seconds per timed stage, summed over
    every graph compiled so far, in every thread): train.compile_times. Nothing when nothing was compiled."""
    from torch._dynamo.utils import compile_times

    table = compile_times(repr="str", aggregate=True)
    if table and len(table.splitlines()) > 2:  # a title and a header line: nothing compiled
        log.info(f"compile times (train.compile_times):\n{table}")
