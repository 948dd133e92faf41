#!/usr/bin/env python3
"""What a host-tier row costs to land in host memory (models/feature_cache._host_copy), on the CPU alone: a 45 MiB bf16
row (the GPU demo's: 8,192 tokens x 5 taps x 576) copied into a buffer already faulted in, into a fresh buffer as
`tensor.to("cpu")` does, into a fresh buffer faulted in by zero_() first, per intra-op thread count, and into one
faulted in by numpy's fill on one thread (a way tried for the host tier's copier and dropped: too slow on the H100
host, docs/BENCHMARKS.md "Feature cache").

  PYTHONPATH=src python3 benchmarks/host_copy_cpu.py [ROWS]     # ROWS copies each (default 40)

A CPU-to-CPU copy stands in for the device-to-host one, whose destination pages the CUDA driver faults in on one
thread. A probe: its figures go to docs with this command.
"""

from __future__ import annotations

import sys
import time

import torch

ROW = 8192 * 5 * 576


def per_row_ms(fn, rows: int) -> float:
    kept = []
    start = time.perf_counter()
    for _ in range(rows):
        kept.append(fn())          # kept, as the host tier keeps them: freed pages are not reused in between
    return (time.perf_counter() - start) / rows * 1e3


def _numpy_filled(like: torch.Tensor) -> torch.Tensor:
    host = torch.empty_like(like)
    host.view(torch.uint8).numpy().fill(0)
    return host


def main(rows: int) -> None:
    src = torch.ones(ROW, dtype=torch.bfloat16)
    faulted = torch.empty_like(src).zero_()
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        warm = per_row_ms(lambda: faulted.copy_(src), rows)
        fresh = per_row_ms(lambda: src.to("cpu", copy=True), rows)
        prefault = per_row_ms(lambda: torch.empty_like(src).zero_().copy_(src), rows)
        filled = per_row_ms(lambda: _numpy_filled(src).copy_(src), rows)
        print(f"{threads} intra-op thread(s), a {ROW * 2 / 2**20:.0f} MiB row: into a faulted buffer {warm:.1f} ms, "
              f"into a fresh one {fresh:.1f} ms, zero_() then copy {prefault:.1f} ms, numpy fill then copy {filled:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
