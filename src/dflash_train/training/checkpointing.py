"""Step checkpoints: a servable drafter plus the training state beside it, written atomically.

  <out_dir>/checkpoints/step_00000100/   config.json, model.safetensors  (servable as-is)
                                         training_state.pt              (optimizer, scheduler, step, RNG, data pos)
  <out_dir>/checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed into place only when complete, and `latest`
is replaced atomically after that: a crash mid-write can never make a half-written checkpoint `latest`.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..models.checkpoint import load_drafter, save_drafter
from ..models.drafter import DFlashDrafter

log = logging.getLogger("dflash_train")
STATE_NAME = "training_state.pt"


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
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, out_dir: str | Path, keep: int = 3):
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep

    def step_dirs(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary directories start with '.' and are ignored)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_"))

    def save(self, step: int, drafter: DFlashDrafter, optimizer, scheduler, data_position: int,
             extra: dict | None = None) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:08d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        state = {"step": step, "data_position": data_position, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_state(), "extra": extra or {}}
        torch.save(state, tmp / STATE_NAME)
        if final.exists():  # re-saving the same step (e.g. final == last periodic): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(self.root / "latest", name + "\n")
        self._prune()
        log.info(f"checkpoint saved: {final}")
        return final

    def _prune(self):
        dirs = self.step_dirs()
        for old in dirs[: max(0, len(dirs) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

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
                return drafter, state, d
            except Exception as e:  # noqa: BLE001 - report and fall back to the previous checkpoint
                log.warning(f"checkpoint {d} failed to load ({type(e).__name__}: {e}); trying the previous one")
        return None
