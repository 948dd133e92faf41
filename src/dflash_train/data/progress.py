"""Progress of a long phase (tokenizing, regenerating, evaluating): a tqdm bar on a terminal, plain lines off one.

tqdm draws nothing when stderr is not a TTY (`disable=None`), so a run logged to a file would be silent for minutes.
`progress_bar` takes tqdm's arguments and returns tqdm on a TTY; elsewhere a `PlainProgress` that logs one line at
most every `every_s` seconds and one at the end: `<desc>: <done>/<total> <unit> (<pct>%), <rate> <unit>/s, ETA <t>`.
In data/ because that is the lowest layer with a long phase (inference imports it from here).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("dflash_train")

PROGRESS_EVERY_S = 30.0  # seconds between plain progress lines


def progress_bar(iterable=None, *, total: float | None = None, desc: str = "", unit: str = "it",
                 every_s: float | None = None, **tqdm_kw):
    """tqdm(iterable, total=..., desc=..., unit=...) on a terminal, else PlainProgress (same use: update(n),
    set_postfix(...), close(), a context manager, iteration) logging every `every_s` (PROGRESS_EVERY_S) seconds."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, **tqdm_kw)
    return PlainProgress(iterable, total=total, desc=desc, unit=unit,
                         every_s=PROGRESS_EVERY_S if every_s is None else every_s)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class PlainProgress:
    """The off-terminal stand-in of a tqdm bar: counts, and logs a line when `every_s` passed since the last one."""

    def __init__(self, iterable=None, total: float | None = None, desc: str = "", unit: str = "it",
                 every_s: float = PROGRESS_EVERY_S):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit, self.every_s = iterable, total, desc, unit, every_s
        self.n, self.postfix, self.closed = 0, "", False
        self.lock = threading.Lock()  # regeneration's replicas update one bar from their threads
        self.t0 = self.last = time.monotonic()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kw) -> None:
        items = dict(ordered_dict or {}, **kw)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def refresh(self) -> None:
        pass

    def update(self, n: float = 1) -> None:
        with self.lock:
            self.n += n
            now = time.monotonic()
            if now - self.last < self.every_s:
                return
            self.last = now
        log.info(self.line(now))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n:
                log.info(self.line(time.monotonic(), final=True))

    def line(self, now: float, final: bool = False) -> str:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.n / elapsed
        done = f"{self.n:g}/{self.total:g}" if self.total else f"{self.n:g}"
        parts = [f"{done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.3g} {self.unit}/s")
        if final:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.n, 0) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return f"{self.desc}: " + ", ".join(parts)
