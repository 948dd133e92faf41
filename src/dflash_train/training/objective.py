"""The DFlash training objective on one packed row.

For anchor a (a position where tokens a and a+1 are both supervised) the block is [token a, MASK x (B-1)] at
positions pos(a)..pos(a)+B-1; block position k (1..B-1) predicts token a+k. A block's queries see the context
features strictly before a within a's document, and the B tokens of their own block (bidirectional); never another
block, never another document. Cross-entropy at position k weighs exp(-(k-1)/gamma), normalised by the weight sum.

Everything here has fixed shapes given (T = token_budget, A = num_anchors, B = block_size), so a compiled step
never recompiles, and nothing calls .item(): metrics stay on the device until the log step reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..models.drafter import AttendFn, DFlashDrafter


def default_gamma(block_size: int) -> float:
    """gamma = 7 for B=16, 5 for B=10, 4 for B=8 (the public recipes); B/2.3 elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.3)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B-1] weights exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def valid_anchor_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] bool: a is a valid anchor iff tokens a and a+1 are supervised and in the same document."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:-1] = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:])
    return ok


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct valid anchors (CPU, seeded) -> anchors [A] (sorted), valid [A].

    Rows with fewer valid positions are padded with anchor 0 marked invalid, so A is always the same."""
    candidates = valid_anchor_positions(loss_mask, doc_ids).nonzero().flatten()
    n = min(num_anchors, candidates.numel())
    pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:n]].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:n], valid[:n] = pick, True
    return anchors, valid


@dataclass
class BlockLayout:
    """Per-block tensors derived from one row and its anchors (all on the compute device)."""
    block_ids: torch.Tensor   # [A, B] input ids: anchor token then MASK
    block_pos: torch.Tensor   # [A*B] RoPE positions pos(a) + k
    labels: torch.Tensor      # [A, B-1] target token a+k (clamped index; see valid)
    valid: torch.Tensor       # [A, B-1] bool: label exists, same document, supervised, anchor valid


def block_layout(input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid, block_size: int,
                 mask_token_id: int) -> BlockLayout:
    T, B = input_ids.shape[0], block_size
    k = torch.arange(1, B, device=input_ids.device)
    idx = anchors[:, None] + k[None, :]                          # [A, B-1]
    idx_c = idx.clamp(max=T - 1)
    valid = ((idx < T) & anchor_valid[:, None] & (doc_ids[idx_c] == doc_ids[anchors][:, None]) & loss_mask[idx_c])
    block_ids = torch.cat([input_ids[anchors][:, None],
                           torch.full_like(idx, mask_token_id)], dim=1)   # [A, B]
    block_pos = (position_ids[anchors][:, None] + torch.arange(B, device=input_ids.device)[None, :]).flatten()
    return BlockLayout(block_ids=block_ids, block_pos=block_pos, labels=input_ids[idx_c], valid=valid)


# ------------------------------------------------------------------------------------------ attention masks

def dense_block_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool [A*B, T + A*B]: True where a block query may attend (context strictly before its anchor in the same
    document, or its own block)."""
    A, T, B = anchors.shape[0], doc_ids.shape[0], block_size
    q_blk = torch.arange(A * B, device=anchors.device) // B                 # [N]
    q_anchor = anchors[q_blk]                                               # [N]
    t = torch.arange(T, device=anchors.device)
    ctx = (t[None, :] < q_anchor[:, None]) & (doc_ids[None, :] == doc_ids[q_anchor][:, None])
    own = q_blk[:, None] == q_blk[None, :]
    return torch.cat([ctx, own], dim=1)


def sdpa_attend(mask: torch.Tensor) -> AttendFn:
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    return attend


def flex_block_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int):
    """The same mask as `dense_block_mask`, as a flex-attention BlockMask (sparse: skips invisible tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    A, T, B = anchors.shape[0], doc_ids.shape[0], block_size
    # Block keys get document id -2 so the context test is false for them without an index past T.
    kv_doc = torch.cat([doc_ids, torch.full((A * B,), -2, dtype=doc_ids.dtype, device=doc_ids.device)])
    q_anchor = anchors.repeat_interleave(B)   # [N]
    q_doc = doc_ids[anchors].repeat_interleave(B)

    def mask_mod(b, h, q_idx, kv_idx):
        ctx = (kv_idx < q_anchor[q_idx]) & (kv_doc[kv_idx] == q_doc[q_idx])
        own = (kv_idx >= T) & ((kv_idx - T) // B == q_idx // B)
        return ctx | own

    return create_block_mask(mask_mod, None, None, A * B, T + A * B, device=anchors.device)


def flex_attend(block_mask) -> AttendFn:
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    return attend


# ------------------------------------------------------------------------------------------------ loss

def _chunk_logits_ce(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor):
    """h [n, H], head_w [V, H], labels [n] -> ce [n] fp32, argmax [n]."""
    logits = (h @ head_w.t()).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def blockwise_ce(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, chunk: int):
    """CE and greedy predictions over rows of h in chunks; each chunk's logits are recomputed in backward
    (activation checkpointing), so at most `chunk` x V logits are alive at once."""
    n = h.shape[0]
    if chunk <= 0 or n <= chunk:
        return _chunk_logits_ce(h, head_w, labels)
    ces, preds = [], []
    for s in range(0, n, chunk):
        ce, pred = checkpoint(_chunk_logits_ce, h[s:s + chunk], head_w, labels[s:s + chunk], use_reentrant=False)
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


def acceptance_metrics(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """correct, valid [A, B-1] -> acc [B-1] (plain per-position accuracy), cond_acc [B-1] (accuracy at k given all
    earlier positions right), tau_est (1 + sum_k prod_{j<=k} cond_acc_j: the expected acceptance length)."""
    validf = valid.float()
    acc = (correct & valid).float().sum(0) / validf.sum(0).clamp_min(1.0)
    run = torch.cumprod((correct & valid).float(), dim=1)                   # all right up to k
    prev = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=1)     # all right before k
    cond = run.sum(0) / (prev * validf).sum(0).clamp_min(1.0)
    tau = 1.0 + torch.cumprod(cond, dim=0).sum()
    return {"acc": acc, "cond_acc": cond, "tau_est": tau}


def dflash_loss(drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, feats: torch.Tensor,
                input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid, *, block_size: int,
                gamma: float, attention: str = "sdpa", loss_chunk: int = 0) -> dict[str, torch.Tensor]:
    """One row -> {'loss', 'acc', 'cond_acc', 'tau_est', 'num_labels'} (tensors on the device, no host sync).

    feats [T, k*H]; input_ids/position_ids/doc_ids/loss_mask [T]; anchors/anchor_valid [A]."""
    cfg = drafter.config
    lay = block_layout(input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid, block_size,
                       cfg.mask_token_id)
    if attention == "flex":
        attend = flex_attend(flex_block_mask(anchors, doc_ids, block_size))
    else:
        attend = sdpa_attend(dense_block_mask(anchors, doc_ids, block_size))
    x = F.embedding(lay.block_ids.flatten(), embed_w)                       # [A*B, H]
    h = drafter(x, lay.block_pos, feats, position_ids, attend)              # [A*B, H]
    A = anchors.shape[0]
    h = h.view(A, block_size, -1)[:, 1:].reshape(A * (block_size - 1), -1)  # positions 1..B-1
    ce, pred = blockwise_ce(h, head_w, lay.labels.flatten(), loss_chunk)
    ce, pred = ce.view(A, block_size - 1), pred.view(A, block_size - 1)
    w = position_weights(block_size, gamma, device=ce.device)[None, :] * lay.valid.float()
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    out = acceptance_metrics(pred == lay.labels, lay.valid)
    out["loss"] = loss
    out["num_labels"] = lay.valid.sum()
    return out


def expected_acceptance(cond_acc) -> float:
    """Host-side helper: 1 + sum_k prod_{j<=k} cond_acc_j."""
    total, run = 1.0, 1.0
    for a in cond_acc:
        run *= float(a)
        total += run
    return total

