"""Fault injection for tests: `DFLASH_FAULT="<worker>:<phase>:<kind>[,...]"`, checked at named points of the run.

  worker  loader | target<i> | prefetch | drafter<i> | coordinator (the main thread: supervision, final checkpoint)
  phase   startup      end of the worker's setup (the coordinator: every worker ready, before the first step)
          step=<n>     steady state: the loader's and a target's n-th item (0-based), the prefetcher's batch n,
                       a drafter's optimizer step n (0-based), the coordinator once n steps are done
          checkpoint   while a checkpoint is being taken: the saver (drafter0 for periodic ones, the coordinator
          checkpoint=<n> for the final or signal one) after copying the weights and before the training state (the
                       disk write follows on the background writer); any other worker at its next wait while the
                       saver holds it open. <n>: only the n-th checkpoint of this run (0-based); bare: the first.
          shutdown     after the worker's loop ended normally (the coordinator: while it stops and joins the threads)
          warmup       an old name of startup
  kind    raise  an InjectedFault exception      oom  a torch.OutOfMemoryError (what CUDA raises), on any device
          stall  stop beating until the run is stopped (the coordinator: until the run has failed), then unwind
          nan / inf  poison the step's values: a drafter's loss and gradients, a target's features (step=<n> only)

e.g. DFLASH_FAULT="drafter0:startup:raise", "target0:step=3:nan", "drafter0:checkpoint=1:raise",
"coordinator:shutdown:stall". Every fault fires at most once. `DFLASH_FAULT_RANK=r` limits them to global rank r
under torchrun.

The seam: `FaultPlan.from_env()` is None unless faults are set for this process, and a run without a plan carries
None in `RunControl.faults`; every injection point is then one `is None` test, and checkpoints get no hook at all.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

import torch

from ..config import ConfigError
from .worker import Stopped

ENV_VAR = "DFLASH_FAULT"
RANK_ENV_VAR = "DFLASH_FAULT_RANK"
KINDS = ("raise", "stall", "oom", "nan", "inf")
VALUE_KINDS = ("nan", "inf")  # returned to the caller, which poisons its own tensors
_FAULT = re.compile(r"(?P<worker>loader|prefetch|coordinator|target\d+|drafter\d+):"
                    r"(?P<phase>startup|warmup|shutdown|step=(?P<step>\d+)|checkpoint(=(?P<ckpt>\d+))?):"
                    r"(?P<kind>[a-z]+)")
CHECKPOINT_WINDOW_S = 5.0  # how long a writer holds a checkpoint open for other workers' checkpoint faults


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws; its traceback shows where it was injected."""


@dataclass(frozen=True)
class Fault:
    worker: str
    phase: str        # startup | step | checkpoint | shutdown
    n: int | None     # step=<n> / checkpoint=<n>
    kind: str
    spec: str = field(default="", compare=False)  # as written, for messages

    def __str__(self):
        return self.spec or f"{self.worker}:{self.phase}{'' if self.n is None else f'={self.n}'}:{self.kind}"


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in (text or "").split(","))):
        m = _FAULT.fullmatch(spec)
        if m is None or m["kind"] not in KINDS:
            raise ConfigError(f"{ENV_VAR} entry {spec!r} must look like worker:phase:kind (phase startup, step=N, "
                              f"checkpoint[=N] or shutdown; kind {', '.join(KINDS)}), e.g. drafter0:step=2:raise.")
        phase = m["phase"].partition("=")[0].replace("warmup", "startup")
        n = m["step"] or m["ckpt"]
        fault = Fault(m["worker"], phase, int(n) if n is not None else (0 if phase == "checkpoint" else None),
                      m["kind"], spec)
        if fault.kind in VALUE_KINDS and (fault.phase != "step" or not fault.worker.startswith(("drafter", "target"))):
            raise ConfigError(f"{ENV_VAR} entry {spec!r}: {fault.kind} poisons a step's values, so it needs a drafter "
                              "or target worker and a step=N phase, e.g. drafter1:step=3:nan.")
        faults.append(fault)
    return faults


def poison_(kind: str, *tensors: torch.Tensor) -> None:
    """What a `nan` / `inf` fault does to a step: overwrite its tensors in place."""
    for t in tensors:
        t.fill_(float(kind))


class FaultPlan:
    """The faults of one run. Threads call `check` at their named points; checkpoint writers call `in_checkpoint`."""

    def __init__(self, faults: list[Fault] | None = None):
        self.faults = list(faults or [])
        self._lock = threading.Lock()
        self._fired: set[Fault] = set()
        self._checkpoints = 0                 # checkpoints started so far
        self.checkpoint_open: int | None = None  # index of the checkpoint a writer holds open, for other workers

    @classmethod
    def from_env(cls) -> "FaultPlan | None":
        """The faults DFLASH_FAULT names, when it names any for this rank (DFLASH_FAULT_RANK); None otherwise."""
        only = os.environ.get(RANK_ENV_VAR)
        if only is not None and only.strip() != os.environ.get("RANK", "0"):
            return None
        faults = parse_faults(os.environ.get(ENV_VAR))
        return cls(faults) if faults else None

    def check(self, worker: str, phase: str, release: threading.Event, n: int | None = None) -> str | None:
        """Fire `worker`'s fault for this point, if any (once). Raises for raise/oom; a stall waits for `release`
        without beating, then raises Stopped; nan/inf are returned for the caller to apply with poison_."""
        if not self.faults:
            return None
        with self._lock:
            fault = next((f for f in self.faults if f not in self._fired and f.worker == worker and f.phase == phase
                          and f.n == n), None)
            if fault is None:
                return None
            self._fired.add(fault)
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault {fault}")
        if fault.kind == "oom":
            raise torch.OutOfMemoryError(f"injected fault {fault}: out of memory (simulated CUDA OOM)")
        if fault.kind == "stall":
            while not release.wait(0.05):  # no heartbeat here: only the stall detector can end this
                pass
            raise Stopped
        return fault.kind

    def check_checkpoint(self, worker: str, release: threading.Event) -> None:
        """A non-writer's checkpoint point: fires only while a writer holds a checkpoint open."""
        if (index := self.checkpoint_open) is not None:
            self.check(worker, "checkpoint", release, index)

    def in_checkpoint(self, writer: str, release: threading.Event, others_running: bool = True) -> None:
        """Called by a checkpoint's saver after copying the weights, before the training state. Fires its own
        fault, then (while other workers run) holds the write open, up to CHECKPOINT_WINDOW_S or until `release`,
        so that their faults for this checkpoint fire at their next wait."""
        with self._lock:
            index, self._checkpoints = self._checkpoints, self._checkpoints + 1
        self.check(writer, "checkpoint", release, index)
        others = [f for f in self.faults if f.phase == "checkpoint" and f.n == index and f.worker != writer]
        if not others_running:  # the coordinator's final write: nobody else is left to fire
            others = []
        self.checkpoint_open = index
        try:
            deadline = time.monotonic() + CHECKPOINT_WINDOW_S
            while any(f not in self._fired for f in others) and time.monotonic() < deadline:
                if release.wait(0.01):
                    break
        finally:
            self.checkpoint_open = None
