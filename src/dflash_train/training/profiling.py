"""train.profile_after / train.profile_steps: a torch.profiler trace of a few training steps of a real run.

The benchmarks time each stage alone; a run's steps also share the device with the other stages (the target's
forward, the copies in and out, validation, checkpoints). The profiler records the operators of the thread that
trains (replica 0's; other threads' operators are not recorded, seen on the CPU) and, on CUDA, the device's
kernels through CUPTI, which sees every kernel whichever thread launched it (not yet run on a GPU), so a window of
steps shows where the time the stages alone do not explain goes: the device idle between kernels, or kernels of
another stage.

It runs on replica 0's thread, between steps: it starts once step `after` is done (its validation and checkpoint
included) and stops when step `after + steps` is, then writes <out_dir>/profile/trace.json (chrome://tracing or
https://ui.perfetto.dev) and kernels.txt (operators and kernels by device time) and logs one line: the window's
wall time a step and, on CUDA, how much of it the device spent in kernels.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("dflash_train")


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end) intervals (any unit) -> the disjoint spans of their union, in order: where the device ran at
    least one kernel, kernels on several streams overlapping. The gaps between spans are its idle time."""
    spans: list[list[float]] = []
    for a, b in sorted(intervals):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals, in their unit: time the device spent in kernels."""
    return sum(b - a for a, b in merge_intervals(intervals))


class StepProfiler:
    """Traces steps after+1 .. after+steps (1-based) of the calling thread's training loop; off when after is 0."""

    def __init__(self, after: int, steps: int, out_dir: Path | None, device: torch.device, done: int = 0,
                 total_steps: int | None = None):
        """done: the steps trained before this process (a resumed run); total_steps: the run's last step."""
        self.after, self.steps, self.device = after, steps, device
        self.dir = Path(out_dir) / "profile" if out_dir is not None else None
        self._prof = None
        self._t0 = 0.0
        last = total_steps if total_steps is not None else float("inf")
        if self.enabled and not done < after < last:  # the window starts when step `after` ends in this process
            log.warning(f"train.profile_after={after} is outside this run's steps ({done + 1} to {last}): nothing "
                        f"will be traced; set it from {done + 1} to {last - 1}.")
            self.after = 0  # off

    @property
    def enabled(self) -> bool:
        return self.after > 0 and self.dir is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def after_step(self, step: int) -> None:
        """Called when step `step` is done and reported."""
        if not self.enabled:
            return
        if step == self.after:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._sync()  # the window holds its own steps' kernels only
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif self._prof is not None and step >= self.after + self.steps:
            self.finish(step)

    def finish(self, step: int) -> None:
        """Stop and write the trace (also when the run ends inside the window: then fewer steps are traced)."""
        if self._prof is None:
            return
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        traced = step - self.after
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / "trace.json"))
        from torch.autograd import DeviceType

        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        sort = "device_time_total" if kernels else "cpu_time_total"
        (self.dir / "kernels.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90) + "\n")
        per_step = wall * 1e3 / max(1, traced)
        line = f"profile of steps {self.after + 1}-{step}: {per_step:.2f} ms a step"
        if kernels:
            busy = union_length([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / max(1, traced)
            line += f", the device in kernels {busy:.2f} ms of it ({busy / per_step:.0%})"
        log.info(f"{line}; trace and kernel table in {self.dir}")
