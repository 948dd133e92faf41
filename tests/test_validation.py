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
from dflash_train.devices import resolve_config
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.target import load_target, target_config_info
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.training.objective import acceptance_from_counts, dflash_loss, default_gamma
from dflash_train.training.step import DrafterStep
from dflash_train.training.trainer import train_single_device
from dflash_train.training.validation import (BEST_METRIC, PATIENCE, Validator, build_validation_rows,
                                              decoding_tau, decoding_walks, evaluate_rows, validation_rows)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(target, out, *extra):
    return load_config("tiny_cpu", [f"model.target={target}", f"run.out_dir={out}", "data.heldout_fraction=0.1",
                                    *extra])


def _walk(mask: list[bool], docs: list[int], accept: dict[int, int]) -> list[float]:
    """Decoding's walk, written out plainly: per reply, from its first token, jump by what each block accepts; a
    block that drafts the reply's last token right counts its drafts + 1, as the evaluator's step does (no label
    past the reply: the draft after it counts as rejected)."""
    out = []
    for start in range(len(mask)):
        if mask[start] and (start == 0 or not mask[start - 1] or docs[start - 1] != docs[start]):
            last = start
            while last + 1 < len(mask) and mask[last + 1] and docs[last + 1] == docs[start]:
                last += 1
            steps, a = [], start
            while a < last and accept.get(a, 0) > 0:
                steps.append(min(accept[a], last + 1 - a))
                a += steps[-1]
            if steps:
                out.append(sum(steps) / len(steps))
    return out


def test_decoding_walk_jumps_by_what_each_block_accepts():
    # doc 0: prompt 3 tokens, reply 6 (positions 3..8); doc 1: prompt 2, reply 4 (11..14); padding after
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    docs = torch.tensor([0] * 9 + [1] * 6 + [-1])
    accept = torch.zeros(16, dtype=torch.long)
    accept[3], accept[5], accept[4] = 2, 3, 9   # 3 -> 5 -> 8 (the reply's last token: no block starts there)
    accept[11], accept[12] = 1, 2               # 11 -> 12 -> 14
    assert decoding_tau(mask, docs, accept) == [2.5, 1.5]
    # A block that drafts the reply's last token right counts its drafts + 1, as decoding's step records it (the
    # evaluator's acceptance length; the stop token only cuts what is emitted): tests below pin it against
    # speculative_generate.
    accept[5] = 4                               # 5: drafts 6, 7, 8 (the reply's last token) right, + 1
    accept[12] = 3                              # 12: drafts 13, 14 right, + 1
    assert decoding_tau(mask, docs, accept) == [3.0, 2.0]
    walk = decoding_walks(mask, docs, accept)[0]
    assert (walk.doc, walk.start, walk.end, walk.steps) == (0, 3, 9, [2, 4])


def test_validation_metrics_equal_a_direct_computation(tiny_llama, tmp_path):
    cfg = tiny_cfg(tiny_llama, tmp_path, "train.eval_rows=3", "train.position_weights=decay")  # the reference's
    data = load_dataset(cfg.data, None, seed=cfg.train.seed)
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama)).float()
    target = load_target(tiny_llama, drafter.config.target_layer_ids)
    rows = build_validation_rows(data.heldout, cfg, target, torch.device("cpu"))
    assert len(rows.rows) == 3 and len(rows.batches) > 3  # every anchor: more than one batch per row here
    step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, resolve_config(cfg).train,
                       torch.device("cpu"))
    got = evaluate_rows(step, rows)

    # Direct: the objective on each row with ALL its valid anchors at once; counts summed, loss averaged over the
    # batches; acceptance lengths per anchor from the predictions, walked plainly.
    B = drafter.config.block_size
    losses, counts, taus = [], [], []
    with torch.no_grad():
        for b, r in zip(rows.batches, rows.row_of):
            out = dflash_loss(drafter, target.embed_tokens.weight, target.lm_head.weight, rows.feats[r], b.input_ids,
                              b.position_ids, b.doc_ids, b.loss_mask, b.anchors, b.anchor_valid, block_size=B,
                              gamma=default_gamma(B))
            losses.append(out["loss"])
            counts.append(out["counts"])
        for r, row in enumerate(rows.rows):
            anchors = torch.cat([b.anchors[b.anchor_valid] for b, i in zip(rows.batches, rows.row_of) if i == r])
            out = dflash_loss(drafter, target.embed_tokens.weight, target.lm_head.weight, rows.feats[r],
                              row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, anchors,
                              torch.ones_like(anchors, dtype=torch.bool), block_size=B, gamma=default_gamma(B))
            accept = dict(zip(anchors.tolist(), out["accept_len"].long().tolist()))
            taus += _walk(row.loss_mask.tolist(), row.doc_ids.tolist(), accept)
    want = acceptance_from_counts(torch.stack(counts).sum(0))
    torch.testing.assert_close(got["loss"], torch.stack(losses).mean())
    torch.testing.assert_close(got["tau_est"], want["tau_est"])
    torch.testing.assert_close(got["acc"], want["acc"])
    assert got["tau_decoding"] == pytest.approx(sum(taus) / len(taus))
    # The blocks are fixed: the same rows and anchors every time they are built.
    _, again, _, _, _ = validation_rows(data.heldout, cfg.train.token_budget, cfg.train.num_anchors, 3)
    assert all(torch.equal(a.anchors, b.anchors.cpu()) for a, b in zip(again, rows.batches))


@pytest.mark.parametrize("trainer,graph", [("single", "own"), ("single", "training"), ("pipeline", "own"),
                                           ("pipeline", "training")])
def test_validation_leaves_the_training_trajectory_untouched(trainer, graph, tiny_llama, tmp_path):
    """Also through the training step's own graph (train.validation_graph=training: its forward, no backward)."""
    run = train_single_device if trainer == "single" else train_pipeline
    common = ["train.max_steps=12", "train.log_every=2"]
    with_val = run(tiny_cfg(tiny_llama, tmp_path / "val", *common, "train.eval_every=3",
                            f"train.validation_graph={graph}"))
    without = run(tiny_cfg(tiny_llama, tmp_path / "noval", *common, "train.eval_every=0"))
    assert len(with_val.val_history) == 4 and without.val_history == []
    assert [h["loss"] for h in with_val.history] == [h["loss"] for h in without.history]
    final = with_val.last_dir if with_val.best else with_val.drafter_dir
    assert_same_weights(final, without.drafter_dir)
    records = [json.loads(x) for x in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") == "val"] == [3, 6, 9, 12]


class _ScriptedStep:
    """A step whose validations follow a script: every block of validation v accepts taus[v] tokens (an integer),
    so decoding's walk over any reply long enough averages exactly taus[v]."""

    device = torch.device("cpu")

    def __init__(self, taus, batches_per_validation: int):
        self.taus, self.n, self.calls = list(taus), batches_per_validation, 0

    def evaluate(self, batch, feats):
        tau = self.taus[self.calls // self.n]
        self.calls += 1
        counts = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
        return {"loss": torch.tensor(1.0 / tau), "num_labels": torch.tensor(2), "counts": counts,
                "accept_len": torch.full_like(batch.anchors, tau)}


class _Logger:
    def __init__(self):
        self.val_history = []

    def log_val(self, step, metrics, extra):
        rec = {"step": step, "loss": float(metrics["loss"]), "tau_est": float(metrics["tau_est"]), **extra}
        self.val_history.append(rec)
        return rec

    def exclude(self, seconds):  # MetricsLogger leaves the validation's time out of the training's window
        assert seconds >= 0


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
    step_fn = _ScriptedStep([2, 4, 3], len(rows.batches))
    v = Validator(rows, out, eval_every=10, total_steps=30, logger=_Logger())
    weights = {}
    for step in (10, 20, 30):
        with torch.no_grad():
            drafter.norm.weight.fill_(step)  # weights that say which step they are
        weights[step] = drafter.norm.weight.clone()
        v(step, step_fn, drafter)
    assert v.best["metric"] == BEST_METRIC and v.best["step"] == 20 and v.best["value"] > 3.0
    # A resumed run (a new Validator over the same directory) keeps the best so far; a worse step does not replace it.
    resumed = Validator(rows, out, eval_every=10, total_steps=40, logger=_Logger())
    assert resumed.best["step"] == 20
    with torch.no_grad():
        drafter.norm.weight.fill_(40)
    resumed(40, _ScriptedStep([3], len(rows.batches)), drafter)
    from dflash_train.models.checkpoint import save_drafter
    final, best = resumed.finish(save_drafter(drafter, out / "drafter"))
    assert best["step"] == 20
    torch.testing.assert_close(load_drafter(final).norm.weight.float(), weights[20])  # exact in bf16 too
    torch.testing.assert_close(load_drafter(out / "drafter_last").norm.weight.float(), drafter.norm.weight)
    assert "at step 20 of 40" in resumed.summary(40)


def test_stalled_validation_while_training_rises_warns_once(tiny_llama, tmp_path, caplog):
    rows, drafter = _rows(tiny_llama, tmp_path)
    taus = [5, 4, 3, 3, 2, 2]
    v = Validator(rows, tmp_path, eval_every=1, total_steps=len(taus), logger=_Logger())
    step_fn = _ScriptedStep(taus, len(rows.batches))
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        for step in range(1, len(taus) + 1):
            v(step, step_fn, drafter, train_tau=1.0 + step)   # training's estimate keeps rising
    warnings = [r.message for r in caplog.records if "memorising" in r.message]
    assert len(warnings) == 1 and "at step 1)" in warnings[0]
    assert PATIENCE < len(taus)


@pytest.mark.parametrize("taus", [[1, 2, 3, 4, 5, 6], [1, 2, 3, 3, 3, 3, 3]], ids=["improving", "annealed"])
def test_no_warning_while_validation_improves_or_holds_level(taus, tiny_llama, tmp_path, caplog):
    """A stall with a level held-out loss (the LR annealed to zero) is not memorisation, however training's noisy
    estimate moves."""
    rows, drafter = _rows(tiny_llama, tmp_path)
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
    assert any("may memorise" in m for m in lines) == warns, lines


def test_validation_off_without_heldout_data_says_so(tiny_llama, tmp_path, caplog):
    cfg = tiny_cfg(tiny_llama, tmp_path / "run", "data.heldout_fraction=0.0", "train.max_steps=4")
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        res = train_single_device(cfg)
    assert res.val_history == [] and res.best is None
    assert any("no held-out conversations" in r.message for r in caplog.records)


def test_decoding_walk_predicts_the_measured_tau_on_the_targets_own_answers(tiny_llama):
    """On held-out replies that are the target's own greedy output (what data.regenerate trains and validates on),
    validation's decoding walk is what speculative decoding of their prompts measures: within a few percent (a
    reply's last block may accept past the reply's end in decoding, never in the walk), where the every-position
    estimate reads ~10-25% high (it also averages over the easy positions decoding skips)."""
    from dflash_train.data.packing import BatchSchedule, Sample
    from dflash_train.inference.baseline import target_generate
    from dflash_train.inference.benchmark import evaluate
    from dflash_train.inference.target_runner import TargetRunner
    from dflash_train.models.build import init_output_norm

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", "train.token_budget=256", "train.num_anchors=64",
                                   "train.eval_rows=64"])
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama)).float()
    target = load_target(tiny_llama, drafter.config.target_layer_ids, truncate=False)
    init_output_norm(drafter, target.lm_head.weight)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 120, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    new_tokens = 40
    runner = TargetRunner.for_target(target, 64, step_lens=(1,))
    answers = [target_generate(runner, p, new_tokens).tokens for p in prompts]
    samples = [Sample(p + a, [False] * len(p) + [True] * len(a)) for p, a in zip(prompts, answers)]
    # Train the drafter on those very answers (memorising is fine here: the test is about the estimate).
    step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, resolve_config(cfg).train,
                       torch.device("cpu"))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for b in BatchSchedule(samples, 256, 64, 0, 200):
        step(b, target.features(b.input_ids, b.position_ids, b.doc_ids))
        opt.step()
        opt.zero_grad(set_to_none=False)

    est = evaluate_rows(step, build_validation_rows(samples, cfg, target, torch.device("cpu")))
    measured = evaluate(target, drafter, prompts, new_tokens, stop_ids=()).mean_tau
    walk_err, every_err = est["tau_decoding"] / measured - 1, float(est["tau_est"]) / measured - 1
    assert measured > 2.0, measured  # a drafter that accepts something, or the comparison says little
    assert abs(walk_err) < 0.05, (est["tau_decoding"], measured)
    assert every_err > 0.05 and abs(walk_err) < abs(every_err), (float(est["tau_est"]), measured)


@pytest.mark.parametrize("rate, want", [(0.5, 30), (1000.0, None)])
def test_schedule_ends_with_the_time_budget_at_most_epochs(rate, want, tiny_llama, tmp_path):
    """train.budget_steps_per_s + max_minutes size the schedule to the time; `epochs` caps it (recipes that follow
    the data: a few passes at most, fewer when the time is short)."""
    from dflash_train.training.run import build_run

    cfg = tiny_cfg(tiny_llama, tmp_path / "run", "train.max_steps=null", "train.epochs=3", "train.max_minutes=1",
                   f"train.budget_steps_per_s={rate}")
    setup = build_run(cfg)
    by_epochs = 3 * setup.schedule.rows_per_epoch
    assert setup.total_steps == (want or by_epochs) and (want is None or want < by_epochs)
    assert setup.data_summary["epochs"] == pytest.approx(setup.total_steps / setup.schedule.rows_per_epoch)


def test_a_best_step_with_a_checkpoint_survives_rotation(tiny_llama, tmp_path):
    """When the best validation step has a checkpoint, that checkpoint is named `best`: rotation keeps it."""
    from dflash_train.training.checkpointing import CheckpointManager

    out = tmp_path / "run"
    res = train_pipeline(tiny_cfg(tiny_llama, out, "train.max_steps=12", "train.eval_every=2",
                                  "train.checkpoint_every=2", "train.keep_checkpoints=1", "train.lr=1e-2"))
    ckpt = CheckpointManager(out)
    best = ckpt.best()
    assert best is not None and best["step"] == res.best["step"] and best["metric"] == res.best["metric"]
    kept = {d.name for d in ckpt.step_dirs()}
    assert best["name"] in kept and "step_00000012" in kept



def test_decoding_tau_by_source_groups_the_same_walks(tiny_llama, tmp_path):
    """Each held-out document keeps its source through packing; the per-source taus regroup the overall walk."""
    cfg = tiny_cfg(tiny_llama, tmp_path, "train.eval_rows=3")
    data = load_dataset(cfg.data, None, seed=cfg.train.seed)
    sources = [f"first{s.input_ids[0] % 3}" for s in data.heldout]  # a label each document's own tokens tell
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config_info(tiny_llama)).float()
    target = load_target(tiny_llama, drafter.config.target_layer_ids)
    keys = [f"conv{i}" for i in range(len(data.heldout))]
    rows = build_validation_rows(data.heldout, cfg, target, torch.device("cpu"), sources=sources, keys=keys)
    for row, labels, names in zip(rows.rows, rows.doc_sources, rows.doc_keys):  # document d's label: its own
        for d, (label, name) in enumerate(zip(labels, names)):
            ids = row.input_ids[row.doc_ids == d].tolist()
            assert label == f"first{ids[0] % 3}"
            assert ids == data.heldout[int(name.removeprefix("conv"))].input_ids  # the key names this document
    step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, resolve_config(cfg).train,
                       torch.device("cpu"))
    got = evaluate_rows(step, rows)
    accept = [torch.zeros(r.input_ids.shape[0], dtype=torch.long) for r in rows.rows]
    with torch.no_grad():
        for b, r in zip(rows.batches, rows.row_of):
            accept[r][b.anchors[b.anchor_valid]] = step.evaluate(b, rows.feats[r])["accept_len"][b.anchor_valid].long()
    groups: dict[str, list[float]] = {}
    for r, row in enumerate(rows.rows):
        for w in decoding_walks(row.loss_mask, row.doc_ids, accept[r]):
            groups.setdefault(rows.doc_sources[r][w.doc], []).append(w.tau)
    assert len(groups) > 1
    assert got["tau_decoding_by_source"] == pytest.approx({k: sum(v) / len(v) for k, v in groups.items()})
    every = [t for v in groups.values() for t in v]
    assert got["tau_decoding"] == pytest.approx(sum(every) / len(every))
    # Per reply, keyed (what the best step writes to REPLIES_FILE): the same walks, each with its own key and source
    replies = got["replies"]
    assert sorted(r["tau"] for r in replies) == pytest.approx(sorted(every))
    assert len({r["key"] for r in replies}) == len(replies)
    assert all(r["source"] == sources[int(r["key"].removeprefix("conv"))] for r in replies)


def test_the_best_steps_replies_are_kept_by_key_and_pair_with_a_measurement(tiny_llama, tmp_path, capsys):
    """REPLIES_FILE holds decoding's walk per held-out reply at the best step (not a later, worse one), keyed by
    conversation, and benchmarks/compare_evals.py pairs it with an evaluation report on those conversations."""
    import dataclasses
    import sys as _sys
    from pathlib import Path

    from dflash_train.training.validation import REPLIES_FILE

    rows, drafter = _rows(tiny_llama, tmp_path)
    keys = [[f"c{r}_{d}" for d in range(int(row.doc_ids.max()) + 1)] for r, row in enumerate(rows.rows)]
    rows = dataclasses.replace(rows, doc_keys=keys)
    out = tmp_path / "run"
    out.mkdir()
    v = Validator(rows, out, eval_every=10, total_steps=30, logger=_Logger())
    for step, tau in zip((10, 20, 30), (2, 4, 3)):
        v(step, _ScriptedStep([tau], len(rows.batches)), drafter)
    kept = json.loads((out / REPLIES_FILE).read_text())
    assert kept["step"] == 20 == v.best["step"]
    assert {r["key"] for r in kept["replies"]} <= {k for row in keys for k in row} and kept["replies"]
    for r in kept["replies"]:  # every block accepted 4 at step 20, the last one up to the reply's last token
        assert set(r["steps"][:-1]) <= {4} and 1 <= r["steps"][-1] <= 4 and r["tau"] == pytest.approx(
            sum(r["steps"]) / len(r["steps"]))
        row, doc = next((row, names.index(r["key"])) for row, names in zip(rows.rows, keys) if r["key"] in names)
        assert r["tokens"] == row.input_ids[(row.doc_ids == doc) & row.loss_mask].tolist()  # the reply walked
        # from the first token (the anchor) to the last, + 1 when the last block drafted the last token right
        assert len(r["tokens"]) - 1 <= sum(r["steps"]) <= len(r["tokens"])
    # a measurement of some of those conversations, 0.5 lower on each: paired, the difference is exactly -0.5
    measured = [{"id": r["key"], "tau": r["tau"] - 0.5} for r in kept["replies"][:3]]
    twice = kept["replies"][3]["key"]  # an id two prompts share (parts of one chat): which pairs is unknown
    others = [{"id": "elsewhere", "tau": 9.0}, {"id": twice, "tau": 1.0}, {"id": twice, "tau": 7.0}]
    (tmp_path / "eval.json").write_text(json.dumps({"prompts": measured + others}))
    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import compare_evals
    finally:
        _sys.path.pop(0)
    compare_evals.main([str(out / REPLIES_FILE), str(tmp_path / "eval.json")])
    printed = capsys.readouterr().out
    assert "paired difference over 3 prompts -0.500" in printed and f"left out: {twice}" in printed
    assert "texts:" not in printed  # a report without plain decoding's text: nothing to say about the texts
    # With plain decoding's text (`baseline`): where the regenerated reply and the decoded text first differ
    first, second = kept["replies"][0], kept["replies"][1]
    parted = second["tokens"][:2] + [second["tokens"][2] + 1] + second["tokens"][3:]
    baselines = [{"id": first["key"], "tau": 1.0, "baseline": first["tokens"][:-1]},   # the reply cut short: agrees
                 {"id": second["key"], "tau": 1.0, "baseline": parted}]
    (tmp_path / "eval.json").write_text(json.dumps({"prompts": baselines}))
    compare_evals.main([str(out / REPLIES_FILE), str(tmp_path / "eval.json")])
    assert ("texts: 1 of 2 regenerated replies agree with plain decoding to the shorter's end; the others part at "
            "token 2") in capsys.readouterr().out


class _ScriptedTarget:
    """A target whose greedy text is `seq` (prompt, reply, then whatever it would say after the reply's end): the
    next token after position i is seq[i + 1], one-hot logits, features of width 1. What speculative_generate needs
    of a TargetRunner."""

    device = torch.device("cpu")

    def __init__(self, seq: list[int], vocab: int):
        self.seq, self.vocab = seq, vocab

    def _logits(self, positions):
        return torch.nn.functional.one_hot(torch.tensor([self.seq[p + 1] for p in positions]), self.vocab).float()

    def prefill(self, ids):
        P = ids.shape[1]
        return self._logits([P - 1])[None], torch.zeros(1, P, 1)

    def step(self, tokens, start):
        B = tokens.shape[1]
        return self._logits(range(start, start + B))[None], torch.zeros(1, B, 1)


class _ScriptedDrafter:
    """A drafter whose block from anchor a drafts seq right at positions 1..accept[a]-1 and wrong after them (so
    decoding accepts exactly what validation's accept_len says, and nothing past a reply's end)."""

    def __init__(self, seq: list[int], accept: list[int], block_size: int, vocab: int, wrong: int):
        self.seq, self.accept, self.block_size, self.vocab, self.wrong = seq, accept, block_size, vocab, wrong

    def begin(self, feats):
        pass

    def extend(self, feats, start):
        pass

    def draft(self, last, start):
        drafts = [self.seq[start + k] if k < self.accept[start] else self.wrong for k in range(1, self.block_size)]
        return torch.nn.functional.one_hot(torch.tensor(drafts), self.vocab).float()


@pytest.mark.parametrize("accept_at", [{3: 4, 7: 4}, {3: 3, 6: 3, 9: 2}, {3: 4, 7: 3}],
                         ids=["whole-block-to-eos", "eos-then-past", "eos-as-bonus"])
def test_decoding_walk_counts_each_block_as_the_evaluator_does(accept_at):
    """Validation's walk over a reply that is the target's own greedy answer (ending at its end-of-turn token)
    records, block for block, the acceptance lengths speculative decoding records on its prompt (the evaluator's
    tau: accepted drafts + 1 per verification step, the last step included, whatever the stop token cuts)."""
    from dflash_train.inference.speculative import speculative_generate

    B, V, EOS, WRONG = 4, 16, 15, 14
    prompt, reply = [1, 2, 3], [4, 5, 6, 7, 8, 9, 10, EOS]     # reply at positions 3..10
    seq = prompt + reply + [11] * (2 * B)                      # 11: what the target would say after EOS
    T = len(prompt) + len(reply)
    accept = [0] * len(seq)
    for a, n in accept_at.items():
        accept[a] = n
    gen = speculative_generate(_ScriptedTarget(seq, V), _ScriptedDrafter(seq, accept, B, V, WRONG), prompt,
                               max_new_tokens=64, stop_ids=[EOS])
    assert gen.tokens == reply  # lossless: the target's own answer
    mask = torch.tensor([False] * len(prompt) + [True] * len(reply))
    (walk,) = decoding_walks(mask, torch.zeros(T, dtype=torch.long), torch.tensor(accept[:T]))
    assert walk.steps == gen.accept_lengths
    assert walk.tau == pytest.approx(gen.tau)


def test_a_measured_prompt_with_no_verification_step_is_left_out_of_the_pairing():
    """A prompt whose first generated token is a stop token has no verification step and tau null in the eval
    report; the demo's pairing with validation's walk leaves it out instead of failing on None - float."""
    from dflash_train.training.validation import paired_with_measured

    replies = [{"key": "a", "tau": 3.0}, {"key": "b", "tau": 2.0}, {"key": "c", "tau": 4.0}]
    prompts = [{"id": "a", "tau": 3.5}, {"id": "b", "tau": None}, {"id": "c", "tau": 4.5}]
    paired = paired_with_measured(replies, prompts)
    assert paired["pairs"] == 2 and paired["difference"] == pytest.approx(0.5)
    assert paired_with_measured(replies[1:2], prompts[1:2]) is None
