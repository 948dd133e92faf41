"""Flex-attention tile helpers shared by the target's document mask (models/target.py) and the drafter's DFlash mask
(training/objective.py): both build their BlockMask from per-tile bounds, never from an element mask."""

from __future__ import annotations

import torch

FLEX_TILE = 128  # flex-attention sparse tile (queries x keys): the kernels' default block size


def ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Qt, KVt] -> (count [Qt], indices [Qt, KVt]) int32, the set tiles first in ascending order."""
    t = tiles.to(torch.int32)
    return t.sum(-1, dtype=torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
