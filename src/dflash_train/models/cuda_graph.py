"""Replay a fixed-shape decoding step as one CUDA graph, or run it eagerly (CPU, tests, `graphs=False`).

A small model's decode step is a few hundred tiny kernels; launched one by one from Python, host overhead dominates
(plain HF `generate` of SmolLM2-135M runs at tens of tokens/s even on an H200). Captured once and replayed, the
whole step is one launch. The step function reads only static buffers that the caller fills before each call, and
returns tensors that the next replay overwrites: consume (or copy) them before calling again.

Manual capture (`torch.cuda.graph`), not `torch.compile(mode="reduce-overhead")`: no compile time, no CUDAGraph
Trees (which fail in worker threads on torch 2.11, docs/DESIGN.md), and the same code runs eagerly on CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def resolve_graphs(graphs: bool | None, device: torch.device) -> bool:
    """None = auto: CUDA graphs on CUDA devices, eager elsewhere."""
    if graphs is None:
        return device.type == "cuda"
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    return graphs


class GraphedStep:
    """`fn()` -> outputs; with `graphs=True`, warmed up, captured once at construction, then replayed.

    `fn` must be capturable: no host syncs (.item(), .tolist(), printing tensors), no CPU->GPU copies, only reads of
    buffers whose addresses never change. Warm-up and capture run `fn` on whatever the buffers hold, so it must be
    harmless to run at construction time (it writes garbage into cache slots that are overwritten before use)."""

    def __init__(self, fn: Callable[[], Any], graphs: bool, warmup: int = 2, pool=None):
        """pool: a torch.cuda.graph_pool_handle() shared by steps that never run at the same time and return
        nothing (they write into buffers of their own), so their activations share one pool."""
        self.fn, self.graph, self.out = fn, None, None
        if not graphs:
            return
        # Warm-up on a side stream (as torch.cuda.graph requires): lazy inits, cuBLAS handles, kernel selection.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's allocation or pinned-memory call (regeneration replicas, the pipeline's
        # loader) during this capture must not invalidate it; the default 'global' mode would.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"), torch.no_grad():
            self.out = fn()

    @torch.no_grad()
    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out
