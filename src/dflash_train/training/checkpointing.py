"""Step checkpoints: a servable drafter plus the training state beside it, written atomically.

  <out_dir>/checkpoints/step_00000100/   config.json, model.safetensors, modeling_dflash.py, serve.txt
                                                                        (servable as-is, bf16: models/checkpoint.py)
                                         training_weights.safetensors   (the fp32 master weights, unrounded)
                                         training_state.pt              (optimizer, scheduler, step, RNG, data pos)
  <out_dir>/checkpoints/latest           the name of the newest complete checkpoint
  <out_dir>/checkpoints/best             JSON {name, step, metric, value, run_id}: the checkpoint mark_best named
  <out_dir>/run_id                       this run's id (written by training/run.py:prepare_out_dir)

Saving takes a snapshot on the caller's thread (every tensor copied to host memory: pinned buffers filled on a side
stream on CUDA, plain clones on the CPU; the drafter as a DrafterSnapshot, its config and those copies, no module
built) and writes it on a background thread, so training goes on while the disk works. One write is in flight at
most: the next save, `wait()` and `close()` wait for it (its host copy is what bounds the memory) and raise its
error, so a failed write is never lost. A checkpoint is written into a hidden temporary directory, its files
fsynced, and renamed into place only when complete; `latest` is replaced atomically after that: a crash (or SIGKILL,
or a full disk) mid-write can never make a half-written checkpoint `latest`. Resume loads
training_weights.safetensors (exact: the fp32 weights the optimizer state belongs to) and checks that the servable
model.safetensors is their bf16 rounding. A failed write removes its temporary directory; a full disk is a
CheckpointError (a UserError) naming the directory. On load, a checkpoint that fails validation is reported and the
previous one used.

Every training state carries the run id of the directory it was written in, and only a checkpoint of the directory's
run id is ever resumed: a checkpoint copied in from another run, or left by one, is reported and skipped. Rotation
orders checkpoints by step number and keeps the newest `keep`, plus (whatever their age) the newest step, the one
`latest` names and the one `best` names.

RNG: training draws no random numbers from global generators (the data order is seeded by (seed, epoch), each
batch's anchors by (seed, batch index)), so the data position alone resumes data and anchors exactly. The global
states (python, numpy, torch CPU, every CUDA device: process-wide, shared by all worker threads) are saved anyway,
so a future random op cannot silently break exact resume.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import random
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import SafetensorError

from ..models.checkpoint import (TRAINING_WEIGHTS_NAME, WEIGHTS_NAME, CheckpointError, DrafterSnapshot, load_drafter,
                                 save_drafter, save_training_weights)
from ..models.drafter import DFlashDrafter

log = logging.getLogger("dflash_train")
STATE_NAME = "training_state.pt"
RUN_ID_NAME = "run_id"
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


def read_run_id(out_dir: str | Path) -> str | None:
    """The run id written in <out_dir>/run_id, or None (no run started there yet, or one older than run ids)."""
    p = Path(out_dir) / RUN_ID_NAME
    return (p.read_text().strip() or None) if p.is_file() else None


def step_of(d: Path) -> int | None:
    """The step a `step_N` directory name holds, or None for any other name."""
    digits = d.name.removeprefix("step_")
    return int(digits) if d.name.startswith("step_") and digits.isdigit() else None


def validate_training_state(state, path: Path) -> None:
    """Raise CheckpointError unless `state` is a training state for the step its directory is named after."""
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise CheckpointError(f"{path / STATE_NAME} lacks {', '.join(missing)}.")
    if step_of(path) is not None and step_of(path) != state["step"]:
        raise CheckpointError(f"{path / STATE_NAME} holds step {state['step']}, not the step its directory names.")


class HostCopier:
    """Copies the tensors of nested state (dicts, lists, tuples; anything else deep-copied) to host memory.

    CUDA tensors go into pinned buffers, kept from one save to the next (the previous write is complete before the
    next copy starts, so a buffer is never overwritten while it is read), with non-blocking copies on a side stream
    that first waits for the work already queued on the caller's stream. `finish()` makes the caller's stream wait
    for the copies (later in-place updates of the weights and moments cannot race them) and returns the events the
    writer synchronises on before it reads a buffer. CPU tensors are cloned."""

    def __init__(self):
        self._pinned: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._started: set[torch.device] = set()  # devices with copies queued since the last finish()

    def copy(self, obj, key: tuple = ()):
        return self._walk(obj, key, self._tensor)

    def reserve(self, obj, key: tuple = ()) -> None:
        """Allocate now the pinned buffers a later copy(obj, key) will fill (nothing on the CPU): pinning host memory
        stalls the process (the first checkpoint's log window ran 6.4% slow on an H200, the next ones within 0.3%),
        so the training does it once, before its measured steps."""
        self._walk(obj, key, self._reserve_tensor)

    def _walk(self, obj, key: tuple, leaf):
        """`obj` with every tensor t replaced by leaf(t, its key path); anything else deep-copied."""
        if isinstance(obj, torch.Tensor):
            return leaf(obj.detach(), key)
        if isinstance(obj, dict):
            return {k: self._walk(v, key + (k,), leaf) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, key + (i,), leaf) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _buffer(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        buf = self._pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buf

    def _reserve_tensor(self, t: torch.Tensor, key: tuple) -> None:
        if t.device.type == "cuda":
            self._buffer(t, key)

    def _tensor(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.clone()
        side = self._streams.get(t.device)
        if side is None:
            side = self._streams[t.device] = torch.cuda.Stream(t.device)
        if t.device not in self._started:  # the copy must see every update queued before the save
            side.wait_stream(torch.cuda.current_stream(t.device))
            self._started.add(t.device)
        buf = self._buffer(t, key)
        with torch.cuda.stream(side):
            buf.copy_(t, non_blocking=True)
        return buf

    def finish(self) -> list[torch.cuda.Event]:
        """Order the caller's streams after the copies; the events mark the copies complete (none on the CPU)."""
        events = []
        for device in self._started:
            side = self._streams[device]
            torch.cuda.current_stream(device).wait_stream(side)
            events.append(side.record_event())
        self._started.clear()
        return events


@dataclass
class _Write:
    """One checkpoint on its way to disk; `best` is a mark_best record that arrived while it was written."""
    step: int
    drafter: DrafterSnapshot  # the config and the weights' host copies
    state: dict
    copied: list  # CUDA events: the host copies are complete
    best: dict | None = None
    published: bool = False  # renamed into place and `latest` updated
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class CheckpointManager:
    """Writes, rotates and loads the step checkpoints of one run directory.

    run_id: the id every saved training state carries and every loaded one must match; by default the one in
    <out_dir>/run_id (None where there is none: then only states without a run id match).
    mid_save: a test seam (pipeline fault injection), called by the saving thread between copying the weights and
    the training state; None outside tests.

    save() returns once the state is copied; the write runs on a background thread ("dflash-checkpoint"), one at a
    time. wait() blocks until it is complete and raises its error; call it (or close()) before anything reads the
    checkpoint or the run ends. Used as a context manager, leaving waits too (and only logs a write error when
    another exception is already on its way out)."""

    def __init__(self, out_dir: str | Path, keep: int = 3, run_id: str | None = None,
                 mid_save: Callable[[], None] | None = None):
        if keep < 1:  # train.keep_checkpoints is validated >= 1; 0 would delete the checkpoint just written
            raise ValueError(f"keep must be at least 1 (got {keep})")
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep
        self.run_id = run_id if run_id is not None else read_run_id(out_dir)
        self.mid_save = mid_save
        self._copier = HostCopier()
        self._lock = threading.Lock()  # the write in flight and `best` are shared with the writer thread
        self._write: _Write | None = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the exception already leaving wins; this one goes to the log
            log.error(f"the checkpoint write also failed: {type(e).__name__}: {e}")

    def step_dirs(self) -> list[Path]:
        """Complete checkpoints, oldest step first (by number: step_100000000 sorts after step_99999999; temporary
        directories start with '.' and are ignored)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)

    def save(self, step: int, drafter: DFlashDrafter, optimizer, scheduler, data_position: int,
             extra: dict | None = None) -> Path:
        """Copy the state of `step` to host memory and start writing it; returns the directory it will be in once
        wait() returned. Raises the previous write's error, if it failed."""
        self.wait()  # one write in flight: its host copy bounds the memory, and its buffers are reused now
        weights = self._copier.copy(drafter.state_dict())
        if self.mid_save is not None:
            self.mid_save()
        state = {"step": step, "data_position": data_position,
                 "optimizer": self._copier.copy(optimizer.state_dict(), ("optimizer",)),
                 "scheduler": self._copier.copy(scheduler.state_dict(), ("scheduler",)), "rng": rng_state(),
                 "extra": copy.deepcopy(extra or {}), "run_id": self.run_id}
        # No module for the writer: building one, even on the meta device, costs more than the rest of save().
        job = _Write(step, DrafterSnapshot(drafter.config, weights), state, self._copier.finish())
        job.thread = threading.Thread(target=self._run_write, args=(job,), name="dflash-checkpoint", daemon=True)
        with self._lock:
            self._write = job
        job.thread.start()
        return self.root / f"step_{step:08d}"

    def reserve(self, drafter: DFlashDrafter, optimizer, scheduler) -> None:
        """Allocate the host buffers save() will fill (HostCopier.reserve), once the optimizer has its state (after
        the first step): the first checkpoint then costs the training what every later one does."""
        self._copier.reserve(drafter.state_dict())
        self._copier.reserve(optimizer.state_dict(), ("optimizer",))
        self._copier.reserve(scheduler.state_dict(), ("scheduler",))

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is complete; raise its error (once). Returns its directory."""
        job = self._write
        if job is None:
            return None
        job.thread.join()  # bounded like a synchronous write: the stall detectors time it the same way
        with self._lock:
            self._write = None
        if job.error is not None:
            raise job.error
        return self.root / f"step_{job.step:08d}"

    def close(self) -> None:
        """The end of the run: the last write is complete (or its error raised)."""
        self.wait()

    def _run_write(self, job: _Write) -> None:
        try:
            self._write_to_disk(job)
        except BaseException as e:  # noqa: BLE001 - raised to the caller by the next save, wait() or close()
            job.error = e

    def _write_to_disk(self, job: _Write) -> None:
        name = f"step_{job.step:08d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        try:
            for event in job.copied:  # the host buffers are filled once their side-stream copies are done
                event.synchronize()
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            save_drafter(job.drafter, tmp)
            save_training_weights(job.drafter, tmp)
            torch.save(job.state, tmp / STATE_NAME)
            _fsync_dir_tree(tmp)
            if final.exists():  # re-saving the same step (e.g. final == last periodic): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / "latest", name + "\n")
        except BaseException as e:
            full = _disk_full(e, self.root)  # before freeing the space this write took
            shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = f"the previous checkpoint, {previous.name}, is intact" if previous else "no checkpoint is kept"
            if full:
                raise CheckpointError(f"The disk is full: checkpoint {name} could not be written to {self.root} "
                                      f"({kept}); free space there or point run.out_dir at a disk with room.") from e
            if isinstance(e, OSError):  # permissions, a read-only or failing disk: the user's to fix
                raise CheckpointError(f"Checkpoint {name} could not be written to {self.root} ({e}; {kept}); make "
                                      "run.out_dir writable or point it at a working disk.") from e
            if isinstance(e, Exception):  # a bug: its traceback stays, and this says which write it broke
                raise RuntimeError(f"writing checkpoint {name} to {self.root} failed ({kept})") from e
            raise
        with self._lock:  # a mark_best from now on writes `best` itself
            job.published = True
            if job.best is not None:
                _atomic_write_text(self.root / "best", json.dumps(job.best) + "\n")
        self._prune()
        log.info(f"checkpoint saved: {final}")

    def _prune(self):
        """Keep the newest `keep` by step, and always the newest step, `latest`'s and `best`'s checkpoints."""
        dirs = self.step_dirs()
        keep = set(dirs[-self.keep:])
        keep.update(d for d in (self._pointed("latest"), self._best_dir()) if d is not None)
        for old in dirs:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp"):  # left by a process killed mid-write
            shutil.rmtree(stale, ignore_errors=True)

    def _pointed(self, pointer: str) -> Path | None:
        """The checkpoint directory a plain-text pointer file (`latest`) names, if both exist."""
        p = self.root / pointer
        if p.is_file():
            d = self.root / p.read_text().strip()
            if d.is_dir() and step_of(d) is not None:
                return d
        return None

    def latest(self) -> Path | None:
        dirs = self.step_dirs()
        return self._pointed("latest") or (dirs[-1] if dirs else None)

    # ------------------------------------------------------------------ the best checkpoint (validation)
    def mark_best(self, step: int, metric: str, value: float) -> Path:
        """Name checkpoint `step` (saved already; if it is still being written, once it is complete) the best so far
        by `metric`: `checkpoints/best` is replaced atomically, and rotation keeps that checkpoint until another one
        is marked. The caller decides what is
        better; this only records it. Returns the checkpoint's directory."""
        d = self.root / f"step_{step:08d}"
        record = {"name": d.name, "step": step, "metric": metric, "value": float(value), "run_id": self.run_id}
        with self._lock:
            job = self._write
            if job is not None and job.step == step and not job.published:
                job.best = record  # the writer names it best once the checkpoint is complete
                return d
            if not d.is_dir():
                raise FileNotFoundError(f"mark_best({step}): no checkpoint {d}; save the step before marking it best")
            _atomic_write_text(self.root / "best", json.dumps(record) + "\n")
        return d

    def best(self) -> dict | None:
        """The `best` record ({name, step, metric, value, run_id}) when it is this run's and its checkpoint
        exists, else None. Survives resume: nothing but mark_best rewrites it."""
        p = self.root / "best"
        try:
            record = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # written atomically, so only a hand edit gets here
            log.warning(f"{p} is not valid JSON; ignoring it")
            return None
        if not isinstance(record, dict) or record.get("run_id") != self.run_id:
            return None
        if not (self.root / str(record.get("name"))).is_dir():
            return None
        return record

    def _best_dir(self) -> Path | None:
        best = self.best()
        return self.root / best["name"] if best else None

    # ------------------------------------------------------------------ resume
    def load_latest(self, device="cpu") -> tuple[DFlashDrafter, dict, Path] | None:
        """(drafter, training_state, path) of the newest checkpoint of this run that loads; a broken one, or one of
        another run, is reported and the previous one is tried. None when there is no usable checkpoint."""
        candidates = self.step_dirs()
        first = self.latest()
        if first is not None and first in candidates:
            candidates = [c for c in candidates if step_of(c) <= step_of(first)]
        for d in reversed(candidates):
            try:
                state = torch.load(d / STATE_NAME, map_location="cpu", weights_only=False)
                validate_training_state(state, d)
                if state.get("run_id") != self.run_id:
                    log.warning(f"checkpoint {d} belongs to another run (run id {state.get('run_id')}, this run is "
                                f"{self.run_id}); skipping it")
                    continue
                drafter = load_training_weights(d, device)
                return drafter, state, d
            except Exception as e:  # noqa: BLE001 - report and fall back to the previous checkpoint
                log.warning(f"checkpoint {d} failed to load ({type(e).__name__}: {e}); trying the previous one")
        return None


def load_training_weights(d: Path, device="cpu") -> DFlashDrafter:
    """The fp32 drafter a step checkpoint resumes from; CheckpointError if it has none or its servable copy is not
    the rounding of those weights (a damaged or mixed-up checkpoint)."""
    if not (d / TRAINING_WEIGHTS_NAME).is_file():
        # Checkpoints written before the bf16 export kept the fp32 weights in model.safetensors itself.
        drafter = load_drafter(d, device)
        if drafter.fc.weight.dtype != torch.float32:
            raise CheckpointError(f"{d} has no {TRAINING_WEIGHTS_NAME} (fp32 weights) to resume from exactly.")
        return drafter
    drafter = load_drafter(d, device, weights=TRAINING_WEIGHTS_NAME)
    served = load_drafter(d, "cpu", weights=WEIGHTS_NAME).state_dict()
    for k, v in drafter.state_dict().items():
        if not torch.equal(served[k], v.detach().to("cpu", served[k].dtype)):
            raise CheckpointError(f"{d / WEIGHTS_NAME} is not the rounding of {TRAINING_WEIGHTS_NAME} ({k} differs).")
    return drafter


def resume_point(resume: str, ckpt: CheckpointManager, fresh: DFlashDrafter) -> tuple[DFlashDrafter, dict | None]:
    """(initial drafter, training state or None): the latest good checkpoint when run.resume=auto (its RNG states
    restored), else `fresh`. Shared by the reference trainer and the pipeline so both resume the same way."""
    if resume == "auto" and (found := ckpt.load_latest()) is not None:
        drafter, state, path = found
        set_rng_state(state["rng"])
        log.info(f"resuming from {path} at step {state['step']}")
        return drafter, state
    if resume == "auto":
        log.info(f"no checkpoint found, starting fresh (run.resume=auto, {ckpt.root})")
    return fresh, None
