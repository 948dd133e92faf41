"""The base of every pipeline stage: one thread, a ready/failed handshake, a heartbeat, stop-aware queue waits.

Threading contract (the coordinator relies on all of it):
- `setup()` runs first on the worker's own thread (load, warm up, compile); `ready` is set only when it returned.
- `loop()` then runs until the work is done. Every blocking wait goes through `get`/`put`/`acquire`/`wait_for`:
  they poll with a short timeout, beat the heartbeat and raise `Stopped` once `control.stop` is set, so no thread
  ever blocks forever on a queue whose other end is gone.
- Any exception is caught on the thread, its full traceback stored, and the whole run is stopped (`control.fail`).
- The heartbeat (`last_beat`) advances while the worker waits, so a worker whose heartbeat goes stale is stuck in
  its own work (a hung kernel, a deadlock), not starved by a neighbour: that is what stall detection reports.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from typing import Callable

import torch

from .devices import stream_scope

POLL_S = 0.05  # how often a blocked wait re-checks the stop event; bounds the shutdown latency of every thread
THREAD_PREFIX = "dflash-"


class Stopped(Exception):
    """Raised inside a worker's wait when the run is stopping; unwinds the worker quietly."""


class _EndOfData:
    def __repr__(self):
        return "END_OF_DATA"


END_OF_DATA = _EndOfData()  # sentinel that flows down the queues after the last batch


class RunControl:
    """State shared by all workers of one run: the stop event and the first failure (first one wins)."""

    def __init__(self):
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.failure: tuple[str, str] | None = None  # (worker name, message naming it, with its traceback)
        self.interrupted: str | None = None  # signal name when a signal asked the run to stop

    def fail(self, worker: str, message: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = (worker, message)
        self.stop.set()

    def interrupt(self, why: str) -> None:
        self.interrupted = why
        self.stop.set()


class StageClock:
    """Seconds a worker waited on its input (`get_wait_s`), on room downstream (`put_wait_s`), and was busy.

    Busy time on CUDA is device time from events recorded around the work (resolved lazily, no host sync); on CPU
    it is host time. Written by the worker's thread, read by the reporter's: plain floats and a deque, both safe."""

    def __init__(self, device: torch.device):
        self.device = device
        self.get_wait_s = self.put_wait_s = 0.0
        self._busy_s = 0.0
        self._pending: deque = deque()  # (start, end) CUDA events not yet resolved

    @contextmanager
    def busy(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._busy_s += time.perf_counter() - t0

    def busy_s(self) -> float:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._busy_s += start.elapsed_time(end) / 1000.0
        return self._busy_s


class Worker:
    """A pipeline stage on its own daemon thread named `dflash-<name>`. Subclasses implement setup() and loop()."""

    def __init__(self, name: str, control: RunControl, device: torch.device | None = None):
        self.name, self.control = name, control
        self.device = device or torch.device("cpu")
        self.stream = None  # a CUDA stream of its own, set by subclasses that compute on a GPU
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.error: str | None = None
        self.last_beat = time.monotonic()
        self.clock = StageClock(self.device)
        self.thread = threading.Thread(target=self._main, name=THREAD_PREFIX + name, daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        pass

    def loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.beat()
        self.thread.start()

    def _main(self) -> None:
        try:
            with stream_scope(self.device, self.stream):
                self.setup()
                self.beat()
                self.ready.set()
                self.loop()
        except Stopped:
            pass
        except BaseException:  # noqa: BLE001 - everything a worker raises is reported, with its traceback
            self.error = traceback.format_exc()
            when = "failed" if self.ready.is_set() else "failed during startup"
            self.control.fail(self.name, f"{self.name} {when}:\n{self.error}")
        finally:
            self.finished.set()

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self.finished.is_set()

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def stack(self) -> str:
        """Where the thread is right now (for stall reports)."""
        frame = sys._current_frames().get(self.thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(thread not running)\n"

    # ------------------------------------------------------------------ stop-aware waits
    def _check_stop(self) -> None:
        self.beat()
        if self.control.stop.is_set():
            raise Stopped

    def _waited(self, counter: str, since: float) -> float:
        """Add the time since `since` to the clock's `counter` as it passes (so report windows see waits still
        in progress), beat, and leave if the run is stopping."""
        now = time.perf_counter()
        setattr(self.clock, counter, getattr(self.clock, counter) + now - since)
        self._check_stop()
        return now

    def get(self, q: queue.Queue):
        """Next item of `q` (time spent here counts as waiting for input)."""
        mark = time.perf_counter()
        while True:
            try:
                item = q.get(timeout=POLL_S)
                break
            except queue.Empty:
                mark = self._waited("get_wait_s", mark)
        self._waited("get_wait_s", mark)
        return item

    def put(self, q: queue.Queue, item) -> None:
        """Put into `q` (time spent here counts as waiting for room downstream)."""
        mark = time.perf_counter()
        while True:
            try:
                q.put(item, timeout=POLL_S)
                break
            except queue.Full:
                mark = self._waited("put_wait_s", mark)
        self._waited("put_wait_s", mark)

    def acquire(self, sem: threading.Semaphore) -> None:
        mark = time.perf_counter()
        while not sem.acquire(timeout=POLL_S):
            mark = self._waited("put_wait_s", mark)
        self._waited("put_wait_s", mark)

    def wait_for(self, cond: threading.Condition, predicate: Callable[[], bool]) -> None:
        """Wait (holding `cond`) until predicate() is true; stop-aware like every other wait."""
        while not predicate():
            self._check_stop()
            cond.wait(POLL_S)
        self.beat()
