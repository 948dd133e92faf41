"""The sort-free tile orderings behind every flex BlockMask (models/flex.py) against torch's own: a stable
descending argsort, and `BlockMask.from_kv_blocks`, which derives the query-side ordering with argsorts."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash_train.models.flex import ordered_tiles, tile_block_mask

ORDERINGS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (1, 9), (3, 7), (64, 192)])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_ordered_tiles_is_a_stable_descending_argsort(shape, density):
    tiles = torch.rand(shape, generator=torch.Generator().manual_seed(sum(shape))) < density
    count, idx = ordered_tiles(tiles)
    assert count.dtype == idx.dtype == torch.int32
    assert torch.equal(count, tiles.sum(-1, dtype=torch.int32))
    assert torch.equal(idx, torch.argsort(tiles.int(), dim=-1, descending=True, stable=True).int())


@pytest.mark.parametrize("seed", range(4))
def test_tile_block_mask_equals_torchs_from_kv_blocks(seed):
    g = torch.Generator().manual_seed(seed)
    qt, kvt, tile = 3 + seed, 2 + 3 * seed, 16
    partial = torch.rand(qt, kvt, generator=g) < 0.4
    full = (torch.rand(qt, kvt, generator=g) < 0.4) & ~partial

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = tile_block_mask(partial, full, mask_mod, (qt * tile - 5, kvt * tile), tile)
    (kv_num, kv_idx), (full_num, full_idx) = ordered_tiles(partial), ordered_tiles(full)
    ref = BlockMask.from_kv_blocks(kv_num[None, None], kv_idx[None, None], full_num[None, None], full_idx[None, None],
                                   BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(qt * tile - 5, kvt * tile))
    for name in ORDERINGS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE and ours.mask_mod is mask_mod
