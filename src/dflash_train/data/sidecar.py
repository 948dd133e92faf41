"""The settings side file of a generated dataset: <out>.meta.json records what made <out>, so that a file made with
other settings is never silently extended (regenerated conversations, self-written prompts)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import UserError

log = logging.getLogger("dflash_train")


def check_settings_file(out_path: Path, want: dict, replace: bool, what: str, fix: str) -> None:
    """Refuse (or, with replace, start over) when out_path holds data written with settings other than `want`;
    then record `want`. what: what the file holds ("regenerated conversations"); fix: the sentence's way out."""
    meta = out_path.with_suffix(".meta.json")
    if out_path.is_file() and out_path.stat().st_size > 0:
        have = json.loads(meta.read_text()) if meta.is_file() else None
        if have != want:
            if not replace:
                diff = "unknown settings" if have is None else ", ".join(
                    f"{k}={have.get(k)!r} (now {v!r})" for k, v in want.items() if have.get(k) != v)
                raise UserError(f"{out_path} holds {what} made with other settings ({diff}); {fix}.")
            log.warning(f"{out_path} was written with other settings: starting over")
            out_path.unlink()
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out_path.parent} cannot be created ({e.strerror}); choose an output path you can write "
                        "to.") from None
    meta.write_text(json.dumps(want, indent=2) + "\n")
