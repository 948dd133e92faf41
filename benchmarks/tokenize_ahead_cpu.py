#!/usr/bin/env python3
"""CPU benchmark: the time from a regenerated file's last line to its tokenized data, with data.tokenize_ahead's
child following the file as it is written, and without (the run tokenizes the finished file).

  PYTHONPATH=src .venv/bin/python benchmarks/tokenize_ahead_cpu.py TARGET CHATS.jsonl[.gz] [N] [RATE]

TARGET: a local Hugging Face directory or .gguf (its tokenizer and chat template); CHATS: chat records; N: the first
N of them (default 20,000), written into a fresh file at RATE conversations a second (default 540, the GPU demo's
answers on an H100) by a thread of this process, as the regeneration writes them. Prints, for each way, the
seconds between the last line written and the run's split in hand, and checks that both give the same split.
"""

from __future__ import annotations

import gzip
import sys
import tempfile
import threading
import time
from pathlib import Path

from dflash_train.config import DataConfig
from dflash_train.data.conversations import load_chat_dataset
from dflash_train.data.tokenize_ahead import TokenizeAhead, ahead_threads
from dflash_train.models.target import load_tokenizer


def write_at(lines: list[str], path: Path, rate: float) -> None:
    """Append the lines to path at `rate` lines a second, in batches of 64 (a regeneration batch finishing)."""
    t0 = time.perf_counter()
    with open(path, "a", encoding="utf-8") as f:
        for start in range(0, len(lines), 64):
            f.write("".join(lines[start:start + 64]))
            f.flush()
            time.sleep(max(0.0, t0 + (start + 64) / rate - time.perf_counter()))


def main(argv: list[str]) -> None:
    target, chats = argv[0], Path(argv[1])
    n = int(argv[2]) if len(argv) > 2 else 20_000
    rate = float(argv[3]) if len(argv) > 3 else 540.0
    tokenizer = load_tokenizer(target)
    with (gzip.open(chats, "rt") if chats.suffix == ".gz" else open(chats)) as f:
        lines = [line for line, _ in zip(f, range(n))]
    print(f"{len(lines):,} conversations written at {rate:g}/s ({len(lines) / rate:.0f} s); child threads "
          f"{ahead_threads()}")
    splits = {}
    for ahead in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            path, cache = Path(tmp) / "answers.jsonl", str(Path(tmp) / "cache")
            path.touch()
            cfg = DataConfig(source=str(path))
            child = TokenizeAhead(cfg, tokenizer, 0, cache, Path(tmp) / "scratch") if ahead else None
            write_at(lines, path, rate)
            written = time.perf_counter()
            if child is not None:
                child.finish()
            split = load_chat_dataset(cfg, tokenizer, cache_dir=cache)
            seconds = time.perf_counter() - written
            splits[ahead] = (split.train, split.heldout)
            print(f"tokenize_ahead={ahead}: data in hand {seconds:.1f} s after the last line (cache "
                  f"{split.stats['cache']})")
    print("same split" if splits[True] == splits[False] else "DIFFERENT SPLITS")


if __name__ == "__main__":
    main(sys.argv[1:])
