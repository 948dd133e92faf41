#!/usr/bin/env python3
"""CPU probe (issue #16): how much a checkpoint holds up the training threads, on the caller's thread and through the
GIL while the background writer runs.

  PYTHONPATH=src .venv/bin/python benchmarks/checkpoint_gil_probe.py [caller] [write] [parts]   (default: all three)

The state is the GPU demo's: a drafter for SmolLM2-135M (5 layers, hidden 576, 19.4 M fp32 parameters) and its
AdamW moments after one backward. Tables:
  caller   what CheckpointManager.save spends on the caller's thread, piece by piece (on the CPU the host copies are
           clones; on CUDA they are non-blocking copies into pinned buffers, so there the other rows are the cost)
  write    the background write of SAVES saves, watched by (b) a GIL probe thread (sleeps 0.5 ms, records how late it
           wakes: the largest lateness, the summed lateness over its idle median, and the part of that sum from
           wake-ups over 1 ms late) and, in a second pass, (c) a launch loop (small torch calls, each releasing and
           retaking the GIL, then a 1 ms wait, like a pipeline thread launching a step and waiting for the device):
           how much longer its launches take. The same writes in a child process are the control: they compete for
           the cores and the disk but not for this process's GIL
  parts    each piece of the write alone on a background thread, with the GIL probe; every repeat writes into a
           fresh directory, as the writer does (torch.save over an existing file holds the GIL while the old file is
           truncated: tens to hundreds of ms, which the writer never pays)
A probe, not a disk benchmark: write times follow the page cache. What to read is the lateness against the control.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import SMOLLM2_135M  # noqa: E402

from dflash_train.models import checkpoint as servable  # noqa: E402
from dflash_train.models.drafter import DFlashDrafter, build_drafter_config  # noqa: E402
from dflash_train.models.target import TargetInfo, default_layer_ids  # noqa: E402
from dflash_train.training import checkpointing  # noqa: E402
from dflash_train.training.checkpointing import CheckpointManager  # noqa: E402

SAVES = 3
PROBE_SLEEP_S = 0.0005
LATE_S = 0.001  # a wake-up later than this waited for the GIL (shorter delays are the scheduler's)
LAUNCH_OPS = 40  # small torch calls per "step launch"
LAUNCH_WAIT_S = 0.001  # the "device time" the launch loop then sleeps


class Sampler:
    """A thread that calls `body` until stopped and records (time, the seconds `body` returns) of each call."""

    def __init__(self, name: str, body):
        self.samples: list[tuple[float, float]] = []
        self._body, self._stop = body, threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            span = self._body()
            self.samples.append((time.perf_counter(), span))

    def __enter__(self):
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> list[float]:
        return [d for t, d in self.samples if t0 <= t <= t1]


def gil_probe() -> Sampler:
    """Records how long a PROBE_SLEEP_S sleep takes: the sleep, then the wait for the GIL."""
    def sleep() -> float:
        t0 = time.perf_counter()
        time.sleep(PROBE_SLEEP_S)
        return time.perf_counter() - t0
    return Sampler("gil-probe", sleep)


def launch_loop() -> Sampler:
    """Records how long LAUNCH_OPS small torch calls take, then waits LAUNCH_WAIT_S (the device's time)."""
    x = torch.ones(64)

    def launch() -> float:
        t0 = time.perf_counter()
        for _ in range(LAUNCH_OPS):
            x.mul_(1.0).add_(0.0)  # in place: no allocation; each call releases and retakes the GIL
        span = time.perf_counter() - t0
        time.sleep(LAUNCH_WAIT_S)
        return span
    return Sampler("launch-loop", launch)


def idle_median(sampler: Sampler, seconds: float = 0.5) -> float:
    t0 = time.perf_counter()
    time.sleep(seconds)
    return statistics.median(sampler.between(t0, time.perf_counter()))


def lateness(durations: list[float], base: float) -> list[str]:
    """Largest and summed lateness over the idle median, the sum over wake-ups later than LATE_S, and the mean
    against idle."""
    late = [max(0.0, d - base) for d in durations]
    return [f"{1e3 * max(late, default=0.0):.1f}", f"{1e3 * sum(late):.0f}",
            f"{1e3 * sum(x for x in late if x > LATE_S):.0f}",
            f"{statistics.fmean(durations) / base:.2f}x" if durations else "-"]


def build_state():
    info = TargetInfo.from_config(LlamaConfig(**SMOLLM2_135M))
    cfg = build_drafter_config(info, default_layer_ids(info.num_layers, 5), 0, num_draft_layers=5)
    drafter = DFlashDrafter(cfg)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sum(p.square().sum() for p in drafter.parameters()).backward()  # one backward: real gradients, moments follow
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return drafter, optimizer, scheduler


def table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def timed(fn, repeats: int = SAVES) -> float:
    """Median ms of fn()."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


# ---------------------------------------------------------------------------------------------- caller


def meta_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """The snapshot save() took before DrafterSnapshot: the drafter's class built on the meta device."""
    with torch.device("meta"):
        return type(drafter)(drafter.config)


def caller_rows(drafter, optimizer, scheduler) -> list[list]:
    """The pieces of save() that run on the caller's thread (replica 0's drafter thread in the pipeline), and a
    reference row: the module save() built before DrafterSnapshot."""
    copier = checkpointing.HostCopier()
    weights = copier.copy(drafter.state_dict())
    rows = [["drafter.state_dict()", drafter.state_dict],
            ["optimizer.state_dict()", optimizer.state_dict],
            ["scheduler state (deepcopy)", lambda: copy.deepcopy(scheduler.state_dict())],
            ["rng_state()", checkpointing.rng_state],
            ["host copies (CPU: clones)", lambda: (copier.copy(drafter.state_dict()),
                                                   copier.copy(optimizer.state_dict()))],
            ["DrafterSnapshot(config, weights)", lambda: servable.DrafterSnapshot(drafter.config, weights)],
            ["reference: a module on meta", lambda: meta_drafter(drafter)]]
    return [[name, f"{timed(fn):.1f}"] for name, fn in rows]


# ---------------------------------------------------------------------------------------------- write


def saves(drafter, optimizer, scheduler, out: str) -> list[tuple[float, float, float]]:
    """SAVES checkpoints: (save() called, save() returned, the writer thread ended) of each. The write's end is the
    thread's, not wait()'s: on the CPU, wait() then frees the snapshot's clones (tens of ms holding the GIL); on
    CUDA the snapshot is pinned buffers kept for the next save, and nothing is freed."""
    manager = CheckpointManager(out, run_id="probe")
    spans = []
    for k in range(SAVES):
        time.sleep(0.2)
        t0 = time.perf_counter()
        manager.save(100 * (k + 1), drafter, optimizer, scheduler, data_position=0)
        t1 = time.perf_counter()
        for writer in [t for t in threading.enumerate() if t.name == "dflash-checkpoint"]:
            writer.join()
        spans.append((t0, t1, time.perf_counter()))
        manager.wait()
    return spans


def child_saves(out: str) -> list[tuple[float, float, float]]:
    """saves() in a child process (perf_counter is CLOCK_MONOTONIC, one clock for both processes)."""
    proc = subprocess.run([sys.executable, __file__, "--child", out], capture_output=True, text=True, check=True)
    return [tuple(map(float, line.split()[1:])) for line in proc.stdout.splitlines() if line.startswith("span ")]


def write_rows(drafter, optimizer, scheduler, make_sampler) -> list[list]:
    with make_sampler() as s, tempfile.TemporaryDirectory() as out:
        base = idle_median(s)
        spans = [("thread", *x) for x in saves(drafter, optimizer, scheduler, out)]
        spans += [("process (control)", *x) for x in child_saves(out + "/child")]
        return [[f"{where} {k % SAVES}", f"{1e3 * (t1 - t0):.0f}", f"{1e3 * (t2 - t1):.0f}",
                 *lateness(s.between(t1, t2), base)] for k, (where, t0, t1, t2) in enumerate(spans)]


# ---------------------------------------------------------------------------------------------- parts


def write_parts(drafter, optimizer, scheduler) -> dict:
    """The writer's pieces in its order, each a callable writing into the directory it is given (the code the
    writer thread runs)."""
    copier = checkpointing.HostCopier()
    weights = copier.copy(drafter.state_dict())
    host = servable.DrafterSnapshot(drafter.config, weights)
    state = {"step": 1, "data_position": 0, "optimizer": copier.copy(optimizer.state_dict()),
             "scheduler": scheduler.state_dict(), "rng": checkpointing.rng_state(), "extra": {}, "run_id": "probe"}
    return {
        "bf16 rounding": lambda d: {k: v.to(servable.SERVE_DTYPE) for k, v in weights.items()},
        "save_drafter (bf16 servable)": lambda d: servable.save_drafter(host, d),
        "save_training_weights (fp32)": lambda d: servable.save_training_weights(host, d),
        "torch.save(training state)": lambda d: torch.save(state, d / checkpointing.STATE_NAME),
        "fsync the directory": checkpointing._fsync_dir_tree,
    }


def parts_rows(drafter, optimizer, scheduler) -> list[list]:
    parts = write_parts(drafter, optimizer, scheduler)
    spans: dict[str, list] = {name: [] for name in parts}
    with gil_probe() as s, tempfile.TemporaryDirectory() as tmp:
        base = idle_median(s)
        for k in range(SAVES):
            d = Path(tmp) / f"step_{k}"
            d.mkdir()
            for name, fn in parts.items():
                time.sleep(0.1)
                worker = threading.Thread(target=fn, args=(d,))
                t0 = time.perf_counter()
                worker.start()
                worker.join()
                spans[name].append((t0, time.perf_counter()))
    rows = []
    for name, runs in spans.items():
        runs.sort(key=lambda ab: ab[1] - ab[0])
        t0, t1 = runs[len(runs) // 2]  # the median-length run's numbers
        rows.append([name, f"{1e3 * (t1 - t0):.0f}", *lateness(s.between(t0, t1), base)])
    return rows


def main(sections: list[str]) -> None:
    torch.manual_seed(0)
    drafter, optimizer, scheduler = build_state()
    n = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n / 1e6:.1f} M fp32 parameters; {torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} cores, switch interval {1e3 * sys.getswitchinterval():.0f} ms")
    late = ["max late ms", "late sum ms", f"sum >{1e3 * LATE_S:.0f} ms late", "mean vs idle"]
    if "caller" in sections:
        table("save() on the caller's thread, ms (median of 3)", ["part", "ms"],
              caller_rows(drafter, optimizer, scheduler))
    if "write" in sections:
        head = ["writer", "save() ms", "write ms", *late]
        table(f"(b) the write, with the GIL probe (sleep {1e3 * PROBE_SLEEP_S} ms)", head,
              write_rows(drafter, optimizer, scheduler, gil_probe))
        table(f"(c) the write, with the launch loop ({LAUNCH_OPS} small torch calls, then {1e3 * LAUNCH_WAIT_S:.0f} ms)"
              "; lateness of the launches", head, write_rows(drafter, optimizer, scheduler, launch_loop))
    if "parts" in sections:
        table("the write's parts alone on a thread, with the GIL probe (median of 3)", ["part", "ms", *late],
              parts_rows(drafter, optimizer, scheduler))


def child(out: str) -> None:
    drafter, optimizer, scheduler = build_state()
    for span in saves(drafter, optimizer, scheduler, out):
        print("span", *span, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main(sys.argv[1:] or ["caller", "write", "parts"])
