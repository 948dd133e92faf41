"""Validation during training (training/validation.py): exact metrics, no effect on training, the best drafter kept,
memorisation made visible."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import assert_same_weights
from dflash_train.config import load_config
from dflash_train.data.dataset import load_dataset
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.target import load_target, target_config_info
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.training.objective import acceptance_from_counts, dflash_loss, default_gamma
from dflash_train.training.step import DrafterStep
from dflash_train.training.trainer import train_single_device
from dflash_train.training.validation import (BEST_METRIC, PATIENCE, Validator, build_validation_rows,
                                              evaluate_rows, validation_batches)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(target, out, *extra):
    return load_config("tiny_cpu", [f"model.target={target}", f"run.out_dir={out}", "data.heldout_fraction=0.1",
                                    *extra])


def test_validation_metrics_equal_a_direct_computation(tiny_llama, tmp_path):
    cfg = tiny_cfg(tiny_llama, tmp_path, "train.eval_rows=3")
    data = load_dataset(cfg.data, None, seed=cfg.train.seed)
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama)).float()
    target = load_target(tiny_llama, drafter.config.target_layer_ids)
    rows = build_validation_rows(data.heldout, cfg, target, torch.device("cpu"))
    assert len(rows.batches) == 3
    step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, cfg.train, torch.device("cpu"))
    got = evaluate_rows(step, rows)

    # Direct: the objective itself on each row, counts summed, loss averaged over rows.
    losses, counts = [], []
    with torch.no_grad():
        for b, f in zip(rows.batches, rows.feats):
            out = dflash_loss(drafter, target.embed_tokens.weight, target.lm_head.weight, f, b.input_ids,
                              b.position_ids, b.doc_ids, b.loss_mask, b.anchors, b.anchor_valid,
                              block_size=drafter.config.block_size, gamma=default_gamma(drafter.config.block_size))
            losses.append(out["loss"])
            counts.append(out["counts"])
    want = acceptance_from_counts(torch.stack(counts).sum(0))
    torch.testing.assert_close(got["loss"], torch.stack(losses).mean())
    torch.testing.assert_close(got["tau_est"], want["tau_est"])
    torch.testing.assert_close(got["acc"], want["acc"])
    # The blocks are fixed: the same rows and anchors every time they are built.
    again = validation_batches(data.heldout, cfg.train.token_budget, cfg.train.num_anchors, cfg.train.seed, 3)
    assert all(torch.equal(a.anchors, b.anchors) for a, b in zip(again, rows.batches))


@pytest.mark.parametrize("trainer", ["single", "pipeline"])
def test_validation_leaves_the_training_trajectory_untouched(trainer, tiny_llama, tmp_path):
    run = train_single_device if trainer == "single" else train_pipeline
    common = ["train.max_steps=12", "train.log_every=2"]
    with_val = run(tiny_cfg(tiny_llama, tmp_path / "val", *common, "train.eval_every=3"))
    without = run(tiny_cfg(tiny_llama, tmp_path / "noval", *common, "train.eval_every=0"))
    assert len(with_val.val_history) == 4 and without.val_history == []
    assert [h["loss"] for h in with_val.history] == [h["loss"] for h in without.history]
    final = with_val.last_dir if with_val.best else with_val.drafter_dir
    assert_same_weights(final, without.drafter_dir)
    records = [json.loads(x) for x in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") == "val"] == [3, 6, 9, 12]


class _ScriptedStep:
    """A step whose validation metrics follow a script: tau estimate values in order (one per validation)."""

    def __init__(self, taus, rows_per_validation: int):
        self.taus, self.n, self.calls = list(taus), rows_per_validation, 0

    def evaluate(self, batch, feats):
        tau = self.taus[self.calls // self.n]
        self.calls += 1
        # cond_acc = (tau - 1) at position 1 only -> tau_est = 1 + (tau - 1) for tau in [1, 2]
        p = tau - 1.0
        counts = torch.tensor([[p, 0.0], [1.0, 1.0], [p, 0.0], [1.0, 1.0]])
        return {"loss": torch.tensor(2.0 - p), "num_labels": torch.tensor(2), "counts": counts}


class _Logger:
    def __init__(self):
        self.val_history = []

    def log_val(self, step, metrics, extra):
        rec = {"step": step, "tau_est": float(metrics["tau_est"]), **extra}
        self.val_history.append(rec)
        return rec


def _rows(tiny_llama, tmp_path):
    cfg = tiny_cfg(tiny_llama, tmp_path, "train.eval_rows=2")
    data = load_dataset(cfg.data, None, seed=0)
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama)).float()
    target = load_target(tiny_llama, drafter.config.target_layer_ids)
    return build_validation_rows(data.heldout, cfg, target, torch.device("cpu")), drafter


def test_best_drafter_is_the_peak_step_and_survives_resume(tiny_llama, tmp_path):
    rows, drafter = _rows(tiny_llama, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    step_fn = _ScriptedStep([1.2, 1.7, 1.5], len(rows.batches))
    v = Validator(rows, out, eval_every=10, total_steps=30, logger=_Logger())
    weights = {}
    for step in (10, 20, 30):
        with torch.no_grad():
            drafter.norm.weight.fill_(step)  # weights that say which step they are
        weights[step] = drafter.norm.weight.clone()
        v(step, step_fn, drafter)
    assert v.best == {"metric": BEST_METRIC, "step": 20, "value": pytest.approx(1.7)}
    # A resumed run (a new Validator over the same directory) keeps the best so far; a worse step does not replace it.
    resumed = Validator(rows, out, eval_every=10, total_steps=40, logger=_Logger())
    assert resumed.best["step"] == 20
    with torch.no_grad():
        drafter.norm.weight.fill_(40)
    resumed(40, _ScriptedStep([1.6], len(rows.batches)), drafter)
    from dflash_train.models.checkpoint import save_drafter
    final, best = resumed.finish(save_drafter(drafter, out / "drafter"))
    assert best["step"] == 20
    torch.testing.assert_close(load_drafter(final).norm.weight, weights[20])
    torch.testing.assert_close(load_drafter(out / "drafter_last").norm.weight, drafter.norm.weight)
    assert "at step 20 of 40" in resumed.summary(40)


def test_stalled_validation_while_training_rises_warns_once(tiny_llama, tmp_path, caplog):
    rows, drafter = _rows(tiny_llama, tmp_path)
    taus = [1.5, 1.4, 1.3, 1.3, 1.2, 1.2]
    v = Validator(rows, tmp_path, eval_every=1, total_steps=len(taus), logger=_Logger())
    step_fn = _ScriptedStep(taus, len(rows.batches))
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        for step in range(1, len(taus) + 1):
            v(step, step_fn, drafter, train_tau=1.0 + step)   # training's estimate keeps rising
    warnings = [r.message for r in caplog.records if "memorising" in r.message]
    assert len(warnings) == 1 and "best 1.50 at step 1" in warnings[0]
    assert PATIENCE < len(taus)


def test_no_warning_while_validation_improves(tiny_llama, tmp_path, caplog):
    rows, drafter = _rows(tiny_llama, tmp_path)
    taus = [1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    v = Validator(rows, tmp_path, eval_every=1, total_steps=len(taus), logger=_Logger())
    step_fn = _ScriptedStep(taus, len(rows.batches))
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        for step in range(1, len(taus) + 1):
            v(step, step_fn, drafter, train_tau=1.0 + step)
    assert not [r for r in caplog.records if "memorising" in r.message]


@pytest.mark.parametrize("samples, warns", [(4, True), (256, False)])
def test_many_epochs_over_little_data_warn_at_start(samples, warns, tiny_llama, tmp_path, caplog):
    cfg = tiny_cfg(tiny_llama, tmp_path / "run", f"data.synthetic_samples={samples}", "train.max_steps=30",
                   "data.heldout_fraction=0.0", "train.eval_every=0")
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        train_single_device(cfg)
    lines = [r.message for r in caplog.records if "epochs" in r.message and "unique tokens" in r.message]
    assert lines, "the start-up line on data volume is missing"
    assert any("memorises" in m for m in lines) == warns, lines


def test_validation_off_without_heldout_data_says_so(tiny_llama, tmp_path, caplog):
    cfg = tiny_cfg(tiny_llama, tmp_path / "run", "data.heldout_fraction=0.0", "train.max_steps=4")
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        res = train_single_device(cfg)
    assert res.val_history == [] and res.best is None
    assert any("no held-out conversations" in r.message for r in caplog.records)
