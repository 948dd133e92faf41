"""train.anchor_sampling=decoding: the target's own token probabilities in its features (eager and compiled), anchors
drawn with weight 0.1 + (1 - p) (valid ones only, sorted, padded, seeded), the step training on the drawn anchors
while validation keeps its own, and tiny end-to-end runs (single loop and pipeline) that learn and agree."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, single_loop_as_the_pipeline_runs

from dflash_train.config import ConfigError, TrainConfig, load_config
from dflash_train.data.packing import decoding_anchors, valid_anchor_positions
from dflash_train.models.target import load_target
from dflash_train.pipeline.coordinator import train_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def _draw(loss_mask, doc_ids, probs, A, seed):
    g = torch.Generator().manual_seed(seed)
    return decoding_anchors(loss_mask, doc_ids, probs, A, g)


def test_anchors_are_valid_sorted_distinct_and_seeded():
    T, A = 64, 12
    loss_mask = torch.zeros(T, dtype=torch.bool)
    loss_mask[10:30] = loss_mask[40:60] = True
    doc_ids = torch.zeros(T, dtype=torch.long)
    doc_ids[35:] = 1
    probs = torch.rand(T, generator=torch.Generator().manual_seed(0))
    ok = valid_anchor_positions(loss_mask, doc_ids)
    for seed in range(20):
        anchors, valid = _draw(loss_mask, doc_ids, probs, A, seed)
        assert anchors.shape == valid.shape == (A,) and bool(valid.all())
        assert bool(ok[anchors].all())                              # never a position sample_anchors would refuse
        assert torch.equal(anchors, anchors.sort().values) and anchors.unique().numel() == A
    assert all(torch.equal(x, y) for x, y in zip(_draw(loss_mask, doc_ids, probs, A, 3),
                                                 _draw(loss_mask, doc_ids, probs, A, 3)))
    assert not torch.equal(_draw(loss_mask, doc_ids, probs, A, 3)[0], _draw(loss_mask, doc_ids, probs, A, 4)[0])


def test_a_row_with_fewer_valid_anchors_is_padded_like_sample_anchors():
    T, A = 32, 8
    loss_mask = torch.zeros(T, dtype=torch.bool)
    loss_mask[5:9] = True                                           # valid anchors 5, 6, 7 (8's next is not supervised)
    anchors, valid = _draw(loss_mask, torch.zeros(T, dtype=torch.long), torch.full((T,), 0.5), A, 0)
    assert anchors.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert valid.tolist() == [True] * 3 + [False] * 5


def test_anchors_follow_the_targets_doubt():
    """Positions whose token the target gave p = 0 weigh 1.1, the rest (p = 1) the floor, 0.1: over many draws the
    first are picked far more often; with equal probabilities every position alike."""
    T, A, draws = 128, 8, 300
    loss_mask, doc_ids = torch.ones(T, dtype=torch.bool), torch.zeros(T, dtype=torch.long)
    doubt = torch.zeros(T, dtype=torch.bool)
    doubt[torch.arange(3, T - 1, 8)] = True                          # 16 positions
    probs = torch.where(doubt, 0.0, 1.0)
    picked = torch.zeros(T)
    for seed in range(draws):
        picked[_draw(loss_mask, doc_ids, probs, A, seed)[0]] += 1
    rate_doubt, rate_sure = picked[doubt].mean() / draws, picked[~doubt][:-1].mean() / draws
    assert rate_doubt > 5 * rate_sure, (rate_doubt, rate_sure)        # weights 1.1 vs 0.1: 11x per draw
    flat = torch.zeros(T)
    for seed in range(draws):
        flat[_draw(loss_mask, doc_ids, torch.full((T,), 0.7), A, seed)[0]] += 1
    assert flat[doubt].mean() / flat[~doubt][:-1].mean() < 1.5


def test_target_features_end_with_its_own_token_probabilities(tiny_target):
    """anchor_weights=True keeps every layer and appends p[q] = softmax(logits[q - 1])[token q], p[0] = 1; within
    the second of two packed documents the values equal that document alone."""
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(0))
    pos, docs = torch.arange(24), torch.zeros(24, dtype=torch.long)
    plain = load_target(tiny_target, [1, 2])
    target = load_target(tiny_target, [1, 2], anchor_weights=True)
    assert len(target.hf.model.layers) == 4
    feats = target.features(ids, pos, docs)
    H = target.info.hidden_size
    assert feats.shape == (24, 2 * H + 1)
    torch.testing.assert_close(feats[:, :2 * H], plain.features(ids, pos, docs))
    with torch.no_grad():
        probs = target.hf(input_ids=ids[None]).logits[0].softmax(-1)
    torch.testing.assert_close(feats[1:, -1], probs[:-1].gather(1, ids[1:, None])[:, 0])
    assert feats[0, -1] == 1
    second = torch.arange(24) >= 10                                   # a second document from token 10
    packed = target.features(ids, torch.where(second, pos - 10, pos), second.long())
    alone = target.features(ids[10:], pos[:14], docs[:14])
    torch.testing.assert_close(packed[11:, -1], alone[1:, -1])


def test_anchor_sampling_is_validated():
    with pytest.raises(ConfigError, match="train.anchor_sampling must be one of uniform, decoding"):
        TrainConfig(anchor_sampling="hard")


def _cfg(target, out, **over):
    ov = [f"model.target={target}", f"run.out_dir={out}", "train.anchor_sampling=decoding", "train.max_steps=40",
          "train.log_every=10"]
    return load_config("tiny_cpu", ov + [f"{k}={v}" for k, v in over.items()])


def test_decoding_anchors_learn_and_the_pipeline_equals_the_single_loop(tiny_llama, tmp_path):
    """End to end on a tiny random target: the target worker sends features one column wider, the drafter draws
    its anchors from that column, and the drafter still learns the synthetic stream; the pipeline reproduces the
    single-thread loop bit for bit (the same anchors: seeded by the batch index, not by the thread)."""
    pipe = train_pipeline(_cfg(tiny_llama, tmp_path / "pipe"))
    ref = single_loop_as_the_pipeline_runs(_cfg(tiny_llama, tmp_path / "ref"))
    first, last = ref.history[0], ref.history[-1]
    assert pipe.steps == ref.steps == 40
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["acc"][0] > 0.5 > first["acc"][0]
    for p, r in zip(pipe.history, ref.history):
        assert {k: p[k] for k in ("loss", "acc", "tau_est")} == {k: r[k] for k in ("loss", "acc", "tau_est")}
    assert_same_weights(pipe.drafter_dir, ref.drafter_dir)


def test_decoding_anchors_over_kept_rows_train_as_over_recomputed_ones(tiny_llama, tmp_path):
    """The GPU demo keeps rows' features across epochs (train.feature_cache_gb) and, with this setting, draws its
    anchors from their last column: a kept row must carry that column, so the run with every row kept trains step for
    step as the one that recomputes every row (a budget below one row), and runs the target once a row."""
    small = {"data.synthetic_samples": 12, "train.max_steps": 12, "train.log_every": 1}
    kept = train_pipeline(_cfg(tiny_llama, tmp_path / "kept", **small, **{"train.feature_cache_gb": 1}))
    rows = kept.data["rows_per_epoch"]
    assert 12 >= 2 * rows, "the test needs two epochs or more"
    assert kept.target_forwards == [rows]
    none = train_pipeline(_cfg(tiny_llama, tmp_path / "none", **small, **{"train.feature_cache_gb": 1e-12}))
    assert none.target_forwards == [12]
    metrics = ("loss", "acc", "tau_est")
    assert [{k: h[k] for k in metrics} for h in kept.history] == [{k: h[k] for k in metrics} for h in none.history]
    assert_same_weights(kept.drafter_dir, none.drafter_dir)


def test_the_step_draws_its_anchors_from_the_last_column_and_validation_keeps_its_own():
    """DrafterStep with anchor_sampling=decoding: the loss and gradients of the anchors decoding_anchors draws from
    feats' last column (seeded by train.seed and the batch index), not the loader's; the column never reaches the
    drafter; evaluate() scores the anchors it is given, the column cut off; the wrong width names the fix."""
    import dataclasses

    from test_kd import GAMMA, _loss_and_grads, _setup

    from dflash_train.data.packing import TrainBatch
    from dflash_train.training.step import DrafterStep

    drafter, row, anchors, valid, feats, embed_w, head_w = _setup(A=4, seed=3)
    drafter.float()
    probs = torch.rand(feats.shape[0], generator=torch.Generator().manual_seed(1))
    batch = TrainBatch(**row, anchors=anchors, anchor_valid=valid, index=7)
    cfg = TrainConfig(anchor_sampling="decoding", seed=5, gamma=GAMMA, position_weights="decay", dtype="fp32",
                      attention="sdpa", compile="eager")
    step = DrafterStep(drafter, embed_w, head_w, cfg, torch.device("cpu"))
    assert step.feats_width == feats.shape[1] + 1
    drawn, drawn_valid = decoding_anchors(row["loss_mask"], row["doc_ids"], probs, anchors.shape[0],
                                          torch.Generator().manual_seed(5 * 1_000_003 + 7 + 1))
    assert not torch.equal(drawn, anchors)
    ref, ref_g = _loss_and_grads(drafter, embed_w.float(), head_w.float(), feats.float(), row, drawn, drawn_valid,
                                 chunk=4096)
    drafter.zero_grad(set_to_none=False)
    out = step(batch, torch.cat([feats.float(), probs[:, None]], dim=1))
    torch.testing.assert_close(out["loss"], ref["loss"].detach())
    for g, p in zip(ref_g, drafter.parameters()):
        torch.testing.assert_close(p.grad, g)
    uniform = DrafterStep(drafter, embed_w, head_w, dataclasses.replace(cfg, anchor_sampling="uniform"),
                          torch.device("cpu"), tag="uniform")
    seen = step.evaluate(batch, torch.cat([feats.float(), probs[:, None]], dim=1))
    torch.testing.assert_close(seen["loss"], uniform.evaluate(batch, feats.float())["loss"])
    with pytest.raises(ValueError, match="anchor_weights=True"):
        step(batch, feats.float())


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_the_compiled_target_forward_gives_the_same_probabilities(tiny_llama, attention):
    """FeatureForward (torch.compile, the aot_eager stand-in for inductor) with the LM head inside: one graph, no
    graph break, the same features and probabilities as eager on two packed layouts, no recompile between them."""
    from test_target_compile import LAYOUTS, T, graphs_compiled, packed
    from torch._dynamo.utils import counters

    from dflash_train.models.target import FeatureForward
    from dflash_train.training.cudagraphs import configure_cudagraphs

    configure_cudagraphs()
    torch._dynamo.reset()
    try:
        target = load_target(tiny_llama, [1, 2], attention=attention, anchor_weights=True)
        compiled = FeatureForward(target, T, compile="default", backend="aot_eager")
        rows = [packed(LAYOUTS[i], seed=i) for i in (2, 3)]
        eager = [target.features(*row) for row in rows]
        before, breaks = graphs_compiled(), sum(counters["graph_break"].values())
        outs = [compiled(*rows[0])]
        with torch._dynamo.config.patch(error_on_recompile=True):
            outs.append(compiled(*rows[1]))
        assert graphs_compiled() - before == 1 and sum(counters["graph_break"].values()) == breaks
        for out, ref in zip(outs, eager):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
