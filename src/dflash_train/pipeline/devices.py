"""CUDA streams and events (no-ops on CPU), and the CPU thread budget.

Every GPU worker computes on a CUDA stream of its own (so a target and a drafter sharing one GPU overlap), and
work crosses between streams only through events: `record_event` after the producer's work, `wait_event` on the
consumer's stream before it reads. On CPU every op is synchronous, so both are no-ops there.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch



def cpu_threads_per_worker(devices: list[torch.device]) -> int | None:
    """Intra-op threads when several CPU workers compute at once: the cores split between them (None: no CPU work)."""
    n = sum(d.type == "cpu" for d in devices)
    return max(1, (os.cpu_count() or 1) // n) if n else None


def new_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def stream_scope(device: torch.device, stream):
    """Make `device` current and `stream` the current stream of this thread (both are thread-local in torch)."""
    if device.type != "cuda":
        return nullcontext()
    return _cuda_scope(device, stream)


@contextmanager
def _cuda_scope(device, stream):
    with torch.cuda.device(device):
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            # Worker streams do not order with the default stream: first wait for what the main thread queued
            # there (loading weights), and on the way out finish everything queued here, so the main thread may
            # read this worker's tensors (checkpoint, final weights) once the thread is done.
            torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
            try:
                yield
            finally:
                try:
                    torch.cuda.current_stream(device).synchronize()
                except RuntimeError:  # a broken context: the worker's own error is the one to report
                    pass


def current_stream(device: torch.device):
    """This thread's current stream of `device` (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def record_event(device: torch.device):
    """An event marking all work queued so far on this thread's current stream of `device` (None on CPU)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def wait_event(event, device: torch.device) -> None:
    """Make this thread's current stream of `device` wait for `event` (no host sync)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def sync_event(event) -> None:
    """Block the host until `event` has completed (no-op on CPU)."""
    if event is not None:
        event.synchronize()
