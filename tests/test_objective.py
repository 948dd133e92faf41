"""The drafter + objective against simple, obviously-correct references."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_train.data.packing import Sample, make_batch, pack_samples, sample_anchors, valid_anchor_positions
from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.training.objective import (acceptance_metrics, block_layout, default_gamma, dense_block_mask,
                                             dflash_loss, flex_attend, flex_block_mask, position_weights,
                                             sdpa_attend)

B = 4


def tiny_drafter(seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[1, 2],
                        num_target_layers=4, mask_token_id=49, block_size=B, rope_theta=10000.0, **kw)
    return DFlashDrafter(cfg).double()


def random_row(T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in (15, 12, 9):
        ids = torch.randint(0, 48, (n,), generator=g).tolist()
        mask = [i >= 3 for i in range(n)]
        docs.append(Sample(ids, mask))
    (row,) = pack_samples(docs, T)
    return row


def naive_block_hidden(drafter, feats, row, anchors, embed_w):
    """Reference: each block attends to its own document's context strictly before the anchor, plus its own block,
    computed one block at a time with no mask at all."""
    outs = []
    for a in anchors.tolist():
        doc = row.doc_ids[a]
        ctx = [t for t in range(a) if row.doc_ids[t] == doc]
        ctx_idx = torch.tensor(ctx, dtype=torch.long)
        ids = torch.tensor([row.input_ids[a].item()] + [drafter.config.mask_token_id] * (B - 1))
        pos = row.position_ids[a] + torch.arange(B)
        x = F.embedding(ids, embed_w)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        outs.append(drafter(x, pos, feats[ctx_idx], row.position_ids[ctx_idx], attend))
    return torch.cat(outs)


def fast_block_hidden(drafter, feats, row, anchors, embed_w, attention="sdpa"):
    lay = block_layout(row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, anchors,
                       torch.ones_like(anchors, dtype=torch.bool), B, drafter.config.mask_token_id)
    if attention == "sdpa":
        attend = sdpa_attend(dense_block_mask(anchors, row.doc_ids, B))
    else:
        attend = flex_attend(flex_block_mask(anchors, row.doc_ids, B))
    x = F.embedding(lay.block_ids.flatten(), embed_w)
    return drafter(x, lay.block_pos, feats, row.position_ids, attend)


def test_dense_mask_path_equals_per_block_reference():
    drafter = tiny_drafter()
    row = random_row()
    feats = torch.randn(40, 64, dtype=torch.float64)
    embed_w = torch.randn(50, 32, dtype=torch.float64)
    anchors, _ = sample_anchors(row.loss_mask, row.doc_ids, 8, torch.Generator().manual_seed(1))
    fast = fast_block_hidden(drafter, feats, row, anchors, embed_w)
    ref = naive_block_hidden(drafter, feats, row, anchors, embed_w)
    assert fast.shape == (8 * B, 32)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)
    # and in fp32, the tolerance the issue names
    d32 = tiny_drafter().float()
    fast32 = fast_block_hidden(d32, feats.float(), row, anchors, embed_w.float())
    torch.testing.assert_close(fast32, ref.float(), atol=1e-5, rtol=0)


def test_flex_path_equals_dense_path():
    drafter = tiny_drafter().float()
    row = random_row()
    feats = torch.randn(40, 64)
    embed_w = torch.randn(50, 32)
    anchors, _ = sample_anchors(row.loss_mask, row.doc_ids, 8, torch.Generator().manual_seed(2))
    with torch.no_grad():  # flex on CPU has no backward; the GPU run covers it
        flex = fast_block_hidden(drafter, feats, row, anchors, embed_w, "flex")
        dense = fast_block_hidden(drafter, feats, row, anchors, embed_w, "sdpa")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_no_attention_across_documents():
    drafter = tiny_drafter()
    row = random_row()
    feats = torch.randn(40, 64, dtype=torch.float64)
    embed_w = torch.randn(50, 32, dtype=torch.float64)
    anchors = torch.tensor([5, 10, 20, 30])  # docs 0, 0, 1, 2
    base = fast_block_hidden(drafter, feats, row, anchors, embed_w)
    # Scramble document 1 (tokens 15..26) and its features: blocks of documents 0 and 2 must not move.
    feats2 = feats.clone()
    feats2[15:27] = torch.randn(12, 64, dtype=torch.float64)
    row.input_ids[15:27] = torch.randint(0, 48, (12,))
    out = fast_block_hidden(drafter, feats2, row, anchors, embed_w)
    keep = torch.tensor([0, 1, 3]).repeat_interleave(B) * B // B
    idx = torch.cat([torch.arange(i * B, (i + 1) * B) for i in (0, 1, 3)])
    torch.testing.assert_close(out[idx], base[idx], atol=0, rtol=0)
    assert not torch.allclose(out[2 * B:3 * B], base[2 * B:3 * B])
    del keep


def test_context_is_strictly_before_anchor():
    mask = dense_block_mask(torch.tensor([6]), torch.zeros(10, dtype=torch.long), B)
    assert mask.shape == (B, 10 + B)
    assert mask[:, :6].all() and not mask[:, 6:10].any() and mask[:, 10:].all()


def test_loss_weights_and_gamma():
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert math.isclose(w[7].item(), math.exp(-7 / 7), rel_tol=1e-6)


def test_weighted_loss_matches_manual_computation():
    drafter = tiny_drafter().float()
    row = random_row()
    feats = torch.randn(40, 64)
    embed_w, head_w = torch.randn(50, 32), torch.randn(50, 32)
    anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, 6, torch.Generator().manual_seed(3))
    out = dflash_loss(drafter, embed_w, head_w, feats, row.input_ids, row.position_ids, row.doc_ids, row.loss_mask,
                      anchors, valid, block_size=B, gamma=2.0)
    lay = block_layout(row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, anchors, valid, B, 49)
    h = fast_block_hidden(drafter, feats, row, anchors, embed_w).view(6, B, -1)[:, 1:]
    ce = F.cross_entropy((h @ head_w.t()).reshape(-1, 50), lay.labels.flatten(), reduction="none").view(6, B - 1)
    w = torch.exp(-torch.arange(B - 1) / 2.0)[None] * lay.valid
    torch.testing.assert_close(out["loss"], (ce * w).sum() / w.sum())
    # chunked CE (checkpointed) gives the same loss and the same gradients
    out_c = dflash_loss(drafter, embed_w, head_w, feats, row.input_ids, row.position_ids, row.doc_ids,
                        row.loss_mask, anchors, valid, block_size=B, gamma=2.0, loss_chunk=5)
    torch.testing.assert_close(out_c["loss"], out["loss"])


def test_labels_and_validity():
    row = random_row()
    anchors = torch.tensor([3, 13, 14, 39])
    valid = torch.tensor([True, True, False, True])
    lay = block_layout(row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, anchors, valid, B, 49)
    assert lay.labels[0].tolist() == row.input_ids[4:7].tolist()
    assert lay.valid[0].all()
    assert lay.valid[1].tolist() == [True, False, False]   # doc 0 ends at 14
    assert not lay.valid[2].any()                          # invalid anchor
    assert not lay.valid[3].any()                          # past the row end
    assert lay.block_ids[1].tolist() == [row.input_ids[13].item(), 49, 49, 49]
    assert lay.block_pos.view(4, B)[1].tolist() == [13, 14, 15, 16]


def test_anchors_only_where_token_and_next_are_supervised():
    row = random_row()
    ok = valid_anchor_positions(row.loss_mask, row.doc_ids)
    for seed in range(20):
        anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, 16, torch.Generator().manual_seed(seed))
        for a in anchors[valid].tolist():
            assert row.loss_mask[a] and row.loss_mask[a + 1] and row.doc_ids[a] == row.doc_ids[a + 1]
        assert valid.sum() == min(16, int(ok.sum()))
        assert (anchors[valid].diff() > 0).all()


def test_make_batch_is_deterministic_per_index():
    row = random_row()
    a = make_batch(row, 8, seed=0, index=5)
    b = make_batch(row, 8, seed=0, index=5)
    c = make_batch(row, 8, seed=0, index=6)
    assert torch.equal(a.anchors, b.anchors)
    assert not torch.equal(a.anchors, c.anchors)


def test_acceptance_metrics():
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.ones_like(correct)
    m = acceptance_metrics(correct, valid)
    torch.testing.assert_close(m["acc"], torch.tensor([0.75, 0.75, 0.75]))
    # cond: pos1 3/4; pos2 2/3 (of the 3 right at pos1); pos3 1/2
    torch.testing.assert_close(m["cond_acc"], torch.tensor([0.75, 2 / 3, 0.5]))
    # tau = 1 + 0.75 + 0.5 + 0.25 = mean accepted prefix + 1 = (3 + 2 + 1 + 4) / 4
    torch.testing.assert_close(m["tau_est"], torch.tensor(2.5))
