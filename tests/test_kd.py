"""Distillation on the target's next-token distribution (train.kd_weight): the fused chunked loss against a dense
computation, KD = CE for a one-hot target, the (1 - w) * CE + w * KD mix, kd_weight = 0 untouched, the target's
final hidden state in its features, and tiny end-to-end runs (single loop and pipeline, the feature cache) that
learn."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_weights, single_loop_as_the_pipeline_runs
from test_objective_fast import packed_row

from dflash_train.config import ConfigError, TrainConfig, load_config
from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.models.target import load_target
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.data.packing import sample_anchors
from dflash_train.training.objective import blockwise_ce, dflash_loss, draft_hidden
from dflash_train.training.step import DrafterStep

pytestmark = pytest.mark.usefixtures("one_thread")

B, GAMMA = 4, 2.0


def dense_kd(h, head_w, labels, target_h, w):
    """The plain definition on materialised logits: (1 - w) * CE(labels) + w * sum_v -p_target(v) log p_draft(v)."""
    logp = torch.log_softmax(h @ head_w.t(), dim=-1)                       # [n, V]
    p_t = torch.softmax(target_h @ head_w.t(), dim=-1)
    hard = -logp.gather(1, labels[:, None])[:, 0]
    return (1 - w) * hard + w * -(p_t * logp).sum(-1)


@pytest.mark.parametrize("chunk", [0, 5, 100])
@pytest.mark.parametrize("w", [1.0, 0.3])
def test_fused_kd_matches_dense_logits(chunk, w):
    torch.manual_seed(chunk)
    n, H, V = 23, 16, 40
    h = torch.randn(n, H, dtype=torch.float64, requires_grad=True)
    head_w, target_h = torch.randn(V, H, dtype=torch.float64), torch.randn(n, H, dtype=torch.float64)
    labels, row_w = torch.randint(0, V, (n,)), torch.rand(n, dtype=torch.float64)
    loss, pred, _ = blockwise_ce(h, head_w, labels, chunk, target_h, w)
    (g,) = torch.autograd.grad((loss * row_w).sum(), h)
    h_ref = h.detach().clone().requires_grad_(True)
    ref = dense_kd(h_ref, head_w, labels, target_h, w)
    (g_ref,) = torch.autograd.grad((ref * row_w).sum(), h_ref)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)
    assert torch.equal(pred, (h @ head_w.t()).argmax(-1))
    with torch.no_grad():  # the eval path
        torch.testing.assert_close(blockwise_ce(h, head_w, labels, chunk, target_h, w)[0], ref)
    # a trainable head takes plain autograd (checkpointed chunks, fp32 logits); the target's distribution is a constant
    loss_t, _, _ = blockwise_ce(h_ref, head_w.clone().requires_grad_(True), labels, chunk, target_h, w)
    torch.testing.assert_close(loss_t, ref.float())


def test_fused_kd_compiled_matches_eager():
    """The compiled branch (pure pointwise) computes what the eager in-place branch does."""
    torch.manual_seed(1)
    h = torch.randn(19, 16, requires_grad=True)
    head_w, target_h, labels = torch.randn(40, 16), torch.randn(19, 16), torch.randint(0, 40, (19,))

    def f(h):
        loss, pred, _ = blockwise_ce(h, head_w, labels, 8, target_h, 0.6)
        return (loss * torch.linspace(0, 1, 19)).sum(), pred

    loss, pred = f(h)
    (g,) = torch.autograd.grad(loss, h)
    loss_c, pred_c = torch.compile(f, backend="aot_eager", fullgraph=True)(h)
    (g_c,) = torch.autograd.grad(loss_c, h)
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(g_c, g)
    assert torch.equal(pred_c, pred)


def _setup(T=40, A=8, V=24, H=32, seed=0):
    """A tiny fp64 drafter and row; V <= H so that a head with orthonormal rows exists (the one-hot test)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=[1, 2],
                        num_target_layers=4, mask_token_id=V - 1, block_size=B, rope_theta=10000.0)
    drafter = DFlashDrafter(cfg).double()
    doc, loss_mask = packed_row(T, 3, seed)
    row = dict(input_ids=torch.randint(0, V - 1, (T,)), position_ids=torch.arange(T), doc_ids=doc,
               loss_mask=loss_mask)
    anchors, valid = sample_anchors(loss_mask, doc, A, torch.Generator().manual_seed(seed))
    feats = torch.randn(T, 2 * H, dtype=torch.float64)
    embed_w = torch.randn(V, H, dtype=torch.float64)
    head_w = torch.linalg.qr(torch.randn(H, V, dtype=torch.float64)).Q.t().contiguous()   # [V, H], orthonormal rows
    return drafter, row, anchors, valid, feats, embed_w, head_w


def _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid, chunk=7, **kw):
    drafter.zero_grad(set_to_none=True)
    out = dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B,
                      gamma=GAMMA, loss_chunk=chunk, **kw)
    out["loss"].backward()
    return out, [p.grad.clone() for p in drafter.parameters()]


def test_kd_loss_and_drafter_grads_match_a_per_label_reference():
    """Label a+k is scored against the target's distribution from its state at a+k-1, with CE's position weights,
    normalisation and mask; pinned by a plain loop over blocks and positions on dense logits."""
    drafter, row, anchors, valid, feats, embed_w, head_w = _setup()
    T, w = feats.shape[0], 0.7
    target_hidden = torch.randn(T, head_w.shape[1], dtype=torch.float64) * 3
    out, grads = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid, target_hidden=target_hidden,
                                 kd_weight=w)

    drafter.zero_grad(set_to_none=True)
    h, _ = draft_hidden(drafter, embed_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B)
    ids, doc, mask = row["input_ids"], row["doc_ids"], row["loss_mask"]
    num, den = 0.0, 0.0
    for i, a in enumerate(anchors.tolist()):
        for k in range(1, B):
            p = a + k
            if not (valid[i] and p < T and doc[p] == doc[a] and mask[p]):
                continue
            pw = math.exp(-(k - 1) / GAMMA)
            num = num + pw * dense_kd(h[i, k - 1][None], head_w, ids[p][None], target_hidden[p - 1][None], w)[0]
            den += pw
    ref = num / den
    ref.backward()
    torch.testing.assert_close(out["loss"], ref)
    for g, p in zip(grads, drafter.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_kd_equals_ce_when_the_target_is_one_hot():
    """Target logits = 100 x onehot(the data's next token) (a scaled head row through an orthonormal head): the
    target's distribution is one-hot to fp64 precision, so KD only, CE only and any mix agree, gradients too."""
    drafter, row, anchors, valid, feats, embed_w, head_w = _setup()
    ids = row["input_ids"]
    target_hidden = torch.zeros(ids.shape[0], head_w.shape[1], dtype=torch.float64)
    target_hidden[:-1] = 100.0 * head_w[ids[1:]]                           # the state at p-1 predicts token p
    torch.testing.assert_close(target_hidden[:-1] @ head_w.t(), 100.0 * F.one_hot(ids[1:], head_w.shape[0]).double())
    ce, ce_grads = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid)
    for w in (1.0, 0.5):
        kd, kd_grads = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid,
                                       target_hidden=target_hidden, kd_weight=w)
        torch.testing.assert_close(kd["loss"], ce["loss"])
        for a, b in zip(kd_grads, ce_grads):
            torch.testing.assert_close(a, b)
    # and a shifted target (the state at p predicting token p) would not: the alignment is what is tested
    wrong = torch.zeros_like(target_hidden)
    wrong[:] = 100.0 * head_w[ids]
    kd, _ = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid, target_hidden=wrong, kd_weight=1.0)
    assert abs(float(kd["loss"].detach()) - float(ce["loss"].detach())) > 0.05


def test_mixed_weight_interpolates_ce_and_kd():
    drafter, row, anchors, valid, feats, embed_w, head_w = _setup(seed=3)
    target_hidden = torch.randn(feats.shape[0], head_w.shape[1], dtype=torch.float64) * 2
    ce, ce_g = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid)
    kd, kd_g = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid, target_hidden=target_hidden,
                               kd_weight=1.0)
    mix, mix_g = _loss_and_grads(drafter, embed_w, head_w, feats, row, anchors, valid, target_hidden=target_hidden,
                                 kd_weight=0.25)
    assert not torch.allclose(ce["loss"], kd["loss"])
    torch.testing.assert_close(mix["loss"], 0.75 * ce["loss"] + 0.25 * kd["loss"])
    for m, c, k in zip(mix_g, ce_g, kd_g):
        torch.testing.assert_close(m, 0.75 * c + 0.25 * k)
    # the acceptance metrics stay the greedy draft against the data's next token, whatever the objective
    assert torch.equal(mix["counts"], ce["counts"]) and torch.equal(kd["counts"], ce["counts"])


def test_kd_weight_zero_is_bit_identical_to_hard_ce():
    drafter, row, anchors, valid, feats, embed_w, head_w = _setup(seed=5)
    drafter.float()
    f32 = dict(feats=feats.float(), embed_w=embed_w.float(), head_w=head_w.float())
    ce, ce_g = _loss_and_grads(drafter, row=row, anchors=anchors, valid=valid, **f32)
    zero, zero_g = _loss_and_grads(drafter, row=row, anchors=anchors, valid=valid, **f32,
                                   target_hidden=torch.randn(feats.shape[0], head_w.shape[1]), kd_weight=0.0)
    assert torch.equal(ce["loss"], zero["loss"])
    assert all(torch.equal(a, b) for a, b in zip(ce_g, zero_g))


def test_step_splits_the_final_hidden_state_off_the_features():
    """DrafterStep with kd_weight > 0 takes [T, (k+1)*H] and hands the drafter the first k*H columns, the rest to
    the loss; feats of the other width are refused, naming the fix."""
    drafter, row, anchors, valid, feats, embed_w, head_w = _setup(seed=2)
    drafter.float()
    target_hidden = torch.randn(feats.shape[0], head_w.shape[1])
    ref, ref_g = _loss_and_grads(drafter, embed_w.float(), head_w.float(), feats.float(), row, anchors, valid,
                                 chunk=4096, target_hidden=target_hidden, kd_weight=0.5)
    from dflash_train.data.packing import TrainBatch

    batch = TrainBatch(**row, anchors=anchors, anchor_valid=valid)
    cfg = TrainConfig(kd_weight=0.5, gamma=GAMMA, position_weights="decay", dtype="fp32", attention="sdpa",
                      compile="eager")
    step = DrafterStep(drafter, embed_w, head_w, cfg, torch.device("cpu"))
    assert step.feats_width == feats.shape[1] + head_w.shape[1]
    drafter.zero_grad(set_to_none=False)
    out = step(batch, torch.cat([feats.float(), target_hidden], dim=1))
    torch.testing.assert_close(out["loss"], ref["loss"].detach())
    for g, p in zip(ref_g, drafter.parameters()):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(ValueError, match="final_hidden=True"):
        step(batch, feats.float())
    # compiled (dynamo + AOT autograd, as on the GPU): the same loss and gradients
    compiled = DrafterStep(drafter, embed_w, head_w, dataclasses.replace(cfg, compile="default"),
                           torch.device("cpu"), tag="kd_compiled", backend="aot_eager")
    drafter.zero_grad(set_to_none=False)
    out = compiled(batch, torch.cat([feats.float(), target_hidden], dim=1))
    torch.testing.assert_close(out["loss"], ref["loss"].detach())
    for g, p in zip(ref_g, drafter.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_target_features_end_with_the_final_normed_hidden_state(tiny_target):
    """final_hidden=True keeps every layer and appends the state the LM head reads: head(it) = the model's logits."""
    ids = torch.randint(0, 128, (20,))
    pos, docs = torch.arange(20), torch.zeros(20, dtype=torch.long)
    plain = load_target(tiny_target, [1, 2])                                # truncated after layer 2
    kd = load_target(tiny_target, [1, 2], final_hidden=True)
    assert len(plain.hf.model.layers) == 3 and len(kd.hf.model.layers) == 4
    f_plain, f_kd = plain.features(ids, pos, docs), kd.features(ids, pos, docs)
    H = kd.info.hidden_size
    assert f_plain.shape == (20, 2 * H) and f_kd.shape == (20, 3 * H)
    torch.testing.assert_close(f_kd[:, :2 * H], f_plain)
    with torch.no_grad():
        logits = kd.hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(f_kd[:, 2 * H:] @ kd.lm_head.weight.t(), logits)


def test_kd_weight_is_validated():
    with pytest.raises(ConfigError, match="train.kd_weight must be between 0"):
        TrainConfig(kd_weight=1.5)
    with pytest.raises(ConfigError, match="train.kd_weight"):
        TrainConfig(kd_weight=-0.1)


def _kd_cfg(target, out, **over):
    ov = [f"model.target={target}", f"run.out_dir={out}", "train.kd_weight=0.5", "train.max_steps=40",
          "train.log_every=10"]
    return load_config("tiny_cpu", ov + [f"{k}={v}" for k, v in over.items()])


def test_kd_run_learns_and_the_pipeline_equals_the_single_loop(tiny_llama, tmp_path):
    """kd_weight = 0.5 end to end on a tiny random target. Its next-token distribution is near uniform (entropy
    ~ log V), so the KD half of the loss has a high floor and the loss falls less than with CE alone; the CE half
    still teaches the synthetic stream. The pipeline (target worker -> queue -> drafter worker, features of width
    (k+1)*H) reproduces the single-thread loop bit for bit."""
    pipe = train_pipeline(_kd_cfg(tiny_llama, tmp_path / "pipe"))
    ref = single_loop_as_the_pipeline_runs(_kd_cfg(tiny_llama, tmp_path / "ref"))
    first, last = ref.history[0], ref.history[-1]
    assert pipe.steps == ref.steps == 40
    assert last["loss"] < first["loss"] - 0.4, (first["loss"], last["loss"])
    assert last["acc"][0] > 0.4 > first["acc"][0]
    for p, r in zip(pipe.history, ref.history):
        assert {k: p[k] for k in ("loss", "acc", "tau_est")} == {k: r[k] for k in ("loss", "acc", "tau_est")}
    assert_same_weights(pipe.drafter_dir, ref.drafter_dir)


def test_kd_with_the_feature_cache_trains_as_with_nothing_kept(tiny_llama, tmp_path):
    """Distillation over several epochs with the rows' features kept (train.feature_cache_gb, as the GPU demo keeps
    them): the kept rows carry the target's final hidden state too, so the later epochs, which run no target
    forward, train step for step as the same fixed rows with nothing kept."""
    small = {"data.synthetic_samples": 12, "train.max_steps": 24}
    kept = train_pipeline(_kd_cfg(tiny_llama, tmp_path / "kept", **small, **{"train.feature_cache_gb": 1}))
    rows = kept.data["rows_per_epoch"]
    assert kept.steps >= 2 * rows, "the test needs two epochs or more"
    assert kept.target_forwards == [rows]
    none = train_pipeline(_kd_cfg(tiny_llama, tmp_path / "none", **small, **{"train.feature_cache_gb": 1e-12}))
    assert none.target_forwards == [kept.steps]
    for k, n in zip(kept.history, none.history):
        assert {m: k[m] for m in ("loss", "acc", "tau_est")} == {m: n[m] for m in ("loss", "acc", "tau_est")}
    assert_same_weights(kept.drafter_dir, none.drafter_dir)
