#!/usr/bin/env python3
"""CPU benchmark: loading the tokenized-data cache (data/conversations._load_cache) with Python's cyclic garbage
collector paused while the samples are built (as the loader does) and running.

  PYTHONPATH=src .venv/bin/python benchmarks/cache_load_cpu.py [N]

N random samples (default 99,000, the GPU demo's self-written answers; 50-499 tokens each, ~27 M tokens) saved as a
cache file, then loaded three times each way, alternating; prints seconds per load, and the time to build the
flat arrays a BatchSchedule packs from (FlatSamples) once.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import dflash_train.data.conversations as conversations
from dflash_train.data.packing import DatasetSplit, FlatSamples


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 99_000
    rng = np.random.default_rng(0)
    lens = rng.integers(50, 500, n)
    ids = rng.integers(0, 49_152, int(lens.sum())).astype(np.int32)
    mask = rng.random(int(lens.sum())) < 0.7
    train = conversations._unflatten(ids, mask, lens)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.npz"
        conversations._save_cache(DatasetSplit(train=train, heldout=train[:256]), path)
        del train
        print(f"{n:,} samples, {lens.sum() / 1e6:.1f} M tokens, {path.stat().st_size / 1e6:.0f} MB")
        paused = conversations._collector_paused
        times: dict[str, list[float]] = {"paused": [], "running": []}
        for _ in range(3):
            for way in times:
                conversations._collector_paused = paused if way == "paused" else contextlib.nullcontext
                gc.collect()
                t0 = time.perf_counter()
                split = conversations._load_cache(path)
                times[way].append(time.perf_counter() - t0)
                del split
        conversations._collector_paused = paused
        for way, seconds in times.items():
            print(f"collector {way}: " + ", ".join(f"{s:.2f}" for s in seconds) + " s a load")
        split = conversations._load_cache(path)
        t0 = time.perf_counter()
        FlatSamples(split.train)  # what each BatchSchedule built for itself before it could take another's
        print(f"FlatSamples of the loaded samples: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
