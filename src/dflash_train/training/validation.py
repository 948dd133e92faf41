"""Validation during training: the drafter scored on held-out rows it never trains on, and the best drafter kept.

  held-out conversations -> packed exactly like training rows (train.token_budget)
    -> EVERY valid anchor of each row, in blocks of train.num_anchors (fixed shapes: one compiled forward)
    -> target features computed once at start-up, kept on the validating device
    -> every train.eval_every steps and at the end: DrafterStep.evaluate on each block batch (forward only)
    -> loss, acc@k, and two tau estimates -> a `val` log line, metrics.jsonl / TensorBoard, the best drafter so far
       in <out_dir>/drafter_best

The two estimates. `tau_est` averages the expected acceptance over every position as an anchor, as training's own
estimate does. Decoding does not visit every position: a block starts where the previous one stopped, i.e. right
after the drafter was wrong, and those positions are harder, so the every-position estimate runs above the measured
tau (docs/BENCHMARKS.md, "The GPU demo"). `tau_decoding` walks the anchors as decoding does instead: from the first
token of each assistant reply, accept what the drafter gets right from that anchor (the leading correct drafts plus
the target's own token), jump there, repeat; the mean over a reply's steps, averaged over replies, is the
evaluator's mean tau. When the held-out replies are the target's own greedy answers (data.regenerate) that walk is
what speculative decoding on their prompts would do, so it predicts the measured tau; it picks drafter/.

Cost: (valid anchors of eval_rows rows) / num_anchors forward passes (no backward, no optimizer) every eval_every
steps, plus the memory of eval_rows rows of features. Validation touches no weight, no .grad buffer, no optimizer
state and draws no random number: a run's trajectory is the same with and without it (tests/test_validation.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.packing import PackedRow, Sample, TrainBatch, pack_samples, valid_anchor_positions
from ..models.checkpoint import save_drafter
from .metrics import StepWindow

log = logging.getLogger("dflash_train")

BEST_METRIC = "val_tau_decoding"  # picks drafter/: the acceptance length decoding would reach on held-out replies
BEST_DIR, LAST_DIR, BEST_FILE = "drafter_best", "drafter_last", "best.json"
# The best step's walk per held-out reply ({"step", "replies": [{"key", "source", "tau", "tokens", "steps"}]}),
# beside best.json: a measurement of the same conversations' prompts pairs with it (benchmarks/compare_evals.py), up
# to where the two texts part (the reply's tokens and each block's acceptance, REPLY_TOKENS_KEPT tokens at most).
REPLIES_FILE = "validation_replies.json"
REPLY_TOKENS_KEPT = 512  # past the measurement's 256 new tokens; a reply's blocks kept while they end within it
PATIENCE = 3            # validations without a new best (while the held-out loss rises) before the warning
# How far the held-out loss must rise past its lowest before a stalled validation reads as memorisation. Not a stall
# alone: as the LR anneals to zero validation stops improving while train and held-out loss stay level (demo-m,
# 2026-12-04: held-out loss 1.814 at the best step and at the end, and the old rule, "training's estimate rose", fired
# on that estimate's window-to-window noise, +-0.2). Memorising raises the held-out loss while the training loss falls.
LOSS_RISE = 0.02
EPOCHS_WARN = 4.0       # more passes than this over the data: the start-up line warns of memorisation


@dataclass
class ValidationRows:
    rows: list[PackedRow]           # the held-out rows (on the validating device)
    batches: list[TrainBatch]       # every valid anchor of every row, num_anchors at a time (same device)
    row_of: list[int]               # batches[i] holds anchors of rows[row_of[i]]
    feats: list[torch.Tensor]       # [T, k*H] per row: the target's features, same device
    documents: int                  # held-out conversations the rows hold
    tokens: int                     # real (non-padding) tokens in the rows
    doc_sources: list[list[str]] = field(default_factory=list)  # per row, each document's source (a data.mix)
    doc_keys: list[list[str]] = field(default_factory=list)     # per row, each document's conversation key


def validation_rows(heldout: list[Sample], token_budget: int, num_anchors: int, max_rows: int, pad_id: int = 0,
                    sources: list[str] | None = None, keys: list[str] | None = None):
    """Up to max_rows rows of held-out samples, packed in order like training rows, and batches that hold every
    valid anchor of each row in order, num_anchors per batch (the last one padded with invalid anchors). Rows
    without any valid anchor (nothing supervised) are skipped. -> (rows, batches, row_of, doc_sources, doc_keys):
    with `sources` / `keys` (one per sample), each kept row's documents' sources / keys, by document id; else []."""
    nonempty = [bool(sample.input_ids) for sample in heldout]  # packing skips empty samples
    labels = [src for src, ok in zip(sources or [], nonempty) if ok]
    key_labels = [k for k, ok in zip(keys or [], nonempty) if ok]
    rows, batches, row_of, doc_sources, doc_keys, used = [], [], [], [], [], 0
    for row in pack_samples(heldout, token_budget, pad_id):
        n_docs = int(row.doc_ids.max()) + 1
        row_sources, row_keys = labels[used:used + n_docs], key_labels[used:used + n_docs]  # samples' order kept
        used += n_docs
        anchors = valid_anchor_positions(row.loss_mask, row.doc_ids).nonzero().flatten()
        if anchors.numel() == 0:
            continue
        if labels:
            doc_sources.append(row_sources)
        if key_labels:
            doc_keys.append(row_keys)
        for s in range(0, anchors.numel(), num_anchors):
            chunk = anchors[s:s + num_anchors]
            a = torch.zeros(num_anchors, dtype=torch.long)
            ok = torch.zeros(num_anchors, dtype=torch.bool)
            a[:chunk.numel()], ok[:chunk.numel()] = chunk, True
            batches.append(TrainBatch(row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, a, ok,
                                      index=-1 - len(rows)))
            row_of.append(len(rows))
        rows.append(row)
        if len(rows) >= max_rows:
            break
    return rows, batches, row_of, doc_sources, doc_keys


@torch.no_grad()
def build_validation_rows(heldout: list[Sample], cfg, target, device: torch.device, pad_id: int = 0,
                          features=None, sources: list[str] | None = None,
                          keys: list[str] | None = None) -> ValidationRows | None:
    """The run's fixed validation rows with their target features, on `device`; None (and a log line saying why)
    when validation is off or there is nothing held out. `features(ids, pos, doc) -> [T, k*H]` defaults to
    target.features on the target's device. sources: each held-out sample's source (DatasetSplit.heldout_sources),
    for decoding's tau by source. keys: each held-out sample's conversation key (DatasetSplit.heldout_keys), to pair
    the best step's replies with measured prompts (REPLIES_FILE)."""
    t = cfg.train
    if t.eval_every <= 0 or t.eval_rows <= 0:
        log.info("validation: off (train.eval_every or train.eval_rows is 0)")
        return None
    rows, batches, row_of, doc_sources, doc_keys = validation_rows(heldout, t.token_budget, t.num_anchors,
                                                                   t.eval_rows, pad_id, sources, keys)
    if not rows:
        log.warning("validation: off, the run has no held-out conversations (raise data.heldout_fraction to "
                    "see how the drafter does on data it never trains on)")
        return None
    features = features or target.features
    feats = []
    for row in rows:
        r = [x.to(target.device) for x in (row.input_ids, row.position_ids, row.doc_ids)]
        feats.append(features(*r).to(device))
    docs = sum(int(r.doc_ids.max()) + 1 for r in rows)
    tokens = sum(int((r.doc_ids >= 0).sum()) for r in rows)
    anchors = sum(int(b.anchor_valid.sum()) for b in batches)
    mix = Counter(src for row in doc_sources for src in row)
    held = f"{docs} conversations" + (f": {', '.join(f'{k} {n}' for k, n in sorted(mix.items()))}" if mix else "")
    log.info(f"validation: {len(rows)} held-out rows ({held}, {tokens:,} tokens, every one of their "
             f"{anchors:,} anchors: {len(batches)} forward passes) every {t.eval_every} steps and at the end; "
             f"~{len(batches) / (3 * t.eval_every):.1%} of the training compute")
    move = lambda x: x.to(device)  # noqa: E731
    rows = [PackedRow(*map(move, (r.input_ids, r.position_ids, r.doc_ids, r.loss_mask))) for r in rows]
    return ValidationRows(rows, [b.to(device) for b in batches], row_of, feats, docs, tokens, doc_sources, doc_keys)


@dataclass
class Walk:
    """Decoding's walk over one held-out reply: what each block accepted, from the reply's first token on."""
    doc: int            # the reply's document id in its row
    start: int          # the reply's first position in the row (the first block's anchor)
    end: int            # one past the reply's last position
    steps: list[int]    # the tokens each block accepted (the leading correct drafts plus the target's own)

    @property
    def tau(self) -> float:
        return sum(self.steps) / len(self.steps)


def decoding_tau(loss_mask: torch.Tensor, doc_ids: torch.Tensor, accept: torch.Tensor) -> list[float]:
    """Per assistant reply of one row: the mean acceptance length of decoding's walk over it (decoding_walks)."""
    return [w.tau for w in decoding_walks(loss_mask, doc_ids, accept)]


def decoding_walks(loss_mask: torch.Tensor, doc_ids: torch.Tensor, accept: torch.Tensor) -> list[Walk]:
    """Per assistant reply of one row, decoding's walk over it. accept [T] (CPU, long): what decoding accepts from an
    anchor at each position (0 where no block can start). A reply's walk starts at its first token (the target's
    first generated token: the first block's anchor) and jumps by what each block accepted, until it reaches a
    position where no block starts (the reply's last token, or past it). A block that drafts the reply's last token
    right (its end-of-turn token) counts what decoding's step records there at the least: its right drafts plus one
    (the evaluator's acceptance length is accepted drafts + 1 on every step, the last too, though the stop token
    cuts what is emitted; the draft after the reply's end is not known here, so it counts as rejected)."""
    T = loss_mask.shape[0]
    mask, docs, acc = loss_mask.tolist(), doc_ids.tolist(), accept.tolist()
    walks = []
    for p in range(T):
        if not mask[p] or (p > 0 and mask[p - 1] and docs[p - 1] == docs[p]):
            continue  # not the first token of a reply
        end = p
        while end < T and mask[end] and docs[end] == docs[p]:
            end += 1
        steps, a = [], p
        while a < end - 1 and acc[a] > 0:
            steps.append(min(acc[a], end - a))  # no label past the reply: at most its drafts + 1
            a += steps[-1]
        if steps:
            walks.append(Walk(docs[p], p, end, steps))
    return walks


def blocks_before(steps: list[int], n: int) -> list[int]:
    """The leading blocks of a walk (steps from a text's first token on) that depend on its first n tokens only: a
    block that accepted a tokens from anchor c depends on the tokens up to c + a (the drafts it got right and the
    first it got wrong, or the target's token after the last)."""
    kept, c = [], 0
    for a in steps:
        if c + a >= n:
            break
        kept.append(a)
        c += a
    return kept


def blocks_before_parting(steps: list[int], text: list[int], other: list[int]) -> list[int]:
    """The blocks of a walk over `text` that a walk over `other` would see alike: every block when the two texts are
    the same, else those that end before the first token where they differ (blocks_before). When one text goes on
    where the other stops (a reply cut at its token limit, then closed by the chat template's end-of-turn token),
    the blocks end before the shorter one's last token: a block that reached it was cut there, not judged."""
    if text == other:
        return list(steps)
    shared = min(len(text), len(other))
    parted = next((i for i, (x, y) in enumerate(zip(text, other)) if x != y), shared - 1)
    return blocks_before(steps, parted)


def evaluate_rows(step_fn, rows: ValidationRows) -> dict[str, torch.Tensor | float]:
    """The drafter's loss, acc@k and every-position tau estimate over every validation anchor (summed counts, as a
    log window sums steps), and `tau_decoding` (decoding's walk, decoding_tau; a float: it needs the host)."""
    window = StepWindow()
    accept = [torch.zeros(r.input_ids.shape[0], dtype=torch.long) for r in rows.rows]
    for batch, r in zip(rows.batches, rows.row_of):
        out = step_fn.evaluate(batch, rows.feats[r])
        window.add(out)
        ok = batch.anchor_valid.cpu()
        accept[r][batch.anchors.cpu()[ok]] = out["accept_len"].cpu()[ok].long()  # .cpu(): a host sync, here only
    metrics = window.take()
    replies = []  # per held-out reply; source "" without a mix, key None when unknown
    for i, (row, acc) in enumerate(zip(rows.rows, accept)):
        ids = row.input_ids.cpu()
        for w in decoding_walks(row.loss_mask.cpu(), row.doc_ids.cpu(), acc):
            kept = min(w.end - w.start, REPLY_TOKENS_KEPT)
            replies.append({"key": rows.doc_keys[i][w.doc] if rows.doc_keys else None,
                            "source": rows.doc_sources[i][w.doc] if rows.doc_sources else "", "tau": w.tau,
                            "tokens": ids[w.start:w.start + kept].tolist(),
                            "steps": w.steps if kept == w.end - w.start else blocks_before(w.steps, kept)})
    metrics["tau_decoding"] = _mean([r["tau"] for r in replies])
    if len({r["source"] for r in replies}) > 1:  # a mix: the same walk, averaged per source
        metrics["tau_decoding_by_source"] = {src: _mean([r["tau"] for r in replies if r["source"] == src])
                                             for src in sorted({r["source"] for r in replies})}
    metrics["replies"] = replies
    return metrics


def paired_with_measured(replies: list[dict], prompts: list[dict]) -> dict | None:
    """Validation's walk (REPLIES_FILE's replies: key, tau; tokens and steps since 2026-12-04) against a
    measurement's prompts (an eval report's: id, tau, speculative, accept_lengths) on the conversations both hold. An
    id held twice on either side is left out (ShareGPT keys the parts of one chat alike: which pairs with which is
    unknown). -> {"pairs", "walk", "measured", "difference", "se"} (difference = measured - walk, se its standard
    error over the pairs), or None when nothing pairs; with the texts on both sides also "before_parting": the same
    pairs up to where the reply validation walked and the text decoding produced first differ (before_parting)."""
    def unique(items: list[tuple]) -> dict:
        counts = Counter(k for k, _ in items)
        return {k: v for k, v in items if k is not None and counts[k] == 1}

    walk = unique([(r.get("key"), r) for r in replies])
    measured = unique([(p.get("id"), p) for p in prompts if p.get("tau") is not None])  # None: no step (a stop at once)
    keys = [k for k in measured if k in walk]
    if not keys:
        return None
    diffs = [measured[k]["tau"] - walk[k]["tau"] for k in keys]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    out = {"pairs": len(keys), "walk": _mean([walk[k]["tau"] for k in keys]),
           "measured": _mean([measured[k]["tau"] for k in keys]), "difference": _mean(diffs), "se": se}
    if all("tokens" in walk[k] and "speculative" in measured[k] for k in keys):
        out["before_parting"] = before_parting([(walk[k], measured[k]) for k in keys])
    return out


def before_parting(pairs: list[tuple[dict, dict]]) -> dict:
    """Per (reply, measured prompt): each side's blocks up to where the two texts first differ
    (blocks_before_parting), averaged per side over the pairs where both keep a block. Where decoding reproduced the
    reply, the two walks see the same tokens, so they should accept alike block for block; what differs past the
    parting is another text, not the estimate. -> {"pairs", "parted" (pairs whose texts differ), "walk",
    "measured", "same_blocks" (pairs whose kept blocks are equal)}."""
    walked, decoded, same, parted = [], [], 0, 0
    for reply, prompt in pairs:
        text, other = reply["tokens"], prompt["speculative"]
        parted += text != other
        w = blocks_before_parting(reply["steps"], text, other)
        m = blocks_before_parting(prompt["accept_lengths"], other, text)
        if w and m:
            walked.append(sum(w) / len(w))
            decoded.append(sum(m) / len(m))
            same += w == m
    return {"pairs": len(walked), "parted": parted, "walk": _mean(walked), "measured": _mean(decoded),
            "same_blocks": same}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


class Validator:
    """Runs validation at its steps, logs it, keeps the best drafter and warns when the drafter starts memorising.

    The best drafter (by BEST_METRIC, decoding's walk over the held-out replies: higher is better, ties keep the
    earlier step) is written to
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
                step_fn.evaluate(self.rows.batches[0], self.rows.feats[self.rows.row_of[0]])

    def __call__(self, step: int, step_fn, drafter, train_tau: float | None = None) -> dict | None:
        """Validate at `step` (weights after `step` updates); returns the val record. Host-syncs (log steps only)."""
        if not self.enabled:
            return None
        # The training work still queued on the device is training's: finish it before the clock that the log window
        # leaves out starts (each window holding a validation read 2.3-3.1% fast in the demo before this).
        if step_fn.device.type == "cuda":
            torch.cuda.synchronize(step_fn.device)
        t0 = time.perf_counter()
        metrics = evaluate_rows(step_fn, self.rows)
        tau = float(metrics.pop("tau_decoding"))
        by_source = metrics.pop("tau_decoding_by_source", None)
        replies = metrics.pop("replies")
        improved = self.best is None or tau > self.best["value"]
        if improved:
            self._save_best(step, tau, drafter, by_source, replies)
        self.seconds += time.perf_counter() - t0
        rec = self.logger.log_val(step, metrics, {"tau_decoding": tau, "best_step": self.best["step"],
                                                  "best_tau_decoding": self.best["value"],
                                                  "val_seconds": time.perf_counter() - t0,
                                                  "train_tau_est": train_tau,
                                                  **({"tau_decoding_by_source": by_source} if by_source else {})})
        self.history.append(rec)
        self._check_memorising()
        self.logger.exclude(time.perf_counter() - t0)  # training's log window reads training alone
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

    def _save_best(self, step: int, value: float, drafter, by_source: dict | None = None,
                   replies: list[dict] | None = None) -> None:
        """drafter_best/ replaced whole (written beside it, then renamed), the step's replies (REPLIES_FILE), then
        best.json: a crash never pairs a best.json with other weights than the ones it names."""
        final, tmp = self.out_dir / BEST_DIR, self.out_dir / f".{BEST_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        old = self.out_dir / f".{BEST_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        if replies is not None:
            tmp_replies = self.out_dir / f".{REPLIES_FILE}.tmp"
            tmp_replies.write_text(json.dumps({"step": step, "replies": replies}) + "\n")
            os.replace(tmp_replies, self.out_dir / REPLIES_FILE)
        self.best = {"metric": BEST_METRIC, "step": step, "value": value}
        if by_source:
            self.best["by_source"] = by_source  # decoding's walk per source at that step (a data.mix)
        tmp_json = self.out_dir / f".{BEST_FILE}.tmp"
        tmp_json.write_text(json.dumps(self.best) + "\n")
        os.replace(tmp_json, self.out_dir / BEST_FILE)

    def mark_checkpoint(self, ckpt, step: int) -> None:
        """After checkpoint `step` was saved: if it is the best step so far, name it `best` in the checkpoints, so
        rotation keeps its training state too (resume or fine-tune from the best step)."""
        if self.best is not None and self.best["step"] == step:
            ckpt.mark_best(step, BEST_METRIC, self.best["value"])

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
        """Warn once when validation has not improved for PATIENCE validations and the held-out loss has risen more
        than LOSS_RISE past its lowest (LOSS_RISE says why a stall alone is not enough)."""
        h = self.history
        if self._warned or len(h) <= PATIENCE or self.best is None:
            return
        if any(r["step"] == self.best["step"] for r in h[-PATIENCE:]):
            return
        lowest, last = min(r["loss"] for r in h), h[-1]["loss"]
        if last <= lowest * (1 + LOSS_RISE):
            return
        self._warned = True
        log.warning(f"validation: the held-out tau has not improved for {PATIENCE} validations (best "
                    f"{self.best['value']:.2f} at step {self.best['step']}) and the held-out loss rose from "
                    f"{lowest:.3f} to {last:.3f}: the drafter is memorising its data. drafter/ keeps the best step; "
                    "for a better drafter add data (data.regenerate with data.self_prompts, more conversations) or "
                    "lower train.max_steps.")


def data_passes_line(conversations: int, unique_tokens: int, supervised: int, epochs: float,
                     clock: bool = False) -> tuple[str, bool]:
    """The start-up line on data volume: unique tokens and how many passes over them the run's steps make (at most,
    when the clock may end the run first); True when that is past EPOCHS_WARN (a drafter trained many passes over
    too little data memorises it)."""
    line = (f"data: {conversations:,} training conversations, {unique_tokens:,} unique tokens ({supervised:,} "
            f"supervised); the run's steps amount to {'at most ' if clock else ''}{epochs:.1f} epochs"
            + (" (train.max_minutes may end it sooner)" if clock else ""))
    return line, epochs > EPOCHS_WARN
