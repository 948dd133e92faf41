"""The DFlash training objective on one packed row.

For anchor a (a position where tokens a and a+1 are both supervised) the block is [token a, MASK x (B-1)] at
positions pos(a)..pos(a)+B-1; block position k (1..B-1) predicts token a+k. A block's queries see the context
features strictly before a within a's document, and the B tokens of their own block (bidirectional); never another
block, never another document. Cross-entropy at position k weighs by acceptance-aware weights computed from the
step's own cross-entropy (train.position_weights=dynamic, the default: `dynamic_position_weights`), or by
exp(-(k-1)/gamma), normalised by the weight sum (=decay, the DFlash paper's; `dflash_loss`'s own default).
With distillation (train.kd_weight = w > 0) the loss at a label position p is (1 - w) * CE(token p) + w * the
cross-entropy against the target's own distribution for p, softmax(lm_head(target's final hidden state at p - 1)).

Everything here has fixed shapes given (T = token_budget, A = num_anchors, B = block_size), so a compiled step
never recompiles, and nothing calls .item(): metrics stay on the device until the log step reads them.

Fast paths (each pinned by a simple reference in tests/test_objective_fast.py): the flex BlockMask is built at tile
granularity from per-tile bounds (never the [A*B, T+A*B] element mask), once a step and with no sort, and the frozen
LM head's cross-entropy is fused and chunked (`_FusedLinearCE`: the gradient w.r.t. the hidden states is formed while
each chunk's logits exist; the target's logits for distillation are formed there too, chunk by chunk, so no [n, V]
tensor ever exists; DFlash 2's top-K selector candidates are taken from the same chunks, so they cost no LM-head pass
of their own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..models.drafter import AttendFn, DFlashDrafter
from ..models.flex import FLEX_TILE, tile_block_mask
from .cudagraphs import configure_cudagraphs
from .selector import selector_objective


def default_gamma(block_size: int) -> float:
    """gamma = 7 for B=16, 5 for B=10, 4 for B=8 (the public recipes); B/2.3 elsewhere."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.3)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B-1] weights exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


POSITION_WEIGHTS = ("decay", "dynamic")   # train.position_weights
DEFAULT_DYNAMIC_ALPHA = 0.5               # train.dynamic_alpha: D-PACE's smoothing (its released default)


def dynamic_position_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = DEFAULT_DYNAMIC_ALPHA
                             ) -> torch.Tensor:
    """ce, valid [A, B-1] (the step's per-position loss and its labels) -> [B-1] position weights, w_1 = 1, detached.

    Derivation. A block's expected accepted draft length is E[L] = sum_{m=1}^{B-1} prod_{j<=m} p_j, p_j the chance
    the draft at j is the label. Its gradient w.r.t. log p_k is S_k = sum_{m>=k} prod_{j<=m} p_j, so the loss
    sum_k S_k * CE_k with S held constant follows the gradient of expected acceptance (D-PACE, arXiv 2605.18810).
    Here, per block b and position k:
      s_bk = (1 - alpha) * exp(-ce_bk) + alpha   at labelled positions, 0 at unlabelled ones,
      P_bk = prod_{j<=k} s_bj,   S_bk = sum_{m>=k} P_bm,
      Sbar_k = mean of S_bk over the blocks labelled at k,   w_k = Sbar_k / Sbar_1 (w_1 = 1 exactly),
    all on `ce.detach()`, in fixed-shape tensor ops (no host sync, no new shapes: it runs inside the compiled step).
    The loss stays sum(ce * w * valid) / sum(w * valid), a weighted mean of the CE like the decay weights.

    Choices, against the paper and its released code (github.com/Lucas-TY/D-PACE, `_dpace_weight`):
    - p = exp(-loss): the label's probability. With distillation (kd_weight = w) the loss is the mix, so p is
      p_label^(1-w) * exp(-CE against the target)^w, the latter a lower bound on the chance that a sampled draft
      matches the target's sample: the same quantity the step trains.
    - alpha (train.dynamic_alpha): the paper smooths p to (1 - alpha) p + alpha (0.5 in its release), followed
      here. Without it S is a product chain of p's: early in training (p ~ 1/V) w_2 / w_1 ~ p_2 and positions past
      the first would get next to no training; with it, even a drafter that gets nothing right gives
      w_k >= (1 - alpha) alpha^(k-1). alpha = 0 is the plain derivation; alpha = 1 gives the fixed profile
      (B-k) / (B-1).
    - Position-level, not per block: the paper weighs each block's CE_bk by its own S_bk. S_bk carries the factor
      p_b1 (every term of E[L] does), so per-block weights shrink exactly on the blocks the drafter gets wrong
      (the floor alpha only bounds that to ~alpha : B-1). Averaging S over the blocks keeps the per-example
      weighting of maximum likelihood (every labelled block counts alike at a position) and takes only the
      position profile from E[L]. The mean at k is over the blocks labelled at k (the least-squares fit of one
      weight per position to S_bk over the labelled (b, k)): a block whose labels stop early contributes no CE
      beyond them, so counting it as 0 there would discount those positions twice.
    - Unlabelled positions: acceptance stops there (s = 0), so labelled positions after a gap in the loss mask
      (past the end of the reply, which decoding never drafts across) get S = 0 in that block. The paper treats
      them as transparent (factor 1); the two agree whenever a block's labels are contiguous from position 1, as
      they almost always are (labels end at the end of a document, of the row or of the assistant's turn).
    - Normalisation: the paper divides sum(S * CE) by the batch size, so the loss and the gradient grow with the
      drafter's acceptance and with the number of anchors; here the weights are a profile with w_1 = 1, as decay's,
      inside the same weighted mean, so the loss, lr and train.grad_clip keep their scale.
    - No smoothing over steps (neither has the paper): the step's own A blocks give the profile, so the step stays
      a pure function of its inputs. If no block is labelled, or every S is 0 (alpha = 0 and p_1 underflowing
      everywhere), all weight goes to position 1.
    """
    valid_f = valid.to(torch.float32)
    p = torch.exp(-ce.detach().to(torch.float32))
    s = ((1.0 - alpha) * p + alpha) * valid_f
    prefix = torch.cumprod(s, dim=1)                                            # P_bk
    suffix = prefix.flip(1).cumsum(1).flip(1)                                   # S_bk
    mean = (suffix * valid_f).sum(0) / valid_f.sum(0).clamp_min(1.0)            # Sbar_k
    rel = mean[1:] / mean[:1].clamp_min(torch.finfo(torch.float32).tiny)
    return torch.cat([torch.ones_like(mean[:1]), rel])


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




@dataclass
class FlexMask:
    """The DFlash mask of one row for flex attention, as plain tensors.

    A BlockMask carries a Python `mask_mod` closure; a compiled function taking one as input would guard on (and
    recompile for) every new closure. Taking these tensors instead, the compiled attention builds its BlockMask
    inside the graph, and the step has no host syncs and fixed shapes (Qt = ceil(A*B/tile), KVt = ceil((T+A*B)/tile)).
    mask_mod compares each key with its query's bounds, two per block (first context key, anchor) and the block's
    own keys, and reads nothing per key: with short documents most tiles are partial (443 of 507 visited tiles on a
    row packed like the GPU demo's, benchmarks/gpu_flex_demo_attention.py), so it runs for most query-key pairs.
    """
    anchors: torch.Tensor      # [A] anchor position of each block: its context keys end before it
    first: torch.Tensor        # [A] first key of the anchor's document: its context keys start there
    partial: torch.Tensor      # bool [Qt, KVt]: key tiles that mask_mod decides per element
    full: torch.Tensor         # bool [Qt, KVt]: key tiles every query of the query tile sees whole
    context: int               # T: keys [0, T) are context, [T, T + A*B) block tokens
    block_size: int
    tile: int = FLEX_TILE

    def block_mask(self):
        """-> torch BlockMask (traceable: built inside the compiled region from the tensors above, with no sort)."""
        anchors, first, T, B = self.anchors, self.first, self.context, self.block_size
        A = anchors.shape[0]

        def mask_mod(b, h, q_idx, kv_idx):
            block = (q_idx // B).clamp(max=A - 1)   # the last query tile's padding reads the last block's bounds
            ctx = (kv_idx >= first[block]) & (kv_idx < anchors[block])
            own = (kv_idx >= T + block * B) & (kv_idx < T + (block + 1) * B)
            return ctx | own

        return tile_block_mask(self.partial, self.full, mask_mod, (A * B, T + A * B), self.tile)


def flex_block_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, tile: int = FLEX_TILE) -> FlexMask:
    """The same mask as `dense_block_mask`, at tile granularity for flex attention (invisible tiles are skipped).

    Built from per-tile bounds, never from the [A*B, T+A*B] element mask: O(A*T + tiles^2) work in ~20 small kernels
    with static shapes. Query q (block q // B, anchor a) sees keys [first(doc a), a) of its document and its own B
    block keys. A key tile is
      full     when every query of the query tile shares one document, the whole key tile lies in it and ends at
               or before the tile's smallest anchor;
      partial  (mask_mod applied per element) when it overlaps [min first(doc), max anchor) or the tile's block keys.
    """
    A, T, B = anchors.shape[0], doc_ids.shape[0], block_size
    N, dev = A * B, anchors.device
    q_tiles, kv_tiles = -(-N // tile), -(-(T + N) // tile)
    pos = torch.arange(T, device=dev)
    anchor_doc = doc_ids[anchors]                                                      # [A]
    doc_first = torch.where(doc_ids[None, :] == anchor_doc[:, None], pos[None, :], T).amin(1)   # [A]

    # Per query, padded to whole tiles by repeating the last query (min / max over a tile unchanged).
    q_blk = (torch.arange(q_tiles * tile, device=dev).clamp(max=N - 1) // B).view(q_tiles, tile)  # [Qt, tile]
    q_anchor, q_doc = anchors[q_blk], anchor_doc[q_blk]
    ctx_lo, ctx_hi = doc_first[q_blk].amin(1), q_anchor.amax(1)                      # [Qt]: context keys [lo, hi)
    anchor_min = q_anchor.amin(1)
    q_doc_min, q_one_doc = q_doc.amin(1), q_doc.amin(1) == q_doc.amax(1)
    own_lo, own_hi = T + q_blk[:, 0] * B, T + (q_blk[:, -1] + 1) * B                 # [Qt]: block keys [lo, hi)

    kv_doc = torch.cat([doc_ids, doc_ids.new_full((kv_tiles * tile - T,), -2)])       # [KVt*tile]
    k_doc = kv_doc.view(kv_tiles, tile)
    k0 = torch.arange(kv_tiles, device=dev) * tile                                    # [KVt] first key of a tile
    k1 = (k0 + tile).clamp(max=T + N)                                                 # one past its last key
    k_one_doc = k_doc.amin(1) == k_doc.amax(1)

    full = (q_one_doc[:, None] & k_one_doc[None, :] & (k_doc[:, 0][None, :] == q_doc_min[:, None])
            & (k1[None, :] <= anchor_min[:, None]))                                   # [Qt, KVt]
    ctx = (k0[None, :] < ctx_hi[:, None]) & (k1[None, :] > ctx_lo[:, None])
    own = (k0[None, :] < own_hi[:, None]) & (k1[None, :] > own_lo[:, None])
    return FlexMask(anchors, doc_first, (ctx | own) & ~full, full, T, B, tile)


# Triton tile sizes of the drafter's flex kernels (forward BLOCK_M x BLOCK_N; backward M1/N1, M2/N2) for heads of
# at most SMALL_HEAD_DIM, within the mask's 128-wide tiles. One layer's fwd + bwd at the GPU demo's shape (SmolLM2,
# head 64, ~276-token documents; H100, 2026-12-06, benchmarks/gpu_flex_demo_attention.py): 0.906 ms with these
# against 1.252 ms with the defaults (1.38x), the same outputs and gradients within bf16; the whole compiled demo step
# gains less: 23.17 ms against 23.52 (1.016x; H100, 2026-12-07, gpu_profile.py drafter with PROFILE_TILES). At head
# 128 (Qwen3-8B, benchmarks/gpu_flex_compile.py) the defaults are faster (4.86 ms against 8.05), so larger heads keep
# them. The backward runs 4 warps, not the 8 inductor picks for heads of 64 (sized for its 64 x 128 tiles, not these
# 32-row ones): its kernel 0.424 ms a layer against 0.761, the gradients bit-identical (H100, 2026-12-07, the probe's
# `bwd_w4` against `tiles64`, kernel times from the profiler; 2 warps: 0.880).
SMALL_HEAD_DIM = 64
SMALL_HEAD_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
SMALL_HEAD_KERNEL_OPTIONS = {**SMALL_HEAD_TILES, "bwd_num_warps": 4}

# The drafter mask's sparse tile (queries x keys; every kernel tile above divides it). At 64 instead of 128 a row
# packed like the demo's visits 5.7 M query-key pairs instead of 8.3 M (3.5 M visible), 479 of its 1,380 visited
# tiles full instead of 64 of 507 (`PROBE_MASK_ONLY=1 PYTHONPATH=src python3 benchmarks/gpu_flex_demo_attention.py`).
# On a GPU it does not compile (torch 2.11, H200, 2026-12-07: inductor fails on the 64-wide mask's construction, "list
# indices must be integers or slices, not NoneType", in the probe and in the whole step alike), so it stays 128.
DRAFTER_MASK_TILE = FLEX_TILE


def flex_kernel_options(q: torch.Tensor) -> dict | None:
    """The Triton kernel options for the drafter's flex attention on q [1, heads, L, d]; None: flex's defaults."""
    return SMALL_HEAD_KERNEL_OPTIONS if q.device.type == "cuda" and q.shape[-1] <= SMALL_HEAD_DIM else None


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    # q/k/v arrive as [1, heads, L, d] views of [L, heads, d]; dense [1, heads, L, d] is the kernels' native layout
    # (inductor's CPU template rejects the views; compiled, the copy fuses into the RoPE kernel that writes them).
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=flex_kernel_options(q))


def _flex_block_attention(q, k, v, anchors, first, partial, full, context: int, block_size: int, tile: int):
    return _flex(q, k, v, FlexMask(anchors, first, partial, full, context, block_size, tile).block_mask())


_compiled_flex = None
_compiled_flex_lock = threading.Lock()


def _flex_impl(device: torch.device):
    """Un-compiled flex attention is a slow dense reference: outside a compiled step, CUDA calls go through
    a compiled copy (one per process; recompiles only for new shapes)."""
    global _compiled_flex
    if device.type != "cuda":
        return _flex_block_attention
    with _compiled_flex_lock:
        if _compiled_flex is None:
            configure_cudagraphs()  # the process's compile policy, before its first compile (training/cudagraphs.py)
            _compiled_flex = torch.compile(_flex_block_attention, dynamic=False, fullgraph=True)
    return _compiled_flex


def flex_attend(mask: FlexMask) -> AttendFn:
    """Each layer's attention under `mask`. Inside a compiled step the BlockMask is built once, here, and shared by
    every layer (one mask build in the graph, not one a layer); outside, each call takes the mask's tensors."""
    if torch.compiler.is_compiling():
        block_mask = mask.block_mask()
        return lambda q, k, v: _flex(q, k, v, block_mask)

    def attend(q, k, v):
        return _flex_impl(q.device)(q, k, v, mask.anchors, mask.first, mask.partial, mask.full, mask.context,
                                    mask.block_size, mask.tile)
    return attend


# ------------------------------------------------------------------------------------------------ loss

def _even_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most `chunk` rows, as equal as possible (one kernel shape when compiled)."""
    if chunk <= 0 or n <= chunk:
        return [(0, n)]
    size = -(-n // -(-n // chunk))
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 -> fp32 for the softmax; fp32 and fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _top_logits(logits: torch.Tensor, k: int):
    """logits [c, V] -> (the k largest [c, k], their ids [c, k]) as constants, or None at k = 0: DFlash 2's selector
    candidates, taken while the loss's chunk of logits exists, so finding them costs no LM-head pass of its own."""
    if k == 0:
        return None
    values, ids = logits.detach().topk(k, dim=-1)
    return values, ids


def _cat_tops(tops: list):
    """Per-chunk `_top_logits` results -> (values [n, k], ids [n, k]), or None at k = 0."""
    if tops[0] is None:
        return None
    return torch.cat([t[0] for t in tops]), torch.cat([t[1] for t in tops])


def _ce_chunk(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, with_grad: bool, top_k: int):
    """h [c, H] (head_w's dtype), head_w [V, H], labels [c] -> ce [c] (>= fp32), argmax [c], the top_k logits and
    ids (`_top_logits`), and when `with_grad` d ce / d h = (softmax - onehot) @ head_w [c, H], computed while the
    logits exist (they are never recomputed)."""
    logits = _upcast(h @ head_w.t())                                        # [c, V]: the chunk's only big tensor
    top = _top_logits(logits, top_k)                                        # before the in-place softmax below
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, labels[:, None])[:, 0]
    pred = logits.argmax(-1)
    if not with_grad:
        return ce, pred, top, None
    if torch.compiler.is_compiling():
        # Pure pointwise: inductor fuses upcast, softmax, - onehot and the cast into one pass over the logits.
        cols = torch.arange(logits.shape[1], device=logits.device)
        p = torch.exp(logits - lse[:, None]) - (cols[None, :] == labels[:, None]).to(logits.dtype)
    else:
        # Eager: in place, so no second [c, V] fp32 buffer.
        p = logits.sub_(lse[:, None]).exp_()
        p.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -1.0))
    return ce, pred, top, p.to(head_w.dtype) @ head_w                       # d ce / d h: [c, H]


def _kd_chunk(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, target_h: torch.Tensor, kd_weight: float,
              with_grad: bool, top_k: int):
    """Like `_ce_chunk`, against the mixed target q = (1 - w) * onehot(labels) + w * softmax(target_h @ head_w^T):
    h, target_h [c, H] (head_w's dtype) -> loss [c] = lse(z) - q.z (z = h @ head_w^T; (1 - w) * CE + w * the
    cross-entropy against the target's distribution, i.e. its KL plus the target's entropy), argmax [c], the top_k
    of z, and when `with_grad` d loss / d h = (softmax(z) - q) @ head_w [c, H]."""
    w = kd_weight
    logits = _upcast(h @ head_w.t())                                        # [c, V]
    top = _top_logits(logits, top_k)                                        # before the in-place softmax below
    lse = torch.logsumexp(logits, dim=-1)
    t_logits = _upcast(target_h @ head_w.t())                               # [c, V]: the target's, the other big one
    if torch.compiler.is_compiling():
        p_t = torch.softmax(t_logits, dim=-1)
        soft = lse - (p_t * logits).sum(-1)
    else:
        p_t = t_logits.sub_(torch.logsumexp(t_logits, dim=-1)[:, None]).exp_()   # in place: softmax
        soft = lse - (p_t[:, None, :] @ logits[:, :, None]).view(-1)             # row dot products, no [c, V] temp
    loss = (1.0 - w) * (lse - logits.gather(1, labels[:, None])[:, 0]) + w * soft
    pred = logits.argmax(-1)
    if not with_grad:
        return loss, pred, top, None
    if torch.compiler.is_compiling():
        cols = torch.arange(logits.shape[1], device=logits.device)
        onehot = (cols[None, :] == labels[:, None]).to(logits.dtype)
        p = torch.exp(logits - lse[:, None]) - w * p_t - (1.0 - w) * onehot
    else:
        p = logits.sub_(lse[:, None]).exp_().sub_(p_t.mul_(w))
        p.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], w - 1.0))
    return loss, pred, top, p.to(head_w.dtype) @ head_w                     # d loss / d h: [c, H]


def _loss_chunk(h, head_w, labels, target_h, kd_weight: float, with_grad: bool, top_k: int):
    """Hard-label CE (`target_h` None: exactly today's computation) or the distillation mix on one chunk."""
    if target_h is None:
        return _ce_chunk(h, head_w, labels, with_grad, top_k)
    return _kd_chunk(h, head_w, labels, target_h, kd_weight, with_grad, top_k)


class _FusedLinearCE(torch.autograd.Function):
    """Per-row CE of h @ head_w^T for a frozen head_w, chunked over rows (with `target_h`: the distillation mix of
    `_kd_chunk`, the target's logits formed from target_h [n, H] chunk by chunk as well).

    The gradient w.r.t. h is linear in the upstream gradient of each row's CE, so the forward pass stores
    G = dce/dh [n, H] (small) and backward returns grad_ce[:, None] * G: the LM head costs one matmul forward and
    one backward, where checkpointed chunks cost two forward (recompute) and one backward, and never more than
    one chunk of logits ([chunk, V]; two with target_h) is alive. The argmax and the top_k logits and ids
    (None at top_k = 0) are constants."""

    @staticmethod
    def forward(ctx, h, head_w, labels, chunk, target_h, kd_weight, top_k):
        hc = h.to(head_w.dtype)
        tc = None if target_h is None else target_h.to(head_w.dtype)
        ces, preds, tops, grads = [], [], [], []
        for s, e in _even_chunks(h.shape[0], chunk):
            ce, pred, top, g = _loss_chunk(hc[s:e], head_w, labels[s:e], None if tc is None else tc[s:e], kd_weight,
                                           with_grad=True, top_k=top_k)
            ces.append(ce)
            preds.append(pred)
            tops.append(top)
            grads.append(g)
        ctx.save_for_backward(torch.cat(grads))
        ctx.h_dtype = h.dtype
        pred = torch.cat(preds)
        top = _cat_tops(tops)
        top_values, top_ids = (None, None) if top is None else top
        ctx.mark_non_differentiable(pred, *([] if top_k == 0 else [top_values, top_ids]))
        return torch.cat(ces), pred, top_values, top_ids

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred, _grad_top_values, _grad_top_ids):
        (g,) = ctx.saved_tensors
        return (grad_ce[:, None] * g).to(ctx.h_dtype), None, None, None, None, None, None


def _chunk_logits_ce(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, target_h=None,
                     kd_weight: float = 0.0, top_k: int = 0):
    """h [n, H], head_w [V, H], labels [n] -> ce [n] fp32, argmax [n], top_k logits and ids (plain autograd; for a
    trainable head). With target_h [n, H]: the distillation mix, the target's distribution a constant (the teacher
    is not trained)."""
    logits = (h @ head_w.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    if target_h is not None:
        p_t = torch.softmax((target_h @ head_w.t()).float(), dim=-1).detach()
        ce = (1.0 - kd_weight) * ce + kd_weight * F.cross_entropy(logits, p_t, reduction="none")
    return ce, logits.argmax(-1), _top_logits(logits, top_k)


def blockwise_ce(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, chunk: int,
                 target_h: torch.Tensor | None = None, kd_weight: float = 0.0, top_k: int = 0):
    """h [n, H], head_w [V, H], labels [n] -> CE [n] fp32, greedy predictions [n] and `top`, in chunks of <= `chunk`
    rows (0 = one chunk) so that at most chunk x V logits are alive at once.

    top: (the top_k largest logits [n, top_k], their ids [n, top_k]), constants taken from the same chunks of
    logits (DFlash 2's selector candidates); None at top_k = 0.
    target_h [n, H] (the target's final normed hidden state that predicts each row's label): the loss becomes
    (1 - kd_weight) * CE + kd_weight * CE against softmax(target_h @ head_w^T), its logits made chunk by chunk too.
    Frozen head (training): `_FusedLinearCE`. No grad needed (eval): plain chunks. Trainable head: each chunk
    checkpointed (recomputed in backward)."""
    ranges = _even_chunks(h.shape[0], chunk)
    if not torch.is_grad_enabled() or not (h.requires_grad or head_w.requires_grad):
        hc = h.to(head_w.dtype)
        tc = None if target_h is None else target_h.to(head_w.dtype)
        outs = [_loss_chunk(hc[s:e], head_w, labels[s:e], None if tc is None else tc[s:e], kd_weight,
                            with_grad=False, top_k=top_k) for s, e in ranges]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), _cat_tops([o[2] for o in outs])
    if not head_w.requires_grad:
        ce, pred, top_values, top_ids = _FusedLinearCE.apply(
            h, head_w, labels, chunk, None if target_h is None else target_h.detach(), kd_weight, top_k)
        return ce, pred, None if top_k == 0 else (top_values, top_ids)
    if len(ranges) == 1:
        return _chunk_logits_ce(h, head_w, labels, target_h, kd_weight, top_k)
    outs = [checkpoint(_chunk_logits_ce, h[s:e], head_w, labels[s:e], None if target_h is None else target_h[s:e],
                       kd_weight, top_k, use_reentrant=False) for s, e in ranges]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), _cat_tops([o[2] for o in outs])


def acceptance_metrics(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """correct, valid [A, B-1] -> acc [B-1] (plain per-position accuracy), cond_acc [B-1] (accuracy at k given all
    earlier positions right), tau_est (1 + sum_k prod_{j<=k} cond_acc_j: the expected acceptance length), and the
    counts they come from (`acceptance_counts`: sums over steps give the estimate of a whole log window)."""
    validf = valid.float()
    right = (correct & valid).float()
    run = torch.cumprod(right, dim=1)                                       # all right up to k
    prev = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=1)     # all right before k
    counts = torch.stack([right.sum(0), validf.sum(0), run.sum(0), (prev * validf).sum(0)])   # [4, B-1]
    return dict(acceptance_from_counts(counts), counts=counts)


def acceptance_from_counts(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """counts [4, B-1] = (right, labelled, all right up to k, all right before k and labelled), summed over any
    number of blocks -> acc, cond_acc, tau_est (see acceptance_metrics)."""
    acc = counts[0] / counts[1].clamp_min(1.0)
    cond = counts[2] / counts[3].clamp_min(1.0)
    return {"acc": acc, "cond_acc": cond, "tau_est": 1.0 + torch.cumprod(cond, dim=0).sum()}


def draft_hidden(drafter: DFlashDrafter, embed_w: torch.Tensor, feats: torch.Tensor, input_ids, position_ids,
                 doc_ids, loss_mask, anchors, anchor_valid, *, block_size: int,
                 attention: str = "sdpa") -> tuple[torch.Tensor, BlockLayout]:
    """All blocks of one row in one drafter pass -> (hidden states [A, B-1, H] of block positions 1..B-1, layout).
    The same computation as one speculative-decoding draft per anchor (tests/test_inference.py pins that)."""
    lay = block_layout(input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid, block_size,
                       drafter.config.mask_token_id)
    if attention == "flex":
        attend = flex_attend(flex_block_mask(anchors, doc_ids, block_size, DRAFTER_MASK_TILE))
    else:
        attend = sdpa_attend(dense_block_mask(anchors, doc_ids, block_size))
    x = F.embedding(lay.block_ids.flatten(), embed_w)                       # [A*B, H]
    h = drafter(x, lay.block_pos, feats, position_ids, attend, block_size)  # [A*B, H]
    return h.view(anchors.shape[0], block_size, -1)[:, 1:], lay


def dflash_loss(drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, feats: torch.Tensor,
                input_ids, position_ids, doc_ids, loss_mask, anchors, anchor_valid, *, block_size: int,
                gamma: float, attention: str = "sdpa", loss_chunk: int = 0, target_hidden: torch.Tensor | None = None,
                kd_weight: float = 0.0, weighting: str = "decay",
                dynamic_alpha: float = DEFAULT_DYNAMIC_ALPHA) -> dict[str, torch.Tensor]:
    """One row -> {'loss', 'acc', 'cond_acc', 'tau_est', 'num_labels'} (tensors on the device, no host sync).

    feats [T, k*H]; input_ids/position_ids/doc_ids/loss_mask [T]; anchors/anchor_valid [A].
    target_hidden [T, H]: the target's final normed hidden state (row p predicts token p + 1), needed when
    kd_weight > 0 (module docstring); ignored at kd_weight = 0, which is exactly the hard-label loss.
    weighting: 'decay' (exp(-(k-1)/gamma)) or 'dynamic' (`dynamic_position_weights` of this row's own loss, with
    dynamic_alpha; gamma is then unused). DFlash 2's selector term gets the same weights."""
    if kd_weight > 0 and target_hidden is None:
        raise ValueError("kd_weight > 0 needs target_hidden, the target's final hidden states")
    if weighting not in POSITION_WEIGHTS:
        raise ValueError(f"weighting must be one of {', '.join(POSITION_WEIGHTS)}, got {weighting!r}")
    h, lay = draft_hidden(drafter, embed_w, feats, input_ids, position_ids, doc_ids, loss_mask, anchors,
                          anchor_valid, block_size=block_size, attention=attention)
    A, T = anchors.shape[0], input_ids.shape[0]
    h = h.reshape(A * (block_size - 1), -1)                                 # positions 1..B-1
    target_h = None
    if kd_weight > 0:
        # Label a+k is predicted by the target's state at a+k-1 (in a's document whenever the label is valid;
        # the clamp only touches positions that carry no weight).
        prev = (anchors[:, None] + torch.arange(block_size - 1, device=anchors.device)[None, :]).clamp(max=T - 1)
        target_h = target_hidden[prev.flatten()]                            # [A*(B-1), H]
    selector = getattr(drafter, "candidate_selector", None)
    # DFlash 2's selector candidates: the top-K of the loss's own chunks of logits
    top_k = 0 if selector is None else selector.top_k
    ce, pred, top = blockwise_ce(h, head_w, lay.labels.flatten(), loss_chunk, target_h, kd_weight, top_k)
    ce, pred = ce.view(A, block_size - 1), pred.view(A, block_size - 1)
    if weighting == "dynamic":
        w = dynamic_position_weights(ce, lay.valid, dynamic_alpha)[None, :] * lay.valid.float()
    else:
        w = position_weights(block_size, gamma, device=ce.device)[None, :] * lay.valid.float()
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    if selector is not None:  # DFlash 2: the drafts are the selector's picks, trained here (training/selector.py)
        unary, candidates = (t.view(A, block_size - 1, -1) for t in top)      # [A, B-1, K] each
        sel_loss, pred = selector_objective(selector, h.view(A, block_size - 1, -1), unary, candidates,
                                            lay.block_ids, lay.labels, w)
        loss = loss + sel_loss
    correct = pred == lay.labels
    out = acceptance_metrics(correct, lay.valid)
    out["loss"] = loss
    out["num_labels"] = lay.valid.sum()
    # Per block: what decoding would accept from this anchor (the leading right drafts, plus the target's own
    # token): validation walks these from anchor to anchor as decoding does (training/validation.py).
    # float, like acceptance_metrics' own cumprod: the scan inductor already compiles in the training step
    out["accept_len"] = 1 + torch.cumprod((correct & lay.valid).float(), dim=1).sum(1)   # [A]
    return out
