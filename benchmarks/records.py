"""Reading run records (standard library only): docs/gpu-runs keeps its large text records gzipped
(tests/test_repo_size.py), so the scripts that read them take a .gz path as well as a plain one."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import TextIO


def open_record(path: str | Path) -> TextIO:
    """A text record for reading, gunzipped on the fly when its name ends in .gz."""
    return (gzip.open if str(path).endswith(".gz") else open)(path, "rt", encoding="utf-8")
