"""Attention for decoding steps on a static cache: grouped-query attention without copying K/V per query head.

HF's SDPA path (transformers 5.17, the GPU machine's version) expands every cached key/value head to all query heads
(`repeat_kv`) whenever a mask is passed, and the runner always passes one (left padding, cropped caches). For a
decoding step that copy is the step: SmolLM2 has 9 query heads on 3 K/V heads, so a batch of 512 rows attending
over 1,024 slots writes and re-reads ~1.2 GB per layer to attend with 512 x 9 query rows.

Here the query heads that share a K/V head become extra query rows of that head instead: [b, H, q, d] ->
[b, H_kv, (H / H_kv) * q, d], with the mask repeated along the rows. SDPA then reads each cached key and value once.
Row (r, t) of group g is query head g * rep + r at position t, the head that `repeat_kv` pairs with K/V head g, so the
result is the same attention. Forwards with many query rows (prefill, the training target's packed rows) gain
nothing from it and would repeat a large mask: they go to HF's own SDPA function unchanged.

`use_packed_gqa(hf)` registers the function with transformers' AttentionInterface (the documented extension point)
and switches a model that runs "sdpa" to it; masks passed as 4D tensors reach it untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "packed_gqa_sdpa"  # no "flash" in it: transformers treats any such name as a flash-attention kernel
ROW_FLEX_NAME = "row_length_flex"  # the regeneration engine's decode: see "row-length decode" below
SDPA_NAMES = ("sdpa", NAME, ROW_FLEX_NAME)  # the implementations that run SDPA (or can switch between these)
MAX_PACKED_ROWS = 256  # query rows per K/V head up to which packing pays (decode: rep x 1, verification: rep x B)


def packed_gqa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs):
    """HF attention-function signature: query [b, H, q, d], key/value [b, H_kv, L, d], attention_mask [b, 1, q, L]
    (bool or additive) -> (output [b, q, H, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, H, q, d = query.shape
    rep = H // key.shape[1]
    plain = (rep == 1 or attention_mask is None or rep * q > MAX_PACKED_ROWS or dropout > 0
             or attention_mask.shape[1] != 1 or kwargs.get("sliding_window") or kwargs.get("softcap"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    L = attention_mask.shape[-1]
    packed_q = query.reshape(b, H // rep, rep * q, d)                              # rows (r, t) of group g
    mask = attention_mask.expand(b, 1, q, L)[:, :, None].expand(b, 1, rep, q, L).reshape(b, 1, rep * q, L)
    out = F.scaled_dot_product_attention(packed_q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, H, q, d).transpose(1, 2).contiguous(), None


def use_packed_gqa(hf) -> bool:
    """Switch an HF model that runs 'sdpa' to packed_gqa_attention (registered once per process). True if switched
    or already on it; models on another attention implementation (flex, eager) are left as they are."""
    from transformers import AttentionInterface

    impl = getattr(hf.config, "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl not in ("sdpa", ROW_FLEX_NAME):  # the regeneration engine's flex decode runs SDPA for the rest
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_gqa_attention)
    hf.set_attn_implementation(NAME)
    return True


def restore_sdpa(hf) -> None:
    """Undo use_packed_gqa or use_row_length_flex (a model handed back to code that checks for 'sdpa' by name)."""
    if getattr(hf.config, "_attn_implementation", None) in (NAME, ROW_FLEX_NAME):
        hf.set_attn_implementation("sdpa")


# ---------------------------------------------------------------------------------------------- row-length decode
#
# The regeneration engine (generation/engine.py) keeps rows of very different lengths in one static cache. A masked
# SDPA step reads every row's K/V up to the longest row's slot: measured 2.4-2.9x the K/V the rows need on chat-like
# lengths, and a decoding step of a small model is that read. Flex attention with a BlockMask of per-row tile counts
# reads only the 128-slot tiles up to each row's own position (none for a row that has ended); a mask_mod hides the
# slots past it inside its last tile. The BlockMask comes in as the 4D `attention_mask` (transformers passes 4D
# masks through untouched); any other call (the prefill) goes to packed_gqa_attention.
#
# The query heads that share a K/V head become rows of that head here too (built with q_rows = H / H_kv, the mask
# has that many query rows): flex attention's decoding kernel (split along the K/V slots, the one made for a query
# of a few rows) takes grouped heads only when H / H_kv is a power of two, and SmolLM2 has 9 on 3. Otherwise inductor
# falls back to its main kernel, one 64-row query tile per head for a single query row; on an H200 that step read
# the cache at 0.4-0.7 TB/s of the 4.2 the device copies at (the engine's autotune lines in the GPU demo's log).

_compiled_flex = None


def _flex_kernel(device: torch.device):
    """flex_attention, compiled on CUDA (the fused kernels; eager flex materialises the scores), eager elsewhere.
    Its kernel configs autotuned once per shape (a few seconds): measured 1.4-1.8x faster than the default config
    for the engine's decode step on an H200 (docs/BENCHMARKS.md, "Regeneration engine")."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    return _compiled_flex


def row_length_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                         dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                         **kwargs):
    """HF attention-function signature. With a flex BlockMask as attention_mask: query [b, H, q, d] over key/value
    [b, H_kv, L, d] -> (output [b, q, H, d], None); with anything else: packed_gqa_attention."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        return packed_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=is_causal, **kwargs)
    b, H, q, d = query.shape
    rep = H // key.shape[1]
    flex = _flex_kernel(query.device)
    if rep > 1 and attention_mask.seq_lengths[0] == rep * q:  # a mask over the grouped heads as rows (above)
        out = flex(query.reshape(b, H // rep, rep * q, d), key, value, block_mask=attention_mask, scale=scaling)
        return out.reshape(b, H, q, d).transpose(1, 2).contiguous(), None
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=rep > 1)
    return out.transpose(1, 2).contiguous(), None


def use_row_length_flex(hf) -> bool:
    """Switch an HF model that runs 'sdpa' (or packed GQA) to row_length_attention. True if switched or already on
    it; models on another attention implementation are left as they are."""
    from transformers import AttentionInterface

    impl = getattr(hf.config, "_attn_implementation", None)
    if impl == ROW_FLEX_NAME:
        return True
    if impl not in SDPA_NAMES:
        return False
    if ROW_FLEX_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ROW_FLEX_NAME, row_length_attention)
    hf.set_attn_implementation(ROW_FLEX_NAME)
    return True


class RowLengthMask:
    """Builds the decode step's BlockMask from per-row state, with device ops only (a CUDA graph holds it).

    ends [rows] long and done [rows] bool are buffers whose contents change between steps (not their addresses):
    row r sees slots 0..ends[r], or none when done[r]. One mask_mod for the object's life, so a compiled
    flex_attention sees the same closure at every call. q_rows: the mask's query rows, every one seeing the same
    slots: the query heads that share a K/V head (row_length_attention folds them into rows)."""

    def __init__(self, ends: torch.Tensor, done: torch.Tensor, slots: int, tile: int = 128, q_rows: int = 1):
        self.ends, self.done, self.slots, self.tile, self.q_rows = ends, done, slots, tile, q_rows
        self.n_tiles = -(-slots // tile)
        self._tile_idx = torch.arange(self.n_tiles, dtype=torch.int32, device=ends.device).repeat(ends.shape[0], 1)
        ends_, done_ = ends, done

        def upto_end(b, h, q_idx, kv_idx):  # what the tile counts say, per slot (eager flex reads only this)
            return (kv_idx <= ends_[b]) & ~done_[b]

        self.mask_mod = upto_end

    def block_mask(self, rows: int):
        """-> BlockMask [rows, 1, q_rows, slots] over the first `rows` rows."""
        from torch.nn.attention.flex_attention import BlockMask

        ends, done = self.ends[:rows], self.done[:rows]
        kv_num = torch.where(done, 0, torch.div(ends, self.tile, rounding_mode="floor") + 1).to(torch.int32)
        return BlockMask.from_kv_blocks(kv_num[:, None, None], self._tile_idx[:rows, None, None], BLOCK_SIZE=self.tile,
                                        mask_mod=self.mask_mod, seq_lengths=(self.q_rows, self.slots))

    def slots_read(self, ends: list[int]) -> int:
        """The K/V slots one step reads for rows ending at these slots (whole tiles): the engine's statistics."""
        return sum(min((e // self.tile + 1) * self.tile, self.slots) for e in ends)
