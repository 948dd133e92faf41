"""The run directory: one run per directory, locked while it trains, moved aside (never deleted) to start over.

  <out_dir>/.lock            flock'ed by the training process (the owner rank) while it runs; names its PID and host
  <out_dir>/run_id           a uuid made when the run starts; every checkpoint carries it (training/checkpointing.py)
  <out_dir>/run_config.yaml  the config of the latest start, which the next start is compared with

What a start (prepare_out_dir) does with the directory it is given, holding its lock:
- run.overwrite=true and the directory holds a run: it is renamed to `<out_dir>.old-<UTC time>` (nothing is
  deleted) and the new run starts in an empty directory with a new run id.
- it holds a run whose config differs in a key that changes what is trained: refused, naming each such key with its
  old and new value. The keys that may change (RESUMABLE_KEYS: how long, how often to log, checkpoint or validate,
  the stall timeout, ...) are logged when resuming. A start that failed before it trained, wrote data or logged a
  step (a wrong data.source, say) left only its own files: the next start, whatever its config, begins afresh there.
- run.resume=auto continues the run (its run id: only its own checkpoints are resumed); run.resume=never into a
  directory that already holds trained state (checkpoints, drafter/, logged steps) is refused: it would mix two runs.

The lock is an advisory flock: the kernel drops it when the holding process dies, so a lock file left by a crash is
no obstacle. It is released by hold_run_dir's scope (the training entry points) or release_run_dir.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import tempfile
import threading
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import yaml

from ..config import Config, ConfigError
from ..errors import UserError
from .checkpointing import RUN_ID_NAME, read_run_id, step_of

log = logging.getLogger("dflash_train")
RUN_CONFIG_NAME = "run_config.yaml"
LOCK_NAME = ".lock"
# Keys that may differ between a run and its resumption without making it "a different run": how long it trains,
# how often it logs, checkpoints and validates, and settings that change how fast it runs but not what it computes.
# A new train.max_steps (or epochs) changes the LR schedule's length: build_scheduler's lambda is rebuilt from the
# resumed run's total and is not part of the saved scheduler state (only its step is), so from the resume point on
# the LR is the warm-up + cosine of the new length, ending at the new last step (tests/test_rundir.py pins this).
RESUMABLE_SECTIONS = {"run"}
RESUMABLE_KEYS = {"train.max_steps", "train.epochs", "train.max_minutes", "train.log_every", "train.checkpoint_every",
                  "train.keep_checkpoints", "train.eval_every", "train.nonfinite", "pipeline.stall_timeout_s",
                  "pipeline.queue_depth", "pipeline.grad_reduce", "model.target_graphs", "train.compile_cache_dir"}
_QUIET_KEYS = {"run.resume", "run.overwrite"}  # always differ when resuming (never -> auto): not worth a log line
_MARKERS = (RUN_CONFIG_NAME, RUN_ID_NAME, "checkpoints", "drafter", "metrics.jsonl")  # "a run was started here"
_BOOKKEEPING = {LOCK_NAME, RUN_ID_NAME, RUN_CONFIG_NAME, "run.log"}  # what a start writes before anything else


# ---------------------------------------------------------------------------------------------- the lock

class _RunDirLock:
    """flock on <out_dir>/.lock, held until release(); the file names the holder for whoever is refused."""

    def __init__(self, out: Path):
        try:
            f = open(out / LOCK_NAME, "a+")  # a+: never truncates what a current holder wrote
        except OSError as e:
            raise UserError(f"run.out_dir {out} is not writable ({e.strerror}); choose a directory you can write "
                            "to.") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not written its name yet"
            f.close()
            raise UserError(f"{out} is in use by another training run ({holder}); wait for it to end or stop it, "
                            "or choose another run.out_dir.") from None
        except OSError as e:
            f.close()
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            log.warning(f"{out}: this file system has no file locks ({e.strerror}); the run directory is not "
                        "locked, so make sure no other run trains into it")
            self.f = None
            return
        f.truncate(0)
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        f.write(f"PID {os.getpid()} on host {socket.gethostname()}, since {when}\n")
        f.flush()
        self.f = f

    def release(self) -> None:
        if self.f is not None:
            self.f.truncate(0)  # while still held, so a next holder's name is never cut
            self.f.close()      # closing the file drops the flock
            self.f = None


_held: dict[Path, _RunDirLock] = {}  # resolved out_dir -> this process's lock on it
_held_guard = threading.Lock()


def _lock(out: Path) -> None:
    """Lock `out` for this process (a no-op when this process holds it already: one run, prepared twice)."""
    with _held_guard:
        key = out.resolve()
        if key not in _held:
            _held[key] = _RunDirLock(out)


def release_run_dir(out: str | Path) -> None:
    """Release this process's lock on `out`, if it holds one."""
    with _held_guard:
        lock = _held.pop(Path(out).resolve(), None)
    if lock is not None:
        lock.release()


@contextmanager
def hold_run_dir(out: str | Path):
    """The scope of a run: the lock prepare_out_dir took on `out` is released when it exits, on every path
    (a no-op for a rank that does not own the directory)."""
    try:
        yield
    finally:
        release_run_dir(out)


# ---------------------------------------------------------------------------------------------- what a start may do

def _show(v) -> str:
    return "empty" if v is None else repr(v) if isinstance(v, str) else str(v)


def _with_defaults(saved: dict) -> dict:
    """A saved run config with the keys it predates at their defaults: a field added to the config since the run
    was written does not make it 'a different run' as long as the resumed run leaves it at its default."""
    full = Config().to_dict()
    for section, values in (saved if isinstance(saved, dict) else {}).items():
        full.setdefault(section, {}).update(values if isinstance(values, dict) else {})
    return full


def config_changes(saved: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """(refused, allowed): `section.key old -> new` for each key whose value in `cfg` differs from the saved run
    config; allowed are the resumable ones. A saved key the config no longer has is ignored: it cannot be set."""
    old = _with_defaults(saved)
    refused, allowed = [], []
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            before = old.get(section, {}).get(key)
            if before != value:
                change = f"{section}.{key} {_show(before)} -> {_show(value)}"
                resumable = section in RESUMABLE_SECTIONS or f"{section}.{key}" in RESUMABLE_KEYS
                (allowed if resumable else refused).append((f"{section}.{key}", change))
    return [c for _, c in refused], [c for k, c in allowed if k not in _QUIET_KEYS]


def _step_dirs(out: Path) -> list[Path]:
    root = out / "checkpoints"
    dirs = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
    return sorted(dirs, key=step_of)


def _trained(out: Path) -> str | None:
    """What in `out` a fresh run would mix with (checkpoints, a drafter, logged steps), in words; None if nothing."""
    if steps := _step_dirs(out):
        return f"checkpoints up to {steps[-1].name}"
    if (out / "drafter").is_dir():
        return "a trained drafter/"
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return "logged steps in metrics.jsonl"
    return None


def _bookkeeping_only(out: Path) -> bool:
    """True when `out` holds nothing but a start's own files (lock, run id, run config, log): its run failed before
    it trained, wrote data or logged a step, so a new config may start afresh there without mixing anything."""
    return all(p.name in _BOOKKEEPING for p in out.iterdir())


def make_dir(out: Path, what: str = "run.out_dir", fix: str = "run.out_dir") -> None:
    """mkdir -p `out` (`what`, in words), or one sentence naming it and `fix`, what the user sets to mend it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{what} {out} is a file, not a directory; choose another {fix}.") from None
    except OSError as e:
        raise UserError(f"{what} {out} cannot be created ({e.strerror}); choose another {fix}, one you can write "
                        "to.") from None


def _move_aside(out: Path) -> Path:
    """Rename the run in `out` (whose lock this process holds) to `<out>.old-<UTC time>`, re-create `out` empty
    and lock it; returns where the old run went."""
    here = out.resolve()
    if Path.cwd().resolve().is_relative_to(here):
        raise UserError(f"run.overwrite=true would move {out}, which holds the current directory, aside; run from "
                        "outside it or choose another run.out_dir.")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside, n = here.with_name(f"{here.name}.old-{stamp}"), 2
    while aside.exists():
        aside, n = here.with_name(f"{here.name}.old-{stamp}-{n}"), n + 1
    with _held_guard:
        old_lock = _held.pop(here)
    try:
        os.rename(here, aside)  # still holding the old directory's lock: nothing else writes into what moves
        make_dir(out)
        _lock(out)
    except OSError as e:
        raise UserError(f"run.overwrite=true could not move {out} aside to {aside} ({e.strerror}); move or remove "
                        "it yourself, or choose another run.out_dir.") from None
    finally:
        old_lock.release()
    return aside


def _atomic_write(path: Path, text: str) -> None:
    """Written whole, then renamed: a reader never sees a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def prepare_out_dir(cfg: Config, owner: bool = True) -> Path:
    """Create (or take over) the run directory. The owner (rank 0 of a torchrun launch) locks it, moves an old run
    aside on run.overwrite=true, refuses to mix two runs in it, and writes run_id and run_config.yaml; the lock is
    held until hold_run_dir's scope ends (or release_run_dir). Other ranks may name per-node paths (model.target,
    data.source, devices) that differ from rank 0's; what must agree is checked by the start gate
    (pipeline/distributed.py)."""
    out = Path(cfg.run.out_dir)
    make_dir(out)
    if not owner:
        return out
    _lock(out)
    try:
        _start_run(cfg, out)
    except BaseException:
        release_run_dir(out)
        raise
    return out


def _start_run(cfg: Config, out: Path) -> None:
    """prepare_out_dir's decisions, with the lock held (module docstring)."""
    if cfg.run.overwrite and any((out / m).exists() for m in _MARKERS):
        aside = _move_aside(out)
        log.info(f"run.overwrite=true: the previous run in {out} was moved aside to {aside}; starting a new run")
    run_id, saved = read_run_id(out), out / RUN_CONFIG_NAME
    allowed: list[str] = []
    if saved.is_file():
        try:
            old = yaml.safe_load(saved.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{saved} is not valid YAML ({str(e).splitlines()[0]}); restore it, or pass "
                              "run.overwrite=true to move this run aside and start over.") from None
        refused, allowed = config_changes(old, cfg)
        if refused and not _bookkeeping_only(out):
            raise ConfigError(f"{out} already holds a different run ({'; '.join(refused)}); choose another "
                              "run.out_dir, or pass run.overwrite=true to move it aside and start over.")
        if refused:  # the last start failed before it trained or wrote data (e.g. a wrong data.source): nothing to mix
            log.info(f"{out}: its last start trained nothing and wrote no data; starting a new run there with "
                     f"{'; '.join(refused)}")
            run_id = None
    trained = _trained(out)
    if cfg.run.resume == "auto":
        if run_id is None and _step_dirs(out):
            raise ConfigError(f"{out} holds checkpoints without a run id (written by an older dflash-train), which "
                              "cannot be told apart from another run's; pass run.overwrite=true to move them aside "
                              "and start over (model.drafter_init=<a checkpoint> starts from its weights), or "
                              "choose another run.out_dir.")
        if trained and allowed:
            log.info(f"resuming with {', '.join(allowed)}")
    elif trained:
        raise ConfigError(f"{out} already holds a run ({trained}); pass run.resume=auto to continue it, "
                          "run.overwrite=true to move it aside and start over, or choose another run.out_dir.")
    else:
        run_id = None  # nothing trained here yet: a new run, a new id
    if run_id is None:
        run_id = uuid.uuid4().hex
        _atomic_write(out / RUN_ID_NAME, run_id + "\n")
    _atomic_write(saved, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
