#!/usr/bin/env python3
"""CPU benchmark: tokenizing chat data in the run's process against data.tokenize_workers processes.

  PYTHONPATH=src .venv/bin/python benchmarks/tokenize_cpu.py TARGET CHATS.jsonl[.gz] [N] [WORKERS ...]

TARGET: a local Hugging Face directory or .gguf whose tokenizer and chat template the run uses; CHATS: chat records
(e.g. the GPU demo's self_regenerated.jsonl.gz, which benchmarks/gpu_demo.sh brings back); N: the first N
conversations (default 20,000); WORKERS: the settings to time (default 0 and every core but one). No cache: every
setting tokenizes from scratch. Prints conversations per second per setting and the CPU seconds of the run's own
process (with workers: its share, reading and routing), and checks that every setting gives the same split as the
first. COLLECTOR=running keeps Python's garbage collector on while the split is built (the loader pauses it).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dflash_train.data.conversations as conversations
from dflash_train.config import DataConfig
from dflash_train.data.conversations import load_chat_dataset
from dflash_train.models.target import load_tokenizer


def main(argv: list[str]) -> None:
    if os.environ.get("COLLECTOR") == "running":
        conversations._collector_paused = contextlib.nullcontext
    target, chats = argv[0], Path(argv[1])
    n = int(argv[2]) if len(argv) > 2 else 20_000
    cores = len(os.sched_getaffinity(0))
    settings = [int(w) for w in argv[3:]] or [0, max(1, cores - 1)]
    tokenizer = load_tokenizer(target)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        with (gzip.open(chats, "rb") if chats.suffix == ".gz" else open(chats, "rb")) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        first = None
        print(f"{cores} cores; the first {n:,} conversations of {chats}")
        for workers in settings:
            cfg = DataConfig(source=str(path), max_samples=n, tokenize_workers=workers)
            t0, cpu0 = time.perf_counter(), time.process_time()
            split = load_chat_dataset(cfg, tokenizer, cache_dir=None)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            same = "" if first is None else ("same split" if (split.train, split.heldout) == first else "DIFFERENT")
            first = first or (split.train, split.heldout)
            done = split.stats["train"] + split.stats["heldout"] + sum(split.stats["skipped"].values())
            print(f"tokenize_workers={workers}: {done:,} conversations tokenized in {seconds:.1f} s, "
                  f"{done / seconds:,.0f} conv/s, this process's CPU {cpu:.2f} s {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
