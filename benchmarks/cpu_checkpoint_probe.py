#!/usr/bin/env python3
"""CPU probe: does the checkpoint writer thread hold up the other Python threads (the GIL)?

  PYTHONPATH=src python3 benchmarks/cpu_checkpoint_probe.py

A ticker thread sleeping 1 ms at a time records its largest gap while training/checkpointing.CheckpointManager
writes a drafter of the GPU demo's size (SmolLM2-135M target, 5 layers, 19.4 M trained parameters) with its AdamW
state, three times. A probe, not a benchmark: it says whether the writer can starve the pipeline's threads, not how
fast anything is.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import SMOLLM2_135M  # noqa: E402

from dflash_train.models.drafter import DFlashDrafter, build_drafter_config  # noqa: E402
from dflash_train.models.target import TargetInfo  # noqa: E402
from dflash_train.training.checkpointing import CheckpointManager  # noqa: E402


def main() -> None:
    info = TargetInfo.from_config(LlamaConfig(**SMOLLM2_135M))
    drafter = DFlashDrafter(build_drafter_config(info, [1, 8, 15, 22, 29], 0, num_draft_layers=5))
    params = [p for p in drafter.parameters() if p.requires_grad]
    print(f"drafter: {sum(p.numel() for p in params) / 1e6:.1f} M trained parameters")
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist, as in a checkpoint of a running job
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    gaps: list[float] = []
    stop = threading.Event()

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        with tempfile.TemporaryDirectory() as out:
            manager = CheckpointManager(out)
            for k in range(3):
                time.sleep(0.2)
                gaps.clear()
                t0 = time.perf_counter()
                manager.save(100 + k, drafter, optimizer, scheduler, data_position=0)
                t1 = time.perf_counter()
                manager.wait()
                t2 = time.perf_counter()
                long = [g for g in gaps if g > 0.005]
                print(f"save {k}: {1e3 * (t1 - t0):.0f} ms on the caller's thread (host copies), the write "
                      f"{1e3 * (t2 - t1):.0f} ms on its own; ticker's largest gap {1e3 * max(gaps):.0f} ms, "
                      f"gaps over 5 ms: {len(long)} ({1e3 * sum(long):.0f} ms)")
    finally:
        stop.set()
        ticker.join()


if __name__ == "__main__":
    main()
