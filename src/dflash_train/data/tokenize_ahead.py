"""Tokenize a chat file while the run is still writing it, so that loading it afterwards is a cache hit.

data.regenerate writes the training conversations (the target's answers) for minutes with the CPU mostly idle;
tokenizing them used to start only after the last answer: ~29 s between the regeneration and the first step of the
GPU demo on an H100 (demo-o, 115,720 conversations, 8 worker processes). A child process can instead follow the
file as it grows (data/sources.growing_lines) and put the tokenized split in the tokenized-data cache under the
finished file's key (data/conversations.tokenize_into_cache); the run's own load then reads the cache:

  ahead = TokenizeAhead(cfg, tokenizer, seed, cache_dir, scratch)   cfg.source: the file being written
  ... write the file ...
  ahead.finish()   the file is complete: waits for the child's cache entry; a failed or stalled child is a warning,
                   the load then tokenizes as it would have

The child is `python -m dflash_train.data.tokenize_ahead SCRATCH` (a fresh interpreter: nothing inherited from the
run's threads or CUDA, and no re-import of the caller's main module), tokenizing in its own process with the fast
tokenizer's threads (TOKENIZERS_PARALLELISM, RAYON_NUM_THREADS=threads), at a lower CPU priority than the run
(beside.py: the regeneration is the critical path, the child has minutes of slack). It learns that the file is
complete from the file SCRATCH/done, and from then on shows it is alive by counting its reads of the file in
SCRATCH/progress.
Only a cache is shared: the run's data are what load_chat_dataset gives from the finished file, with or without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..beside import exit_with_parent, start_beside
from .conversations import tokenize_into_cache, usable_cores

log = logging.getLogger("dflash_train")

IDLE_S = 60.0       # finish() stops a child that has read nothing for this long after the file was complete
POLL_S = 0.2        # finish()'s wait between looks at the child
TAIL_LINES = 12     # of the child's log, quoted when it fails
AUTO_MIN_CORES = 8  # data.tokenize_ahead=auto: on a GPU host with cores to spare beside the regeneration


def wants_tokenize_ahead(cfg, on_gpu: bool) -> bool:
    """data.tokenize_ahead, resolved: asked for, or (auto) the regeneration runs on a GPU of a machine with
    AUTO_MIN_CORES or more (on a CPU the child would take the cores the regeneration runs on)."""
    if cfg.tokenize_ahead is not None:
        return cfg.tokenize_ahead
    return on_gpu and usable_cores() >= AUTO_MIN_CORES


def ahead_threads() -> int:
    """The child's tokenizer threads: a quarter of the cores, 1 to 4. One kept up with 300 ShareGPT conversations a
    second on the dev box (benchmarks/tokenize_ahead_cpu.py); the demo's answers come at ~540 a second."""
    return max(1, min(4, usable_cores() // 4))


class TokenizeAhead:
    """The child process that tokenizes cfg.source into cache_dir as the file grows (see the module docstring)."""

    def __init__(self, cfg, tokenizer, seed: int, cache_dir: str, scratch: Path, threads: int | None = None):
        self.source, self.scratch = Path(cfg.source), Path(scratch)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        self.log_path = self.scratch / "log"
        with open(self.scratch / "job.pkl", "wb") as f:
            pickle.dump({"cfg": cfg, "tokenizer": tokenizer, "seed": seed, "cache_dir": str(cache_dir)}, f)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(threads or ahead_threads()))
        with open(self.log_path, "w", encoding="utf-8") as out:
            self.proc = start_beside([sys.executable, "-m", "dflash_train.data.tokenize_ahead", str(self.scratch)],
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.completed: float | None = None  # when complete() was first called

    def complete(self) -> None:
        """The file is complete (its writer has closed it): the child reads it to the end and saves."""
        if self.completed is None:
            (self.scratch / "done").touch()
            self.completed = time.monotonic()

    def finish(self, idle_s: float = IDLE_S) -> bool:
        """The file is complete: wait for the child to save its cache entry (True). A child that exits with an
        error, or reads nothing for idle_s seconds, is a warning (False): the run's load tokenizes the file itself."""
        self.complete()
        waited = time.monotonic()
        last, last_seen = None, time.monotonic()
        while self.proc.poll() is None:
            progress = self._progress()
            if progress != last:
                last, last_seen = progress, time.monotonic()
            elif time.monotonic() - last_seen > idle_s:
                self._stop()
                log.warning(f"tokenizing {self.source} ahead: no progress for {idle_s:.0f} s after the file was "
                            f"complete; stopped (the run tokenizes it itself); its log: {self.log_path}")
                return False
            time.sleep(POLL_S)
        if self.proc.returncode != 0:
            tail = "\n".join(self._tail())
            log.warning(f"tokenizing {self.source} ahead: the child exited with {self.proc.returncode} (the run "
                        f"tokenizes the file itself); the end of {self.log_path}:\n{tail}")
            return False
        now = time.monotonic()
        log.info(f"tokenized {self.source} while it was written: in the cache at most {now - self.completed:.1f} s "
                 f"after the file was complete (the run waited {now - waited:.1f} s for it)")
        shutil.rmtree(self.scratch, ignore_errors=True)
        return True

    def close(self) -> None:
        """Stop the child if it still runs (the caller failed before finish(), or is done with it)."""
        if self.proc.poll() is None:
            self._stop()

    def _progress(self) -> str | None:
        try:
            return (self.scratch / "progress").read_text()
        except OSError:
            return None

    def _stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _tail(self) -> list[str]:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:]
        except OSError:
            return []


class TokenizeAheads:
    """The files of one regeneration, each tokenized ahead by a TokenizeAhead of its own; nothing when not enabled.
    loads_as(path): the DataConfig the run will load that file with. A child that cannot be started is a warning."""

    def __init__(self, enabled: bool, loads_as, tokenizer, seed: int, cache_dir: str, scratch: Path):
        self.enabled, self.loads_as, self.tokenizer, self.seed = enabled, loads_as, tokenizer, seed
        self.cache_dir, self.scratch = cache_dir, Path(scratch)
        self.children: dict[Path, TokenizeAhead] = {}

    def start(self, path: Path) -> None:
        """path is open to append to and only grows from now on (regenerate_dataset's `opened`)."""
        if not self.enabled or path in self.children:
            return
        try:
            self.children[path] = TokenizeAhead(self.loads_as(path), self.tokenizer, self.seed, self.cache_dir,
                                                self.scratch / path.stem)
        except Exception as e:  # noqa: BLE001 - only time is at stake: the run tokenizes the file itself
            log.warning(f"tokenizing {path} ahead could not start ({type(e).__name__}: {e}); the run tokenizes it "
                        "after the regeneration")

    def complete(self, path: Path) -> None:
        if path in self.children:
            self.children[path].complete()

    def finish(self) -> None:
        """Every file is complete: wait for each child's cache entry (TokenizeAhead.finish)."""
        for child in self.children.values():
            child.finish()
        self.children.clear()
        with contextlib.suppress(OSError):  # kept where a child failed: its log is there
            self.scratch.rmdir()

    def __enter__(self) -> TokenizeAheads:
        return self

    def __exit__(self, *exc) -> None:
        for child in self.children.values():
            child.close()


def _child(scratch: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with open(scratch / "job.pkl", "rb") as f:
        job = pickle.load(f)
    parent, done, reads = os.getppid(), scratch / "done", 0

    def until() -> bool:
        """True once the file is complete; from then on each call (one a read of the file) is written down for the
        parent's watchdog. A child whose parent is gone stops."""
        nonlocal reads
        if os.getppid() != parent:
            sys.exit("the run that started this child has ended")
        if not done.exists():
            return False
        reads += 1
        (scratch / "progress").write_text(str(reads))
        return True

    path = tokenize_into_cache(job["cfg"], job["tokenizer"], job["seed"], job["cache_dir"], until)
    log.info(f"saved {path}")


if __name__ == "__main__":
    exit_with_parent()  # a run killed outright leaves no child tokenizing (beside.py)
    _child(Path(sys.argv[1]))
