"""Model FLOPs of the two stages, for MFU: useful arithmetic only (matmuls, attention over visible keys, and
DFlash 2's convolutions and selector scores).

Drafter training step, one packed row: T context tokens, A anchors x B block tokens (N = A*B), L layers of width H,
h query / hk key-value heads of size d, MLP width I, k tapped target layers, vocabulary V. Forward:
  fc           2 * T * (k*H) * H                                   target features -> context states
  context K/V  L * 2 * T * H * (2*hk*d)                            each layer projects the shared context
  layers       L * 2 * N * (H*h*d + 2*H*hk*d + h*d*H + 3*H*I)      q, k, v, o, gate, up, down over block tokens
  attention    L * 4 * h*d * P                                     QK^T and PV over the P visible (query, key) pairs
  LM head      2 * A*(B-1) * H * V                                 logits of block positions 1..B-1
A training step counts 3x forward (forward, input gradient, weight gradient) for context K/V, layers and attention;
2x for fc (its input, the frozen target features, needs no gradient) and 2x for the frozen LM head (forward and
input gradient, no weight gradient). Norms, RoPE, softmax and the optimizer are not counted.

DFlash 2 (models/drafter2.py) adds, with K = conv_kernel_size taps, G = H / conv_group_size kernel groups, r =
selector_rank, c = selector_top_k candidates and n = A*(B-1) drafted positions:
  conv kernels L * 2 * 2 * N * H * (2*K*G)                         kernel_projection of attention_conv and mlp_conv
  conv taps    L * 2 * 2 * 2 * N * K * H                           both convs, each applied to its sublayer's input
                                                                   and output: K multiply-adds per channel
  selector     2 * n * H * r  (projection)  +  2 * n * c * r  (scores)   W h, then <P[prev] * W h, S[candidate]>
each 3x in a training step. The conv taps and the selector scores are elementwise multiply-adds doing a matmul's
job (a matmul FLOP counter does not see them). The selector's candidates are the top c of the LM head's logits,
taken from the chunks of logits the cross-entropy forms anyway (training/objective.py): no LM-head work of their
own, so nothing to add. The add of the base kernel to the dynamic one is left out.

Target feature forward over T tokens through the layers that run (the deepest tap and below):
  layers_run * (2 * T * (H*h*d + 2*H*hk*d + h*d*H + 3*H*I) + 4 * h*d * P),  P = T^2 / 2 for one causal document.
"""

from __future__ import annotations

import torch

from ..models.drafter2 import Drafter2Config


def visible_pairs(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> int:
    """(query, key) pairs the DFlash mask lets attend: each of a block's B queries sees the context of its document
    strictly before the anchor, and the block's B keys (= dense_block_mask(...).sum(), without building it)."""
    pos = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    same_doc = doc_ids[None, :] == doc_ids[anchors][:, None]                 # [A, T]
    ctx = (same_doc & (pos[None, :] < anchors[:, None])).sum()
    return int(block_size * (ctx + anchors.shape[0] * block_size))


def _layer_matmul_params(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate


# A training step's FLOPs per forward FLOP of each component (module docstring).
TRAIN_FACTOR = {"fc": 2, "context_kv": 3, "layers": 3, "attention": 3, "lm_head": 2,
                "conv_kernels": 3, "conv_taps": 3, "selector_projection": 3, "selector_scores": 3}


def drafter_step_flops(cfg, context_len: int, num_anchors: int, pairs: int) -> dict[str, float]:
    """cfg: DrafterConfig, or Drafter2Config (DFlash 2's terms too). -> forward FLOPs per component, plus
    'forward' and 'train' (the step's total)."""
    H, L, V, B = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.block_size
    h, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T, N = context_len, num_anchors * B
    fwd = {
        "fc": 2.0 * T * cfg.num_feature_layers * H * H,
        "context_kv": L * 2.0 * T * H * 2 * hk * d,
        "layers": L * 2.0 * N * _layer_matmul_params(H, cfg.intermediate_size, h, hk, d),
        "attention": L * 4.0 * h * d * pairs,
        "lm_head": 2.0 * num_anchors * (B - 1) * H * V,
    }
    if isinstance(cfg, Drafter2Config):  # DFlash 2's additions
        K, G, r = cfg.conv_kernel_size, H // cfg.conv_group_size, cfg.selector_rank
        n = num_anchors * (B - 1)
        fwd["conv_kernels"] = L * 2 * 2.0 * N * H * 2 * K * G
        fwd["conv_taps"] = L * 2 * 2 * 2.0 * N * K * H
        fwd["selector_projection"] = 2.0 * n * H * r
        fwd["selector_scores"] = 2.0 * n * cfg.selector_top_k * r
    out = dict(fwd)
    out["forward"] = sum(fwd.values())
    out["train"] = sum(TRAIN_FACTOR[k] * v for k, v in fwd.items())
    return out


def target_forward_flops(info, layers_run: int, seq_len: int, pairs: float | None = None) -> float:
    """info: TargetInfo. pairs: attended (query, key) pairs per layer; default one causal document, T^2 / 2."""
    h, d = info.num_attention_heads, info.head_dim
    p = seq_len * seq_len / 2 if pairs is None else pairs
    per_layer = _layer_matmul_params(info.hidden_size, info.intermediate_size, h, info.num_key_value_heads, d)
    return layers_run * (2.0 * seq_len * per_layer + 4.0 * h * d * p)
