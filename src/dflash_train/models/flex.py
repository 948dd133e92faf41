"""Flex-attention tile helpers shared by the target's document mask (models/target.py) and the drafter's DFlash mask
(training/objective.py): both build their BlockMask from per-tile bounds, never from an element mask, and without a
sort: inside a compiled step a sort becomes a Triton kernel that compiles for tens of seconds (the drafter step's
mask took 20.6 s and 27.0 s a kernel on an H100, docs/gpu-runs/2026-12-06-h100-checks/), a prefix sum and a
scatter compile in a fraction of that."""

from __future__ import annotations

from typing import Callable

import torch

FLEX_TILE = 128  # flex-attention sparse tile (queries x keys): the kernels' default block size


def ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R, C] -> (count [R], indices [R, C]) int32: each row's set tiles first, ascending, then the others,
    ascending; the same as a stable descending argsort of `tiles`, from a prefix sum: a set tile's place is the number
    of set tiles before it, an unset tile's is the row's count plus the number of unset tiles before it."""
    t = tiles.to(torch.int32)
    count = t.sum(-1, dtype=torch.int32)
    set_before = t.cumsum(-1, dtype=torch.int32) - t
    unset_before = (1 - t).cumsum(-1, dtype=torch.int32) - (1 - t)
    place = torch.where(tiles, set_before, count[:, None] + unset_before).long()
    cols = torch.arange(tiles.shape[-1], dtype=torch.int32, device=tiles.device).expand_as(t)
    return count, torch.zeros_like(t).scatter(-1, place, cols)


def tile_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod: Callable, seq_lengths: tuple[int, int],
                    tile: int = FLEX_TILE):
    """bool [Qt, KVt] tiles (partial: mask_mod decides per element; full: every pair visible) -> BlockMask
    [1, 1, Qt*tile, KVt*tile]. Both orderings are built here, the key tiles of each query tile (the forward's) and the
    query tiles of each key tile (the backward's), so `BlockMask.from_kv_blocks` does not derive the second with
    argsorts."""
    from torch.nn.attention.flex_attention import BlockMask

    (kv_num, kv_idx), (full_num, full_idx) = ordered_tiles(partial), ordered_tiles(full)
    (q_num, q_idx), (full_q_num, full_q_idx) = ordered_tiles(partial.t()), ordered_tiles(full.t())
    return BlockMask(seq_lengths=seq_lengths, kv_num_blocks=kv_num[None, None], kv_indices=kv_idx[None, None],
                     full_kv_num_blocks=full_num[None, None], full_kv_indices=full_idx[None, None],
                     q_num_blocks=q_num[None, None], q_indices=q_idx[None, None],
                     full_q_num_blocks=full_q_num[None, None], full_q_indices=full_q_idx[None, None],
                     BLOCK_SIZE=(tile, tile), mask_mod=mask_mod)
