"""Validation during training: the drafter scored on held-out rows it never trains on, and the best drafter kept.

  held-out conversations -> packed exactly like training rows (train.token_budget) -> anchors sampled ONCE (seeded)
    -> target features computed once at start-up, kept on the validating device
    -> every train.eval_every steps and at the end: DrafterStep.evaluate on each row (forward only, fixed shapes)
    -> a `val` log line, metrics.jsonl / TensorBoard records, and the best drafter so far in <out_dir>/drafter_best

Why: the training log's acc@k and tau estimate are measured on the rows being trained on; after a few epochs they
report memorisation. The same estimate on fixed held-out blocks is what a drafter is worth on prompts it never saw,
and fixed blocks make two validations comparable (the only thing that changes between them is the weights).

Cost: eval_rows forward passes (no backward, no optimizer) every eval_every steps: about
eval_rows / (3 * eval_every) of the training compute, plus the memory of eval_rows rows of features.
Validation touches no weight, no .grad buffer, no optimizer state and draws no random number: a run's trajectory is
the same with and without it (tests/test_validation.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.packing import Sample, TrainBatch, make_batch, pack_samples
from ..models.checkpoint import save_drafter
from .metrics import StepWindow

log = logging.getLogger("dflash_train")

BEST_METRIC = "val_tau_est"  # the metric that picks drafter/: the expected acceptance length on held-out blocks
BEST_DIR, LAST_DIR, BEST_FILE = "drafter_best", "drafter_last", "best.json"
# Validation anchors use batch indices far past any training batch, so their seeded anchors never coincide.
VAL_INDEX_BASE = 1 << 40
PATIENCE = 3            # validations without a new best (while training's estimate rises) before the warning
EPOCHS_WARN = 4.0       # more passes than this over the data: the start-up line warns of memorisation


@dataclass
class ValidationRows:
    batches: list[TrainBatch]       # on the validating device
    feats: list[torch.Tensor]       # [T, k*H] each, the target's features of each row, same device
    documents: int                  # held-out conversations the rows hold
    tokens: int                     # real (non-padding) tokens in the rows


def validation_batches(heldout: list[Sample], token_budget: int, num_anchors: int, seed: int,
                       max_rows: int, pad_id: int = 0) -> list[TrainBatch]:
    """Up to max_rows rows of held-out samples, packed in order like training rows, anchors fixed by (seed, row).
    Rows without any valid anchor (nothing supervised) are skipped."""
    batches = []
    for i, row in enumerate(pack_samples(heldout, token_budget, pad_id)):
        b = make_batch(row, num_anchors, seed, VAL_INDEX_BASE + i)
        if bool(b.anchor_valid.any()):
            batches.append(b)
        if len(batches) >= max_rows:
            break
    return batches


@torch.no_grad()
def build_validation_rows(heldout: list[Sample], cfg, target, device: torch.device, pad_id: int = 0,
                          features=None) -> ValidationRows | None:
    """The run's fixed validation rows with their target features, on `device`; None (and a log line saying why)
    when validation is off or there is nothing held out. `features(ids, pos, doc) -> [T, k*H]` defaults to
    target.features on the target's device."""
    t = cfg.train
    if t.eval_every <= 0 or t.eval_rows <= 0:
        log.info("validation: off (train.eval_every or train.eval_rows is 0)")
        return None
    batches = validation_batches(heldout, t.token_budget, t.num_anchors, t.seed, t.eval_rows, pad_id)
    if not batches:
        log.warning("validation: off, the run has no held-out conversations (raise data.heldout_fraction to "
                    "see how the drafter does on data it never trains on)")
        return None
    features = features or target.features
    on_target = [b.to(target.device) for b in batches]
    feats = [features(b.input_ids, b.position_ids, b.doc_ids).to(device) for b in on_target]
    docs = sum(int(b.doc_ids.max()) + 1 for b in batches)
    tokens = sum(int((b.doc_ids >= 0).sum()) for b in batches)
    log.info(f"validation: {len(batches)} held-out rows ({docs} conversations, {tokens:,} tokens, "
             f"{sum(int(b.anchor_valid.sum()) for b in batches):,} fixed blocks) every {t.eval_every} steps and at "
             f"the end; forward only, ~{len(batches) / (3 * t.eval_every):.1%} of the training compute")
    return ValidationRows([b.to(device) for b in batches], feats, docs, tokens)


def evaluate_rows(step_fn, rows: ValidationRows) -> dict[str, torch.Tensor]:
    """The drafter's loss, acc@k and tau estimate over every validation row (summed counts: one estimate over all
    the fixed blocks), as device tensors."""
    window = StepWindow()
    for batch, feats in zip(rows.batches, rows.feats):
        window.add(step_fn.evaluate(batch, feats))
    return window.take()


class Validator:
    """Runs validation at its steps, logs it, keeps the best drafter and warns when the drafter starts memorising.

    The best drafter (by val tau estimate, higher is better; ties keep the earlier step) is written to
    <out_dir>/drafter_best whenever a validation improves on it, with best.json beside it; a resumed run reads
    best.json back so the best-so-far survives resume. `finish` then makes drafter/ the best and drafter_last/ the
    final weights."""

    def __init__(self, rows: ValidationRows | None, out_dir: Path, eval_every: int, total_steps: int, logger):
        self.rows, self.out_dir, self.eval_every, self.total_steps = rows, Path(out_dir), eval_every, total_steps
        self.logger = logger
        self.seconds = 0.0
        self.history: list[dict] = []
        self.best = self._read_best()
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.rows is not None

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.eval_every == 0 or step == self.total_steps)

    def warm_up(self, step_fn) -> None:
        """Compile (and capture) the forward-only step before training starts, so validation never compiles
        mid-run (the pipeline's recompile guard would stop the run)."""
        if self.enabled:
            for _ in range(2):
                step_fn.evaluate(self.rows.batches[0], self.rows.feats[0])

    def __call__(self, step: int, step_fn, drafter, train_tau: float | None = None) -> dict | None:
        """Validate at `step` (weights after `step` updates); returns the val record. Host-syncs (log steps only)."""
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        metrics = evaluate_rows(step_fn, self.rows)
        tau = float(metrics["tau_est"])
        improved = self.best is None or tau > self.best["value"]
        if improved:
            self._save_best(step, tau, drafter)
        self.seconds += time.perf_counter() - t0
        rec = self.logger.log_val(step, metrics, {"best_step": self.best["step"], "best_tau_est": self.best["value"],
                                                  "val_seconds": time.perf_counter() - t0})
        rec["train_tau_est"] = train_tau
        self.history.append(rec)
        self._check_memorising()
        return rec

    # ------------------------------------------------------------------ the best drafter
    def _read_best(self) -> dict | None:
        p = self.out_dir / BEST_FILE
        if not p.is_file() or not (self.out_dir / BEST_DIR / "config.json").is_file():
            return None
        try:
            best = json.loads(p.read_text())
            return best if best.get("metric") == BEST_METRIC and math.isfinite(best["value"]) else None
        except (ValueError, KeyError, TypeError):
            return None

    def _save_best(self, step: int, value: float, drafter) -> None:
        """drafter_best/ replaced whole (written beside it, then renamed), best.json after it: a crash never pairs a
        best.json with other weights than the ones it names."""
        final, tmp = self.out_dir / BEST_DIR, self.out_dir / f".{BEST_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        old = self.out_dir / f".{BEST_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        self.best = {"metric": BEST_METRIC, "step": step, "value": value}
        tmp_json = self.out_dir / f".{BEST_FILE}.tmp"
        tmp_json.write_text(json.dumps(self.best) + "\n")
        os.replace(tmp_json, self.out_dir / BEST_FILE)

    def finish(self, final_dir: Path) -> tuple[Path, dict | None]:
        """After the final weights are in final_dir (<out_dir>/drafter): keep them as drafter_last/ and make
        drafter/ the best by validation. Returns (drafter dir, best record or None)."""
        if self.best is None or not (self.out_dir / BEST_DIR).is_dir():
            return final_dir, None
        last = self.out_dir / LAST_DIR
        shutil.rmtree(last, ignore_errors=True)
        os.replace(final_dir, last)
        shutil.copytree(self.out_dir / BEST_DIR, final_dir)
        return final_dir, self.best

    def summary(self, steps: int, train_seconds: float | None = None) -> str:
        """One line for the end of the run: which step won, and what validation cost."""
        if self.best is None:
            return "validation: none ran; drafter/ holds the final weights"
        cost = f", {self.seconds:.1f}s of validation" + (f" ({self.seconds / train_seconds:.1%} of training)"
                                                         if train_seconds else "")
        return (f"validation: best {BEST_METRIC} {self.best['value']:.3f} at step {self.best['step']} of {steps}: "
                f"drafter/ holds that step, drafter_last/ the final weights{cost}")

    # ------------------------------------------------------------------ memorisation
    def _check_memorising(self) -> None:
        """Warn once when validation has not improved for PATIENCE validations while training's estimate rose."""
        h = self.history
        if self._warned or len(h) <= PATIENCE or self.best is None:
            return
        recent = h[-PATIENCE:]
        if any(r["step"] == self.best["step"] for r in recent):
            return
        first, last = h[-PATIENCE - 1].get("train_tau_est"), recent[-1].get("train_tau_est")
        if first is None or last is None or last <= first:
            return
        self._warned = True
        log.warning(f"validation: the held-out tau estimate has not improved for {PATIENCE} validations (best "
                    f"{self.best['value']:.2f} at step {self.best['step']}) while training's rose {first:.2f} -> "
                    f"{last:.2f}: the drafter is memorising its data. drafter/ keeps the best step; for a better "
                    "drafter add data (data.regenerate with data.self_prompts, more conversations) or lower "
                    "train.max_steps.")


def data_passes_line(conversations: int, unique_tokens: int, supervised: int, epochs: float) -> tuple[str, bool]:
    """The start-up line on data volume: unique tokens and how many passes over them the run's steps make; True
    when that is past EPOCHS_WARN (a drafter trained many passes over too little data memorises it)."""
    line = (f"data: {conversations:,} training conversations, {unique_tokens:,} unique tokens ({supervised:,} "
            f"supervised); the run's steps amount to {epochs:.1f} epochs")
    return line, epochs > EPOCHS_WARN
