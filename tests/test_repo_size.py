"""The tracked tree travels with every GPU call (at most 64 MiB a call, the GGUF half and the chats included), so
the raw records of GPU runs in docs/gpu-runs stay gzipped: a 5.6 MB tree lets one call stage the GGUF's first
half, the chats and the gguf wheel (benchmarks/gpu_demo.sh stage)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LARGEST_PLAIN_RECORD = 64 * 1024   # bytes: a text record larger than this is committed as .gz (gzip -9 -n; benchmarks/records.open_record reads both)
TEXT_RECORDS = (".json", ".jsonl", ".log", ".txt")  # what gzip shrinks ~10x (plots are PNGs: already compressed)
TREE_LIMIT = 9 * 2**20             # bytes of tracked files: 64 MiB less the 56.5 MB stage carries, less a margin


def tracked(*paths: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_large_gpu_records_are_gzipped():
    plain = [str(p.relative_to(ROOT)) for p in tracked("docs/gpu-runs")
             if p.is_file() and p.suffix in TEXT_RECORDS and p.stat().st_size > LARGEST_PLAIN_RECORD]
    assert not plain, f"gzip these records (gzip -9 -n FILE, then git add FILE.gz): {plain}"


def test_the_tracked_tree_leaves_room_for_one_staging_call():
    size = sum(p.stat().st_size for p in tracked() if p.is_file())
    assert size < TREE_LIMIT, f"the tracked tree is {size / 2**20:.1f} MiB; GPU calls carry it with 56.5 MB of staging"
