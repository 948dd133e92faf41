"""The fast paths of the objective (tile-level flex BlockMask, fused LM-head CE, compiled tracing) against the simple
references: the dense element mask and plain autograd cross-entropy."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.training.flops import drafter_step_flops, visible_pairs
from dflash_train.data.packing import sample_anchors
from dflash_train.training.objective import (blockwise_ce, dense_block_mask, dflash_loss, flex_attend,
                                             flex_block_mask, sdpa_attend)


def packed_row(T: int, num_docs: int, seed: int):
    """doc_ids [T] (contiguous documents, then padding -1) and a random loss mask [T]."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), num_docs - 1))
    doc = torch.empty(T, dtype=torch.long)
    for d, (a, b) in enumerate(zip([0] + cuts, cuts + [T])):
        doc[a:b] = d
    doc[T - rng.randint(0, T // 4):] = -1
    loss_mask = (torch.rand(T, generator=torch.Generator().manual_seed(seed)) > 0.3) & (doc >= 0)
    return doc, loss_mask


@pytest.mark.parametrize("seed", range(12))
def test_flex_tiles_cover_exactly_the_visible_pairs(seed):
    rng = random.Random(seed)
    T, B, A, tile = rng.choice([40, 128, 300]), rng.choice([4, 10, 16]), rng.choice([3, 16, 40]), rng.choice([16, 128])
    doc, loss_mask = packed_row(T, rng.randint(1, 4), seed)
    anchors, _ = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(seed))
    dense = dense_block_mask(anchors, doc, B)                                   # [N, T+N]
    fm = flex_block_mask(anchors, doc, B, tile=tile)
    N, KV = A * B, T + A * B
    qt, kt = -(-N // tile), -(-KV // tile)
    pad = torch.zeros(qt * tile, kt * tile, dtype=torch.bool)
    pad[:N, :KV] = dense
    inside = torch.zeros_like(pad)
    inside[:N, :KV] = True
    any_visible = pad.view(qt, tile, kt, tile).any(3).any(1)
    all_visible = (pad | ~inside).view(qt, tile, kt, tile).all(3).all(1)
    bm = fm.block_mask()
    partial, full = fm.partial, fm.full
    assert not (any_visible & ~(partial | full)).any(), "a visible pair lies in a skipped tile"
    assert not (full & ~all_visible).any(), "a 'full' tile holds a masked pair"
    assert not (partial & full).any()
    assert torch.equal(bm.to_dense()[0, 0].bool(), partial | full)
    # and mask_mod itself is the dense mask, element by element
    q_idx = torch.arange(N)[:, None].expand(N, KV)
    kv_idx = torch.arange(KV)[None, :].expand(N, KV)
    assert torch.equal(bm.mask_mod(0, 0, q_idx, kv_idx), dense)
    assert visible_pairs(anchors, doc, B) == int(dense.sum())


def test_flex_tiles_skip_most_of_the_grid_at_the_real_shape():
    T, A, B = 4096, 512, 16
    doc = torch.zeros(T, dtype=torch.long)
    loss_mask = torch.ones(T, dtype=torch.bool)
    anchors, _ = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(0))
    fm = flex_block_mask(anchors, doc, B)
    computed = int(fm.partial.sum() + fm.full.sum()) * fm.tile ** 2
    useful = visible_pairs(anchors, doc, B)
    assert computed < 0.2 * A * B * (T + A * B)       # the dense grid would be 5x more
    assert useful / computed > 0.85                    # little waste inside the computed tiles
    assert int(fm.full.sum()) > 5 * int(fm.partial.sum())     # mostly mask-free tiles


@pytest.mark.parametrize("chunk", [0, 5, 7, 100])
def test_fused_ce_matches_plain_autograd(chunk):
    torch.manual_seed(chunk)
    n, H, V = 23, 16, 40
    h = torch.randn(n, H, dtype=torch.float64, requires_grad=True)
    head_w = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (n,))
    w = torch.rand(n, dtype=torch.float64)
    ce, pred, _ = blockwise_ce(h, head_w, labels, chunk)
    (ce * w).sum().backward()
    h_ref = h.detach().clone().requires_grad_(True)
    logits = h_ref @ head_w.t()
    ce_ref = F.cross_entropy(logits, labels, reduction="none")
    (ce_ref * w).sum().backward()
    torch.testing.assert_close(ce, ce_ref)
    torch.testing.assert_close(h.grad, h_ref.grad)
    assert torch.equal(pred, logits.argmax(-1))
    with torch.no_grad():  # the eval path returns the same without keeping gradients
        ce2, pred2, _ = blockwise_ce(h, head_w, labels, chunk)
    torch.testing.assert_close(ce2, ce_ref)
    assert torch.equal(pred2, pred)


@pytest.mark.parametrize("chunk", [0, 7])
def test_fused_ce_top_k_is_the_dense_top_k_on_every_path(chunk):
    """blockwise_ce's top-K (DFlash 2's selector candidates, taken inside its chunks) is torch.topk of the full logits
    on each path: frozen head (fused), no grad (eval), trainable head (checkpointed chunks), distillation; the
    logits come back as constants, and without top_k nothing comes back."""
    torch.manual_seed(chunk)
    n, H, V, K = 23, 16, 40, 5
    h = torch.randn(n, H, requires_grad=True)
    head_w, target_h, labels = torch.randn(V, H), torch.randn(n, H), torch.randint(0, V, (n,))
    ref = (h.detach() @ head_w.t()).topk(K, dim=-1)
    with torch.no_grad():
        eval_top = blockwise_ce(h, head_w, labels, chunk, top_k=K)[2]
    tops = [blockwise_ce(h, head_w, labels, chunk, top_k=K)[2], eval_top,
            blockwise_ce(h, head_w.clone().requires_grad_(True), labels, chunk, top_k=K)[2],
            blockwise_ce(h, head_w, labels, chunk, target_h, 0.5, top_k=K)[2]]
    for values, ids in tops:
        assert torch.equal(ids, ref.indices)
        torch.testing.assert_close(values, ref.values)
        assert not values.requires_grad
    assert blockwise_ce(h, head_w, labels, chunk)[2] is None


def _tiny_setup(B=4, T=48, A=8, layers=2):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[1, 2],
                        num_target_layers=4, mask_token_id=49, block_size=B, rope_theta=10000.0)
    drafter = DFlashDrafter(cfg)
    doc, loss_mask = packed_row(T, 3, 1)
    row = dict(input_ids=torch.randint(0, 48, (T,)), position_ids=torch.arange(T), doc_ids=doc, loss_mask=loss_mask)
    anchors, valid = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(0))
    return drafter, row, anchors, valid, torch.randn(T, 64), torch.randn(50, 32), torch.randn(50, 32)


def test_fused_ce_gives_the_same_drafter_gradients_as_full_logits():
    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()
    grads = []
    for chunk in (0, 7):
        drafter.zero_grad(set_to_none=True)
        head = head_w.clone().requires_grad_(chunk == 0)   # a trainable head takes the plain autograd path
        out = dflash_loss(drafter, embed_w, head, feats, **row, anchors=anchors, anchor_valid=valid, block_size=4,
                          gamma=2.0, loss_chunk=chunk)
        out["loss"].backward()
        grads.append([p.grad.clone() for p in drafter.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_step_traces_as_one_graph():
    """dynamo + AOT autograd trace the whole loss (flex mask built in-graph, fused CE) with no graph break."""
    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()

    def loss(attention, anchors, valid):
        return dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=4,
                           gamma=2.0, attention=attention, loss_chunk=7)["loss"]

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.no_grad():  # flex attention has no CPU backward
        torch.testing.assert_close(compiled("flex", anchors, valid), loss("sdpa", anchors, valid))
    drafter.zero_grad(set_to_none=True)
    compiled("sdpa", anchors, valid).backward()
    g = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad(set_to_none=True)
    loss("sdpa", anchors, valid).backward()
    for a, p in zip(g, drafter.parameters()):
        torch.testing.assert_close(a, p.grad)
    # new anchors: same shapes, no recompile needed (fullgraph=True would raise on a break)
    anchors2, valid2 = sample_anchors(row["loss_mask"], row["doc_ids"], 8, torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(compiled("flex", anchors2, valid2), loss("sdpa", anchors2, valid2))


def test_compiled_flex_step_builds_its_mask_once_and_sorts_nothing():
    """Inside a compiled step the flex BlockMask is built once for all layers, with no sort: a sort in the step's
    graph compiled for 20-27 s a Triton kernel on an H100 (issue #16, fast start). The traced graph holds no sort,
    and as many prefix sums (the tile orderings') with 3 drafter layers as with 1."""
    prefix_sums = {}
    for layers in (1, 3):
        drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup(layers=layers)
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        def loss(anchors, valid):
            return dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid,
                               block_size=4, gamma=2.0, attention="flex", loss_chunk=7)["loss"]

        with torch.no_grad():  # flex attention has no CPU backward
            torch.compile(loss, backend=record, fullgraph=True, dynamic=False)(anchors, valid)
        ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        assert not [op for op in ops if "sort" in op]
        prefix_sums[layers] = sum("cumsum" in op for op in ops)
    assert prefix_sums[1] == prefix_sums[3] > 0, prefix_sums


def test_flex_attend_matches_dense_attention():
    doc, loss_mask = packed_row(300, 3, 4)
    anchors, _ = sample_anchors(loss_mask, doc, 24, torch.Generator().manual_seed(4))
    q, k, v = torch.randn(1, 4, 240, 16), torch.randn(1, 2, 540, 16), torch.randn(1, 2, 540, 16)
    ref = sdpa_attend(dense_block_mask(anchors, doc, 10))(q, k, v)
    torch.testing.assert_close(flex_attend(flex_block_mask(anchors, doc, 10, tile=32))(q, k, v), ref)


def test_drafter_flops_at_the_qwen3_8b_shape():
    cfg = DrafterConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33],
                        num_target_layers=36, mask_token_id=0, block_size=16)
    f = drafter_step_flops(cfg, 4096, 512, pairs=512 * 16 * (2048 + 16))
    assert f["lm_head"] == 2.0 * 512 * 15 * 4096 * 151936
    assert 70e12 < f["train"] < 76e12     # the ~74 TFLOP per step the issue counts


def test_fused_ce_compiled_matches_eager():
    """The compiled branch (pure pointwise softmax - onehot) computes what the eager in-place branch does."""
    torch.manual_seed(1)
    h = torch.randn(19, 16, requires_grad=True)
    head_w, labels = torch.randn(40, 16), torch.randint(0, 40, (19,))

    def f(h):
        ce, pred, _ = blockwise_ce(h, head_w, labels, 8)
        return (ce * torch.linspace(0, 1, 19)).sum(), pred

    loss, pred = f(h)
    (g,) = torch.autograd.grad(loss, h)
    loss_c, pred_c = torch.compile(f, backend="aot_eager", fullgraph=True)(h)
    (g_c,) = torch.autograd.grad(loss_c, h)
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(g_c, g)
    assert torch.equal(pred_c, pred)


def test_frozen_target_weights_are_static_inputs_of_the_compiled_step():
    """The embedding and LM head enter the compiled step as static inputs (as the drafter's parameters do), so
    reduce-overhead never copies them into graph buffers; the features and the batch stay ordinary inputs. Each
    replica's step has its own static tensors."""
    from dflash_train.config import TrainConfig
    from dflash_train.data.packing import TrainBatch
    from dflash_train.training.step import DrafterStep

    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cfg = TrainConfig(compile="default", attention="sdpa", dtype="fp32", loss_chunk=7)
    step = DrafterStep(drafter, embed_w, head_w, cfg, torch.device("cpu"), tag="static", backend=record)
    other = DrafterStep(drafter, embed_w, head_w, cfg, torch.device("cpu"), tag="static2", backend=record)
    assert step.embed_w is not other.embed_w and step.head_w is not other.head_w
    batch = TrainBatch(**row, anchors=anchors, anchor_valid=valid)
    step(batch, feats)
    static, dynamic = set(), set()
    for gm in graphs:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                is_static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                (static if is_static else dynamic).add(tuple(value.shape))
    assert tuple(embed_w.shape) in static and tuple(feats.shape) in dynamic, (static, dynamic)
    assert tuple(embed_w.shape) not in dynamic


@pytest.mark.parametrize("mode", ["default", "eager"])
def test_validation_through_the_training_graph_compiles_nothing_and_reads_the_same(mode):
    """train.validation_graph=training: evaluate runs the training step's compiled forward (no backward), so after
    the training step's warm-up validation compiles no frame, and its loss, metrics and acceptance lengths equal
    those of validation's own forward-only graph; the .grad buffers stay as the training steps left them."""
    import copy

    from torch._dynamo.utils import counters

    from dflash_train.config import TrainConfig
    from dflash_train.data.packing import TrainBatch
    from dflash_train.training.step import DrafterStep

    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()
    batch = TrainBatch(**row, anchors=anchors, anchor_valid=valid)
    steps = {}
    for graph in ("own", "training"):
        cfg = TrainConfig(compile=mode, attention="sdpa", dtype="fp32", loss_chunk=7, validation_graph=graph)
        steps[graph] = DrafterStep(copy.deepcopy(drafter), embed_w, head_w, cfg, torch.device("cpu"),
                                   tag=f"vgraph_{mode}_{graph}", backend="aot_eager")
        for _ in range(2):  # the pipeline's warm-up: the training step twice
            steps[graph](batch, feats)
    grads = [p.grad.clone() for p in steps["training"].drafter.parameters()]
    frames = counters["frames"]["total"]
    through_training = steps["training"].evaluate(batch, feats)
    assert counters["frames"]["total"] == frames  # nothing compiled for validation
    for p, g in zip(steps["training"].drafter.parameters(), grads):
        assert torch.equal(p.grad, g)
    own = steps["own"].evaluate(batch, feats)
    if mode != "eager":
        assert counters["frames"]["total"] > frames  # the own graph compiles (the cost the option saves)
    assert set(through_training) == set(own)
    for k in own:
        assert not through_training[k].requires_grad
        torch.testing.assert_close(through_training[k], own[k], rtol=1e-5, atol=1e-6)


def test_flex_kernel_options_by_head_size():
    """64-wide Triton tiles and a 4-warp backward for heads of at most 64 on CUDA (measured faster at the demo's
    shape), flex's defaults for larger heads (measured slower there) and on other devices (the CPU template takes no
    tile options)."""
    from types import SimpleNamespace

    from dflash_train.training.objective import SMALL_HEAD_KERNEL_OPTIONS, flex_kernel_options

    def q(device, d):
        return SimpleNamespace(device=torch.device(device), shape=(1, 9, 1024, d))
    assert flex_kernel_options(q("cuda", 64)) == SMALL_HEAD_KERNEL_OPTIONS
    assert flex_kernel_options(q("cuda", 32)) == SMALL_HEAD_KERNEL_OPTIONS
    assert flex_kernel_options(q("cuda", 128)) is None
    assert flex_kernel_options(q("cpu", 64)) is None
    # every kernel tile divides the mask's 128-wide tiles; the backward's launch setting rides along
    tiles = {k: v for k, v in SMALL_HEAD_KERNEL_OPTIONS.items() if k.startswith("BLOCK_")}
    assert len(tiles) == 6 and all(128 % v == 0 for v in tiles.values())
    assert SMALL_HEAD_KERNEL_OPTIONS["bwd_num_warps"] == 4
