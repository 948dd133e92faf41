"""Step checkpoints: a servable drafter plus the training state beside it, written atomically.

  <out_dir>/checkpoints/step_00000100/   config.json, model.safetensors  (servable as-is)
                                         training_state.pt              (optimizer, scheduler, step, RNG, data pos)
  <out_dir>/checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, its files fsynced, and renamed into place only when
complete; `latest` is replaced atomically after that: a crash (or SIGKILL, or a full disk) mid-write can never make
a half-written checkpoint `latest`. A failed write removes its temporary directory; a full disk is a CheckpointError
(a UserError) naming the directory. On load, a checkpoint that fails validation is reported and the previous one used.

RNG: training draws no random numbers from global generators (the data order is seeded by (seed, epoch), each
batch's anchors by (seed, batch index)), so the data position alone resumes data and anchors exactly. The global
states (python, numpy, torch CPU, every CUDA device: process-wide, shared by all worker threads) are saved anyway,
so a future random op cannot silently break exact resume.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import SafetensorError

from ..models.checkpoint import CheckpointError, load_drafter, save_drafter
from ..models.drafter import DFlashDrafter

log = logging.getLogger("dflash_train")
STATE_NAME = "training_state.pt"
STATE_KEYS = ("step", "data_position", "optimizer", "scheduler", "rng")
LOW_SPACE_BYTES = 64 << 20  # a write that fails with less than this free is reported as a full disk


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir_tree(d: Path) -> None:
    """Flush every file of `d` and `d` itself to disk, so the rename that publishes it publishes whole files."""
    for f in d.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(d)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(e: BaseException, where: Path) -> bool:
    """ENOSPC/EDQUOT, or a writer that hides the errno (torch.save's zip writer, safetensors' Rust writer) failing
    while the disk has (almost) no space left."""
    if not isinstance(e, (OSError, RuntimeError, SafetensorError)):
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if os.strerror(errno.ENOSPC) in str(e):
        return True
    try:
        return shutil.disk_usage(where).free < LOW_SPACE_BYTES
    except OSError:
        return False


def validate_training_state(state, path: Path) -> None:
    """Raise CheckpointError unless `state` is a training state for the step its directory is named after."""
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise CheckpointError(f"{path / STATE_NAME} lacks {', '.join(missing)}.")
    if path.name.startswith("step_") and int(path.name[5:]) != state["step"]:
        raise CheckpointError(f"{path / STATE_NAME} holds step {state['step']}, not the step its directory names.")


class CheckpointManager:
    def __init__(self, out_dir: str | Path, keep: int = 3):
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep
        # Called by the writing thread between the weights and the training state (fault injection, tests).
        self.mid_write: Callable[[], None] | None = None

    def step_dirs(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary directories start with '.' and are ignored)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_"))

    def save(self, step: int, drafter: DFlashDrafter, optimizer, scheduler, data_position: int,
             extra: dict | None = None) -> Path:
        name = f"step_{step:08d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            save_drafter(drafter, tmp)
            if self.mid_write is not None:
                self.mid_write()
            state = {"step": step, "data_position": data_position, "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "rng": rng_state(), "extra": extra or {}}
            torch.save(state, tmp / STATE_NAME)
            _fsync_dir_tree(tmp)
            if final.exists():  # re-saving the same step (e.g. final == last periodic): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / "latest", name + "\n")
        except BaseException as e:
            full = _disk_full(e, self.root)  # before freeing the space this write took
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                previous = self.latest()
                kept = f"the previous checkpoint, {previous.name}, is intact" if previous else "no checkpoint is kept"
                raise CheckpointError(f"The disk is full: checkpoint {name} could not be written to {self.root} "
                                      f"({kept}); free space there or point run.out_dir at a disk with room.") from e
            raise
        self._prune()
        log.info(f"checkpoint saved: {final}")
        return final

    def _prune(self):
        dirs = self.step_dirs()
        for old in dirs[: max(0, len(dirs) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp"):  # left by a process killed mid-write
            shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        p = self.root / "latest"
        if p.is_file():
            d = self.root / p.read_text().strip()
            if d.is_dir():
                return d
        dirs = self.step_dirs()
        return dirs[-1] if dirs else None

    def load_latest(self, device="cpu") -> tuple[DFlashDrafter, dict, Path] | None:
        """(drafter, training_state, path) of the newest checkpoint that loads; a broken one is reported and the
        previous one is tried. None when there is no usable checkpoint."""
        candidates = self.step_dirs()
        first = self.latest()
        if first is not None and first in candidates:
            candidates = [c for c in candidates if c <= first]
        for d in reversed(candidates):
            try:
                drafter = load_drafter(d, device)
                state = torch.load(d / STATE_NAME, map_location="cpu", weights_only=False)
                validate_training_state(state, d)
                return drafter, state, d
            except Exception as e:  # noqa: BLE001 - report and fall back to the previous checkpoint
                log.warning(f"checkpoint {d} failed to load ({type(e).__name__}: {e}); trying the previous one")
        return None


def resume_point(resume: str, ckpt: CheckpointManager, fresh: DFlashDrafter) -> tuple[DFlashDrafter, dict | None]:
    """(initial drafter, training state or None): the latest good checkpoint when run.resume=auto (its RNG states
    restored), else `fresh`. Shared by the reference trainer and the pipeline so both resume the same way."""
    if resume == "auto" and (found := ckpt.load_latest()) is not None:
        drafter, state, path = found
        set_rng_state(state["rng"])
        log.info(f"resuming from {path} at step {state['step']}")
        return drafter, state
    return fresh, None
