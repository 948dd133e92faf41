"""The base of every pipeline stage: one thread, a ready/failed handshake, a heartbeat, stop-aware queue waits.

Threading contract (the coordinator relies on all of it):
- `setup()` runs first on the worker's own thread (load, warm up, compile); `ready` is set only when it returned.
- `loop()` then runs until the work is done. Every blocking wait goes through `get`/`put`/`acquire`/`wait_for`:
  they poll with a short timeout, beat the heartbeat and raise `Stopped` once `control.stop` is set, so no thread
  ever blocks forever on a queue whose other end is gone.
- Any exception is caught on the thread, its full traceback stored, and the whole run is stopped (`control.fail`).
- The heartbeat (`last_beat`) advances while the worker waits, so a worker whose heartbeat goes stale is stuck in
  its own work (a hung kernel, a deadlock), not starved by a neighbour: that is what stall detection reports. A
  worker found inside one of those polling waits with a stale heartbeat was not scheduled (a machine busier than
  the run), not stuck: `in_polling_wait` tells the supervisor so.
  The coordinator (the main thread) supervises the workers; a `Watchdog` thread watches the coordinator.
- Fault-injection points (pipeline/faults.py): `startup` after setup(), `shutdown` after loop() returned, and
  `checkpoint` at every wait while a checkpoint writer holds a write open; stages add their own `step` points.
  Outside tests `control.faults` is None and each point is that one test.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from typing import Callable

import torch

from ..data.packing import wait_for_result
from .devices import stream_scope

log = logging.getLogger("dflash_train")
POLL_S = 0.05  # how often a blocked wait re-checks the stop event; bounds the shutdown latency of every thread
THREAD_PREFIX = "dflash-"
OOM_HINT = ("out of memory; lower train.token_budget or train.num_anchors (the tokens and blocks of one step), or "
            "give this stage a device with more free memory")


class Stopped(Exception):
    """Raised inside a worker's wait when the run is stopping; unwinds the worker quietly."""


class _EndOfData:
    def __repr__(self):
        return "END_OF_DATA"


END_OF_DATA = _EndOfData()  # sentinel that flows down the queues after the last batch


def signal_exit_code(signal_name: str) -> int:
    """SIGTERM (a scheduler's polite stop, a time limit) ends the process normally, 0; SIGINT (Ctrl-C) keeps 130."""
    return 0 if signal_name == "SIGTERM" else 130


class RunInterrupted(KeyboardInterrupt):
    """A signal stopped the run cleanly after a checkpoint; str() is the one-line summary, exit code as
    signal_exit_code."""

    def __init__(self, signal_name: str, summary: str):
        super().__init__(summary)
        self.signal_name = signal_name
        self.exit_code = signal_exit_code(signal_name)


class RunControl:
    """State shared by all workers of one run: the stop event, the first failure (first one wins), the faults."""

    def __init__(self, faults=None):
        self.stop = threading.Event()
        self.failed = threading.Event()  # set with the first failure (stop may also mean a signal or the end)
        self._lock = threading.Lock()
        # (worker name, message naming it with its traceback, the exception or None for a stall)
        self.failure: tuple[str, str, BaseException | None] | None = None
        self.interrupted: str | None = None  # signal name when a signal asked the run to stop
        self.faults = faults  # a faults.FaultPlan in fault-injection tests; None otherwise: no point fires

    def fail(self, worker: str, message: str, exc: BaseException | None = None) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = (worker, message, exc)
        self.failed.set()
        self.stop.set()

    def interrupt(self, why: str) -> None:
        self.interrupted = why
        self.stop.set()


@contextmanager
def stop_on_signals(control: RunControl, until: str, abandoned: str = ""):
    """SIGINT/SIGTERM -> control.interrupt(name): a clean stop after `until` (e.g. "the current step to write a
    checkpoint"); a second signal raises KeyboardInterrupt at once ("second SIGINT: stopped at once" + `abandoned`),
    even mid-checkpoint. Main thread only (elsewhere no handler is installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if control.interrupted:  # the second signal aborts at once (threads are still stopped and joined)
            raise KeyboardInterrupt(f"second {name}: stopped at once{abandoned}")
        control.interrupt(name)
        log.warning(f"{name}: stopping after {until} (again to stop at once)")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class StageClock:
    """Seconds a worker waited on its input (`get_wait_s`), on room downstream (`put_wait_s`), and was busy.

    Busy time on CUDA is device time from events recorded around the work (resolved lazily, no host sync); on CPU
    it is host time. Written by the worker's thread, read by the reporter's: plain floats and a deque, both safe."""

    def __init__(self, device: torch.device):
        self.device = device
        self.get_wait_s = self.put_wait_s = 0.0
        self._busy_s = 0.0                # CUDA: resolved event pairs
        self._pending: deque = deque()  # (start, end) CUDA events not yet resolved
        # CPU: (seconds of finished intervals, start of the one in progress or None), one attribute so that the
        # reporter's thread always reads a consistent pair
        self._cpu: tuple[float, float | None] = (0.0, None)

    @contextmanager
    def busy(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
        else:
            done, _ = self._cpu
            t0 = time.perf_counter()
            self._cpu = (done, t0)
            yield
            self._cpu = (done + time.perf_counter() - t0, None)

    def busy_s(self) -> float:
        """Busy seconds up to now. On CPU the interval in progress counts up to now, so the busy time between two
        reads never exceeds the wall time between them; on CUDA, pairs count once their end event has passed."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._busy_s += start.elapsed_time(end) / 1000.0
        done, since = self._cpu
        return self._busy_s + done + (time.perf_counter() - since if since is not None else 0.0)


def thread_stack(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(thread not running)\n"


def describe_stall(name: str, silent_s: float, timeout_s: float, thread: threading.Thread) -> str:
    return (f"{name} stalled: no progress for {silent_s:.1f} s (pipeline.stall_timeout_s={timeout_s:g}); "
            f"it is here:\n{thread_stack(thread)}")


def describe_failure(name: str, exc: BaseException, phase: str) -> str:
    """'<name> failed[ during startup|shutdown][: out of memory; <hint>]:' + the traceback being handled."""
    when = f" during {phase}" if phase in ("startup", "shutdown") else ""
    hint = f": {OOM_HINT}" if isinstance(exc, torch.OutOfMemoryError) else ""
    return f"{name} failed{when}{hint}:\n{traceback.format_exc()}"


class Worker:
    """A pipeline stage on its own daemon thread named `dflash-<name>`. Subclasses implement setup() and loop().

    clock: where its wait and busy seconds go; given when something built before the worker reads it (the step
    reporter reads the drafters'), else its own."""

    def __init__(self, name: str, control: RunControl, device: torch.device | None = None,
                 clock: StageClock | None = None):
        self.name, self.control = name, control
        self.device = device or torch.device("cpu")
        self.stream = None  # a CUDA stream of its own, set by subclasses that compute on a GPU
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.phase = "startup"  # startup -> steady -> shutdown (for failure messages)
        self.last_beat = time.monotonic()
        self.clock = clock if clock is not None else StageClock(self.device)
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
                self.inject("startup")
                self.beat()
                self.ready.set()
                self.phase = "steady"
                self.loop()
                self.phase = "shutdown"
                self.inject("shutdown")
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - everything a worker raises is reported, with its traceback
            self.control.fail(self.name, describe_failure(self.name, e, self.phase), e)
        finally:
            self.finished.set()

    def inject(self, phase: str, n: int | None = None) -> str | None:
        """A fault-injection point (pipeline/faults.py): raises or stalls here, or returns 'nan'/'inf' to apply."""
        faults = self.control.faults
        return faults.check(self.name, phase, self.control.stop, n) if faults is not None else None

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self.finished.is_set()

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def in_polling_wait(self) -> bool:
        """Whether the thread is inside one of the stop-aware waits below, blocked in the queue or lock it polls
        (the innermost frame outside the standard library is the wait itself). Such a thread beats as soon as it
        runs again; a fault or a hang inside a wait (a checkpoint fault fires there) has frames of its own."""
        frame = sys._current_frames().get(self.thread.ident)
        while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):  # queue.py, threading.py
            frame = frame.f_back
        return frame is not None and frame.f_code in _POLLING_WAITS

    # ------------------------------------------------------------------ stop-aware waits
    def _check_stop(self) -> None:
        self.beat()
        if self.control.stop.is_set():
            raise Stopped
        if self.control.faults is not None:  # a checkpoint fault of this worker fires at a wait
            self.control.faults.check_checkpoint(self.name, self.control.stop)

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


_STDLIB = os.path.dirname(threading.__file__) + os.sep
_POLLING_WAITS = frozenset(f.__code__ for f in (Worker.get, Worker.put, Worker.acquire, Worker.wait_for,
                                                wait_for_result))


class Watchdog:
    """Stall detection for the coordinator, which supervises every worker but runs on the main thread: a thread of
    its own (`dflash-watchdog`) fails the run, with the main thread's stack, when the coordinator's heartbeat is older
    than `timeout_s`. The coordinator beats while it supervises, joins and writes its checkpoints; a checkpoint write
    must take less than the timeout, as for the drafter that writes the periodic ones."""

    def __init__(self, control: RunControl, timeout_s: float, name: str = "coordinator"):
        self.control, self.timeout_s, self.name = control, timeout_s, name
        self.last_beat = time.monotonic()
        self._watched = threading.current_thread()
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=THREAD_PREFIX + "watchdog", daemon=True)

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def __enter__(self) -> "Watchdog":
        self.beat()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            silent = time.monotonic() - self.last_beat
            if silent > self.timeout_s:
                message = describe_stall(self.name, silent, self.timeout_s, self._watched)
                log.warning(message)  # now: a thread hung in a C call may never get to report it
                self.control.fail(self.name, message)
                return
