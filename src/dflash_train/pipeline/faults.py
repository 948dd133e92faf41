"""Fault injection for tests: `DFLASH_FAULT="<worker>:<point>:<action>[,...]"`, checked at named points in workers.

  worker  loader | target<i> | prefetch | drafter<i>
  point   warmup (end of a worker's setup) | step=<n> (the worker's n-th item, 0-based; for drafters the
          optimizer step index)
  action  raise (an InjectedFault exception) | stall (stop beating until the run is stopped)

e.g. DFLASH_FAULT="drafter0:warmup:raise", "target0:step=3:raise", "drafter1:step=2:stall". Unset: no faults.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ..config import ConfigError
from .worker import Stopped

ENV_VAR = "DFLASH_FAULT"
ACTIONS = ("raise", "stall")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws; its traceback shows where it was injected."""


@dataclass(frozen=True)
class Fault:
    worker: str
    point: str        # "warmup" or "step"
    step: int | None  # for point == "step"
    action: str

    def __str__(self):
        point = f"step={self.step}" if self.point == "step" else self.point
        return f"{self.worker}:{point}:{self.action}"


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in (text or "").split(","))):
        parts = spec.split(":")
        ok = len(parts) == 3 and parts[2] in ACTIONS
        point, step = (parts[1], None) if ok else ("", None)
        if ok and point.startswith("step="):
            ok = point[5:].isdigit()
            point, step = "step", int(point[5:]) if ok else None
        elif ok and point != "warmup":
            ok = False
        if not ok:
            raise ConfigError(f"{ENV_VAR} entry {spec!r} must look like worker:warmup|step=N:raise|stall, "
                              "e.g. drafter0:step=2:raise.")
        faults.append(Fault(parts[0], point, step, parts[2]))
    return faults


class FaultPlan:
    """The faults of one run; `check` is called by workers at their named points."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls(parse_faults(os.environ.get(ENV_VAR)))

    def check(self, worker: str, point: str, stop: threading.Event, step: int | None = None) -> None:
        for f in self.faults:
            if f.worker == worker and f.point == point and f.step == step:
                if f.action == "raise":
                    raise InjectedFault(f"injected fault {f}")
                while not stop.wait(0.05):  # stall: no heartbeat, but leave when the run stops
                    pass
                raise Stopped
