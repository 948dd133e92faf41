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
    if impl != "sdpa":
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_gqa_attention)
    hf.set_attn_implementation(NAME)
    return True


def restore_sdpa(hf) -> None:
    """Undo use_packed_gqa (a model handed back to code that checks for 'sdpa' by name)."""
    if getattr(hf.config, "_attn_implementation", None) == NAME:
        hf.set_attn_implementation("sdpa")
