"""train.position_weights: `decay` (exp(-(k-1)/gamma), unchanged) and `dynamic` (acceptance-aware weights from the
step's own loss, objective.dynamic_position_weights): the weights against a per-block Python loop and their limits,
the loss and its gradients (weights held constant), the compiled step, DFlash 2's selector term, the config and one
real training run."""

from __future__ import annotations

import math

import pytest
import torch

from test_objective_fast import _tiny_setup
from dflash_train.cli import main as cli_main
from dflash_train.config import ConfigError, TrainConfig, load_config
from dflash_train.data.packing import TrainBatch, sample_anchors
from dflash_train.models.drafter2 import DFlash2Drafter, Drafter2Config
from dflash_train.training import objective
from dflash_train.training.objective import (blockwise_ce, dflash_loss, draft_hidden, dynamic_position_weights,
                                             position_weights)
from dflash_train.training.step import DrafterStep
from dflash_train.training.trainer import train_single_device

B = 4          # block size of _tiny_setup's drafter
GAMMA = 2.0


def loop_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> list[float]:
    """The obvious computation, one block and one position at a time: s_j = (1 - alpha) exp(-ce_j) + alpha where
    labelled, 0 (acceptance stops) where not; S_k = sum_{m>=k} prod_{j<=m} s_j; w_k = mean of S_k over the blocks
    labelled at k, relative to position 1."""
    A, K = ce.shape
    S = [[0.0] * K for _ in range(A)]
    for b in range(A):
        s = [((1 - alpha) * math.exp(-float(ce[b, j])) + alpha) if valid[b, j] else 0.0 for j in range(K)]
        for k in range(K):
            total = 0.0
            for m in range(k, K):
                prod = 1.0
                for j in range(m + 1):
                    prod *= s[j]
                total += prod
            S[b][k] = total
    mean = []
    for k in range(K):
        rows = [S[b][k] for b in range(A) if valid[b, k]]
        mean.append(sum(rows) / len(rows) if rows else 0.0)
    return [1.0] + [m / mean[0] for m in mean[1:]]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
def test_dynamic_weights_equal_a_per_block_loop(alpha):
    gen = torch.Generator().manual_seed(int(alpha * 10))
    A, K = 40, 15
    ce = torch.rand(A, K, generator=gen) * 2.5                     # p between ~0.08 and 1
    ends = torch.randint(1, K + 1, (A,), generator=gen)            # labels stop at a document's or row's end
    valid = torch.arange(K)[None, :] < ends[:, None]
    valid[3, 4:7] = False                                          # a gap in the loss mask (a user turn)
    valid[3, 7:] = True
    valid[5:8] = False                                             # padding anchors: no label at all
    valid[:, K - 1] = False                                        # a position no block labels
    got = dynamic_position_weights(ce, valid, alpha)
    assert got.shape == (K,) and got.dtype == torch.float32 and got[0] == 1.0
    torch.testing.assert_close(got, torch.tensor(loop_weights(ce, valid, alpha)), rtol=1e-5, atol=1e-7)
    # unlabelled positions' values never matter
    ce2 = torch.where(valid, ce, torch.rand(A, K, generator=gen) * 50)
    assert torch.equal(dynamic_position_weights(ce2, valid, alpha), got)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_certain_drafts_weigh_each_position_by_the_positions_from_it_on(alpha):
    """p_j = 1 everywhere: S_k = the number of positions from k on, so w is proportional to (B-1, B-2, ..., 1)."""
    K = 15
    w = dynamic_position_weights(torch.zeros(8, K), torch.ones(8, K, dtype=torch.bool), alpha)
    torch.testing.assert_close(w, torch.arange(K, 0, -1, dtype=torch.float32) / K)


def test_weight_concentrates_on_position_1_when_later_drafts_fail():
    K, A = 15, 6
    ce = torch.rand(A, K)
    valid = torch.ones(A, K, dtype=torch.bool)
    # p_2 = 0 in every block: no draft past position 1 can be accepted, all weight goes to position 1
    ce[:, 1] = 1e4
    assert torch.equal(dynamic_position_weights(ce, valid, 0.0), torch.eye(K)[0])
    # p_1 = 0 in every block: every S_k = 0 (each term of E[L] carries p_1); the degenerate profile is position 1
    ce = torch.rand(A, K)
    ce[:, 0] = 1e4
    assert torch.equal(dynamic_position_weights(ce, valid, 0.0), torch.eye(K)[0])
    # a small p_1 does not do that: it scales all of one block's S_k alike, so one block's profile ignores it
    ce[:1, 0] = 0.1
    w_easy = dynamic_position_weights(ce[:1], valid[:1], 0.0)
    ce[:1, 0] = 9.0
    torch.testing.assert_close(dynamic_position_weights(ce[:1], valid[:1], 0.0), w_easy)
    # the floor alpha keeps later positions trained where the drafter gets nothing right:
    # w_k = alpha^(k-1) (1 - alpha^(K-k+1)) / (1 - alpha^K) >= (1 - alpha) alpha^(k-1)
    ce = torch.full((A, K), 1e4)
    w = dynamic_position_weights(ce, valid, 0.5)
    k = torch.arange(1, K + 1, dtype=torch.float32)
    torch.testing.assert_close(w, 0.5 ** (k - 1) * (1 - 0.5 ** (K - k + 1)) / (1 - 0.5 ** K))
    assert (w >= 0.5 * 0.5 ** (k - 1)).all()
    # no labelled block at all (every anchor padding): position 1, no NaN
    assert torch.equal(dynamic_position_weights(ce, torch.zeros_like(valid), 0.5), torch.eye(K)[0])


def _loss(drafter, setup, **kw):
    _, row, anchors, valid, feats, embed_w, head_w = setup
    return dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B,
                       gamma=GAMMA, loss_chunk=7, **kw)


def _ce_and_valid(drafter, setup):
    """The per-position CE [A, B-1] with its graph, computed outside dflash_loss, and the labels' mask."""
    _, row, anchors, valid, feats, embed_w, head_w = setup
    h, lay = draft_hidden(drafter, embed_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B)
    ce, _, _ = blockwise_ce(h.reshape(-1, h.shape[-1]), head_w, lay.labels.flatten(), 7)
    return ce.view(anchors.shape[0], B - 1), lay.valid


def _grads(drafter, loss):
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in drafter.parameters()]


def test_decay_is_todays_loss_and_dynamic_weights_are_constants():
    setup = _tiny_setup()
    drafter = setup[0]
    # decay: the default, the same computation as before the option existed (bit for bit) and the formula
    default = _loss(drafter, setup)
    decay = _loss(drafter, setup, weighting="decay")
    assert torch.equal(default["loss"], decay["loss"])
    assert all(torch.equal(a, b) for a, b in zip(_grads(drafter, default["loss"]), _grads(drafter, decay["loss"])))
    ce, valid = _ce_and_valid(drafter, setup)
    w = position_weights(B, GAMMA)[None, :] * valid.float()
    torch.testing.assert_close(decay["loss"], (ce * w).sum() / w.sum())

    # dynamic: another loss on the same inputs, whose gradient is sum_k w_k dCE_k / sum w with w held constant
    dyn = _loss(drafter, setup, weighting="dynamic")
    assert not torch.allclose(dyn["loss"], decay["loss"])
    g_dyn = _grads(drafter, dyn["loss"])
    ce, valid = _ce_and_valid(drafter, setup)
    w = dynamic_position_weights(ce.detach(), valid).detach()[None, :] * valid.float()
    assert not torch.allclose(w[valid], position_weights(B, GAMMA)[None, :].expand_as(w)[valid])
    ref = (ce * w).sum() / w.sum()
    torch.testing.assert_close(dyn["loss"], ref)
    g_ref = _grads(drafter, ref)
    for a, b in zip(g_dyn, g_ref):
        torch.testing.assert_close(a, b)
    # ... which a gradient through the weights would not give
    ce, valid = _ce_and_valid(drafter, setup)
    p = torch.exp(-ce) * valid
    S = torch.cumprod(0.5 * p + 0.5 * valid, 1).flip(1).cumsum(1).flip(1)
    w_live = ((S * valid).sum(0) / valid.sum(0).clamp_min(1))[None, :] * valid
    g_live = _grads(drafter, (ce * w_live).sum() / w_live.sum())
    assert any(not torch.allclose(a, b) for a, b in zip(g_live, g_ref))
    # the acceptance metrics do not depend on the weights
    for k in ("acc", "cond_acc", "tau_est", "accept_len", "num_labels"):
        assert torch.equal(dyn[k], decay[k]), k


def test_dynamic_traces_as_one_graph_without_recompiles():
    """The dynamic weights live in the compiled graph (fullgraph: no graph break, no .item()) and new anchors and
    new loss values reuse it (error_on_recompile)."""
    setup = _tiny_setup()
    drafter, row, anchors, valid, feats, embed_w, head_w = setup

    def loss(anchors, valid):
        return dflash_loss(drafter, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B,
                           gamma=GAMMA, loss_chunk=7, weighting="dynamic")["loss"]

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False)
    g = _grads(drafter, compiled(anchors, valid))
    for a, b in zip(g, _grads(drafter, loss(anchors, valid))):
        torch.testing.assert_close(a, b)
    anchors2, valid2 = sample_anchors(row["loss_mask"], row["doc_ids"], 8, torch.Generator().manual_seed(9))
    with torch._dynamo.config.patch(error_on_recompile=True):
        g = _grads(drafter, compiled(anchors2, valid2))
    for a, b in zip(g, _grads(drafter, loss(anchors2, valid2))):
        torch.testing.assert_close(a, b)


def test_drafter_step_threads_the_option_to_training_and_validation():
    """DrafterStep (eager and compiled as on the GPU) trains and evaluates with train.position_weights."""
    setup = _tiny_setup()
    drafter, row, anchors, valid, feats, embed_w, head_w = setup
    batch = TrainBatch(**row, anchors=anchors, anchor_valid=valid)
    ref = _loss(drafter, setup, weighting="dynamic", dynamic_alpha=0.25)
    g_ref = _grads(drafter, ref["loss"])
    for compile_mode, backend in (("eager", None), ("default", "aot_eager")):
        cfg = TrainConfig(gamma=GAMMA, dtype="fp32", attention="sdpa", compile=compile_mode, loss_chunk=7,
                          position_weights="dynamic", dynamic_alpha=0.25)
        step = DrafterStep(drafter, embed_w, head_w, cfg, torch.device("cpu"), tag=f"pw_{compile_mode}",
                           backend=backend)
        drafter.zero_grad(set_to_none=False)
        out = step(batch, feats)
        torch.testing.assert_close(out["loss"], ref["loss"].detach())
        for p, g in zip(drafter.parameters(), g_ref):
            torch.testing.assert_close(p.grad, g)
        torch.testing.assert_close(step.evaluate(batch, feats)["loss"], ref["loss"].detach())


def test_dflash2_selector_gets_the_same_weights(monkeypatch):
    drafter, row, anchors, valid, feats, embed_w, head_w = _tiny_setup()
    torch.manual_seed(0)
    cfg = Drafter2Config(**drafter.config.to_dict(), conv_kernel_size=2, conv_group_size=8, selector_top_k=6,
                         selector_rank=8)
    d2 = DFlash2Drafter(cfg)
    seen = {}
    real_ce, real_sel = objective.blockwise_ce, objective.selector_objective

    def ce_spy(*a, **kw):
        out = real_ce(*a, **kw)
        seen["ce"] = out[0].detach()
        return out

    def sel_spy(*a):
        seen["w"] = a[-1]
        return real_sel(*a)

    monkeypatch.setattr(objective, "blockwise_ce", ce_spy)
    monkeypatch.setattr(objective, "selector_objective", sel_spy)
    out = dflash_loss(d2, embed_w, head_w, feats, **row, anchors=anchors, anchor_valid=valid, block_size=B,
                      gamma=GAMMA, loss_chunk=7, weighting="dynamic")
    lay = objective.block_layout(row["input_ids"], row["position_ids"], row["doc_ids"], row["loss_mask"], anchors,
                                 valid, B, cfg.mask_token_id)
    ce = seen["ce"].view(-1, B - 1)
    want = dynamic_position_weights(ce, lay.valid)[None, :] * lay.valid.float()
    torch.testing.assert_close(seen["w"], want)
    assert not seen["w"].requires_grad
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in d2.parameters() if p.grad is not None)


def test_config_accepts_the_two_values_and_rejects_others(tmp_path, capsys):
    assert TrainConfig().position_weights == "dynamic" and TrainConfig().dynamic_alpha == 0.5
    assert load_config("tiny_cpu", ["train.position_weights=decay"]).train.position_weights == "decay"
    with pytest.raises(ConfigError, match=r"^train\.position_weights must be one of decay, dynamic \(got 'dpace'\)"):
        load_config("tiny_cpu", ["train.position_weights=dpace"])
    with pytest.raises(ConfigError, match=r"train\.dynamic_alpha is 1\.5; it must be in \[0, 1\]"):
        load_config("tiny_cpu", ["train.dynamic_alpha=1.5"])
    code = cli_main(["train", "--single", "--config", "tiny_cpu", "train.position_weights=Dynamic",
                     f"run.out_dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.position_weights must be one of decay, dynamic" in err[0], err


def test_tiny_run_with_dynamic_weights(tiny_llama, tmp_path):
    """A few steps of the tiny CPU recipe through the real training path (data, target, step, optimizer, the
    validation at the end), with train.position_weights=dynamic."""
    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "train.position_weights=dynamic", "train.max_steps=3", "train.log_every=1",
                                   "train.eval_rows=1"])
    res = train_single_device(cfg)
    assert res.steps == 3 and len(res.history) == 3
    assert all(math.isfinite(h["loss"]) for h in res.history)
    assert res.val_history and math.isfinite(res.val_history[-1]["loss"])
