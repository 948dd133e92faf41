"""Compile the training step while the target regenerates the training data.

A run that regenerates its data (data.regenerate) spends minutes decoding on the GPU with the CPU mostly idle, then
compiles its training step (the drafter's forward and backward, the validation forward, the target's flex kernels):
on one H200 at the SmolLM2 demo's shapes ~2 minutes from the end of regeneration to the first step. The compiled
code depends only on the shapes and settings, not on the data, so a child process can compile the same step from a
few of the source's own conversations while regeneration runs, and leave its kernels in the compile cache
(training/startup.py) that the run then reads:

  with CompileWarmup(cfg, scratch, log_path) as warmup:   (demo.py; pipeline/precompile.py for its own parts)
    child: `dflash-train train` with the run's config, but 2 steps on data.max_samples=WARMUP_SAMPLES conversations
    of data.source as they are (no regeneration, no self-written prompts), into `scratch`, sharing the compile cache
  ... regenerate ...
  warmup.finish(timeout_s)   waits for it (compiling the same step twice at once would only slow both), kills it
                             past the timeout; a failed warm-up is a warning, never the run's failure

Only a cache is shared: the run compiles as it would without the warm-up, just faster when the cache holds its
kernels. Dynamo still traces and CUDA graphs are still captured in the run (neither can be cached).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from ..beside import start_beside
from ..config import Config
from .startup import compile_cache_dir

log = logging.getLogger("dflash_train")

WARMUP_SAMPLES = 512  # enough conversations to fill the rows of two steps and a validation row
TAIL_LINES = 12       # of the child's log, quoted when it fails
POLL_S = 0.5          # finish()'s wait between looks at the child


def warmup_overrides(cfg: Config, scratch: Path) -> list[str]:
    """What the child changes in the run's config: its data (a few source conversations as they are), its length
    (two steps, then the validation every run ends with, when it has any), its directories; and the run's compile
    cache, so that what it compiles lands where the run looks."""
    return ["data.regenerate=false", "data.self_prompts=0", f"data.max_samples={WARMUP_SAMPLES}",
            f"data.cache_dir={scratch / 'cache'}", "train.max_steps=2", "train.max_minutes=null",
            "train.final_eval_prompts=0", "train.checkpoint_every=0",
            f"train.compile_cache_dir={compile_cache_dir(cfg)}", f"run.out_dir={scratch / 'run'}",
            "run.overwrite=true", "run.resume=never"]


class CompileWarmup:
    """The child process compiling the run's step (see the module docstring). name, what, until: how the log names
    it, what it does meanwhile, and what the run does while it works (pipeline/precompile.py's child reuses this)."""

    def __init__(self, cfg: Config, scratch: Path, log_path: Path, name: str = "compile warm-up",
                 what: str = "compiles the training step while the target regenerates",
                 until: str = "the regeneration ended"):
        self.name, self.until = name, until
        self.scratch, self.log_path = Path(scratch), Path(log_path)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        with open(self.log_path, "w", encoding="utf-8") as out:
            # its own process group: finish() can stop it together with any compile workers it started; at a
            # lower CPU priority than the run, whose work is the critical path (beside.py)
            self.proc = start_beside(self.command(cfg), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.info(f"{name}: a child process (pid {self.proc.pid}) {what}; its log: {self.log_path}")

    def command(self, cfg: Config) -> list[str]:
        """The child's command line: `dflash-train train` on the run's config (written into the scratch directory)
        with warmup_overrides."""
        config = self.scratch / "config.yaml"
        config.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return [sys.executable, "-m", "dflash_train.cli", "train", "--config", str(config),
                *warmup_overrides(cfg, self.scratch)]

    def finish(self, timeout_s: float, beat: Callable[[], None] = lambda: None,
               stopping: Callable[[], bool] = lambda: False) -> bool:
        """Wait up to timeout_s for the child, calling beat() about every POLL_S (a watchdog's heartbeat); True when
        it compiled and exited cleanly. Past the timeout, or once stopping() (the run is ending), it is stopped (the
        run then compiles what the cache lacks itself). The scratch directory is removed."""
        waited = time.monotonic()
        early = self.proc.poll() is not None  # it ended while the run did the rest (regenerated, compiled)
        try:
            while self.proc.poll() is None and time.monotonic() - waited < timeout_s and not stopping():
                beat()
                time.sleep(POLL_S)
            rc = self.proc.poll()
            if rc is None:
                self._stop()
                if not stopping():
                    log.warning(f"{self.name}: not done {timeout_s:.0f} s after {self.until}; stopped (the "
                                "run compiles what the cache lacks itself)")
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if rc == 0:
            when = f"before {self.until}" if early else f"{time.monotonic() - waited:.0f} s after {self.until}"
            log.info(f"{self.name}: done {when}")
            return True
        if rc is not None:
            tail = "\n".join(self._tail())
            log.warning(f"{self.name}: the child exited with {rc} (the run compiles from scratch; nothing else "
                        f"changes); the end of {self.log_path}:\n{tail}")
        return False

    def _stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def _tail(self) -> list[str]:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:]
        except OSError:
            return []

    def __enter__(self) -> CompileWarmup:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # the caller failed before finish(): never leave the child behind
            self._stop()
        shutil.rmtree(self.scratch, ignore_errors=True)


def wants_warmup(cfg: Config) -> bool:
    """A warm-up pays when the run regenerates first (minutes of a mostly idle CPU) and compiles its step.
    cfg: with "auto" decided (devices.resolve_config)."""
    return cfg.data.regenerate and cfg.train.compile != "eager"
