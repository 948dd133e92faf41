"""Python's garbage collector during training: the heap frozen before the first step, and every pause timed.

A full (generation 2) collection walks every container the process holds, with the GIL held, so every thread of the
pipeline stops for it. A training process holds its whole tokenized dataset as Python lists (`data.packing.Sample`):
for the GPU demo's data (76k conversations, 21.6M tokens) one full collection took 0.9-1.06 s on the 2-core dev box
(2026-12-03, a probe building that many Samples and timing gc.collect(2)); after gc.freeze() it took 0.000 s. CPython
starts a full collection only when the objects that survived into the oldest generation grew by a quarter since the
last one, so a run sees such a pause rarely and at no particular step: the GPU demo of 2026-12-03 had one log window
~0.6 s slow, after its first validation, that nothing else explained.

`frozen_heap` collects once and moves every surviving object (the dataset, the models, the compiled graphs) into the
permanent generation for the training loop, so later collections walk only what training allocates; it unfreezes on
the way out (a long-lived process must not keep each run's objects frozen). A process that manages the collector
itself (the test suite freezes its imports once per worker) says so with `leave_gc_to_caller()`, and the heap is then
left as it is. A freeze found on the way in is no such statement: the GPU demo of 2026-12-03 (demo-j) met 375
objects frozen by something before training (not by this package) and, under the earlier rule that read any freeze
as the caller's policy, trained with its 1 M objects unfrozen. `GcWatch` times each collection through `gc.callbacks`, so a log window reports the
collector's share of it (`gc_s`) instead of leaving a slow window unexplained.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from typing import Iterator

log = logging.getLogger("dflash_train")

_caller_owns_gc = False


def leave_gc_to_caller(leave: bool = True) -> None:
    """Declare that this process manages the garbage collector itself (it froze its heap, say): frozen_heap then
    neither collects, nor freezes, nor unfreezes. leave=False hands the collector back to frozen_heap."""
    global _caller_owns_gc
    _caller_owns_gc = leave


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """gc.collect() then gc.freeze() for the body; gc.unfreeze() after it. Garbage cycles among the frozen objects
    are not collected before the body ends (plain reference counting still frees everything else). Objects frozen
    before it (by a library, say) are unfrozen with the rest at the end: freezing only ever saves the collector
    work, so that changes no result.

    After leave_gc_to_caller(), the caller's policy holds: no collection, no freeze and, above all, no unfreeze at
    the end, which would undo the caller's own freeze."""
    if _caller_owns_gc:
        log.info(f"heap: left to the caller ({gc.get_freeze_count():,} objects frozen)")
        yield
        return
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(f"heap frozen: {gc.get_freeze_count():,} objects out of the collector's reach during training "
             f"({time.perf_counter() - t0:.2f}s)")
    try:
        yield
    finally:
        gc.unfreeze()


class GcWatch:
    """Times every collection between start() and stop() (any thread's; one runs at a time, under the GIL).
    take() -> (seconds, collections) since the previous take(); `total_s`, `count`, `longest_s` over the run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._began: float | None = None
        self._window_s, self._window_n = 0.0, 0
        self.total_s, self.count, self.longest_s = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # registered mid-collection
            return
        dt, self._began = time.perf_counter() - self._began, None
        with self._lock:
            self._window_s += dt
            self._window_n += 1
            self.total_s += dt
            self.count += 1
            self.longest_s = max(self.longest_s, dt)

    def take(self) -> tuple[float, int]:
        with self._lock:
            out = (self._window_s, self._window_n)
            self._window_s, self._window_n = 0.0, 0
        return out

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)
