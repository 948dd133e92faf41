"""Step metrics: one line per logged step, a JSONL file, and TensorBoard events when tensorboard is installed.

Metric tensors arrive still on the device; `.item()`/`.tolist()` here is the only host sync of the training loop,
and it happens only on log steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Iterator

import torch

from .budget import TimeBudget
from .heap import GcWatch
from .objective import acceptance_from_counts

log = logging.getLogger("dflash_train")
GC_NOTE_S = 0.05  # a log line names the window's garbage-collection time from this many seconds on


class StepWindow:
    """The metrics of every step since the last log step, summed on the device (no host sync): a log line reports
    its whole window, not the one batch that happens to end it. take() -> the window's metrics: loss = mean over
    the steps, counts and num_labels = sums (the keys a step returns, so replicas average them as they are), and
    acc / cond_acc / tau_est from the summed acceptance counts (the estimate averages every block of the window)."""

    def __init__(self):
        self._sum: dict[str, torch.Tensor] | None = None
        self._steps = 0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        if self._sum is None:
            self._sum = {k: metrics[k].detach().clone().float() for k in ("loss", "counts", "num_labels")}
        else:
            for k, v in self._sum.items():
                v.add_(metrics[k].detach().float())
        self._steps += 1

    def take(self) -> dict[str, torch.Tensor]:
        if self._sum is None:
            raise RuntimeError("no step in this log window")
        out = dict(self._sum, loss=self._sum["loss"] / self._steps)
        out.update(acceptance_from_counts(out["counts"]))
        self._sum, self._steps = None, 0
        return out


class MetricsLogger:
    """Accumulates per-step device metrics and flushes them as one line + JSONL (+ TensorBoard) per log step.

    budget: the run's TimeBudget (train.max_minutes), if any: the ETA never exceeds its time left."""

    def __init__(self, out_dir: Path | None, total_steps: int, tokens_per_step: int, log_every: int = 10,
                 tensorboard: bool = True, start_step: int = 0, budget: TimeBudget | None = None):
        self.total_steps, self.tokens_per_step, self.log_every = total_steps, tokens_per_step, log_every
        self.budget = budget
        self.out_dir = out_dir
        self._jsonl = None
        self._tb = None
        self.history: list[dict] = []      # the logged training steps
        self.val_history: list[dict] = []  # the validations (log_val)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(out_dir / "metrics.jsonl", "a")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self._tb = SummaryWriter(str(out_dir / "tensorboard"))
                except Exception:  # noqa: BLE001 - tensorboard is optional
                    self._tb = None
        self._t0 = time.perf_counter()
        self._last_t, self._last_step = self._t0, start_step
        self._excluded_s = 0.0  # this window's time on work that is not training (exclude)
        self.gc = GcWatch()      # the collector's pauses per window, while watch_gc() is on

    @contextlib.contextmanager
    def watch_gc(self) -> Iterator[None]:
        """Time Python's garbage collections for the body (training): each log record gets its window's `gc_s`,
        the line names it from GC_NOTE_S on, and the body's total is logged at the end (training/heap.py)."""
        self.gc.take()
        self.gc.start()
        try:
            yield
        finally:
            self.gc.stop()
            log.info(f"garbage collections during training: {self.gc.count}, {self.gc.total_s:.2f}s in all, the "
                     f"longest {self.gc.longest_s:.3f}s")

    def start_window(self, step: int) -> None:
        """The first log window starts here, after the run's first step `step`: what came before it (compiling,
        capturing CUDA graphs, the pipeline filling, pinning checkpoint buffers) is start-up, reported apart ("first
        step ... done N s after the command started", training/startup.py), and would make the first window read
        as a stall. Called once, after that step's own log line if it had one."""
        self._last_t, self._last_step = time.perf_counter(), step
        self._excluded_s = 0.0
        self.gc.take()

    def exclude(self, seconds: float) -> None:
        """`seconds` of the current window went to work that is not training (a validation pass, timed and reported
        by training/validation.py): the window's step time and tokens/s leave them out, and its record states them
        as `excluded_s`, so a window holding a validation reads the training's own speed."""
        self._excluded_s += seconds

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def log(self, step: int, metrics: dict[str, torch.Tensor], lr: float, extra: dict | None = None) -> dict:
        """step is 1-based (steps done). Reads the device tensors (host sync) and prints one line."""
        now = time.perf_counter()
        steps = max(1, step - self._last_step)
        excluded, self._excluded_s = self._excluded_s, 0.0
        gc_s, _ = self.gc.take()  # part of the window's time (every thread waits for a collection), not left out
        dt = max(now - self._last_t - excluded, 0.0) / steps
        self._last_t, self._last_step = now, step
        # Replicas' windows arrive averaged count by count (the ratios are not averaged): derive the ratios here.
        metrics = dict(metrics, **acceptance_from_counts(metrics["counts"].float()))
        acc = metrics["acc"].float().tolist()
        rec = {"split": "train", "step": step, "loss": float(metrics["loss"]), "acc": acc,
               "cond_acc": metrics["cond_acc"].float().tolist(), "tau_est": float(metrics["tau_est"]),
               "lr": lr, "step_time_s": dt, "tokens_per_s": self.tokens_per_step / dt if dt > 0 else 0.0,
               "excluded_s": excluded, "gc_s": gc_s}
        if extra:
            rec.update(extra)
        eta = (self.total_steps - step) * dt
        if self.budget is not None and self.budget.max_s is not None:
            eta = min(eta, max(0.0, self.budget.max_s - self.budget.elapsed_s))
        line = (f"step {step:>6}/{self.total_steps} | loss {rec['loss']:.4f} | acc@1 {acc[0]:.3f} "
                f"acc@4 {acc[min(3, len(acc) - 1)]:.3f} | tau~ {rec['tau_est']:.2f} | lr {lr:.2e}{_grad_note(rec)} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | eta {_fmt_s(eta)}")
        for key in ("drafter_wait", "target_wait", "queues"):
            if extra and key in extra:
                v = extra[key]
                line += f" | {key} {v:.0%}" if isinstance(v, float) else f" | {key} {v}"
        if excluded:
            line += f" | {excluded:.2f}s of validation not counted"
        if gc_s >= GC_NOTE_S:
            line += f" | gc {gc_s:.2f}s"
        if extra and extra.get("skipped"):  # steps without an update (non-finite loss, train.nonfinite=skip)
            line += f" | skipped {extra['skipped']}"
        log.info(line)
        self.history.append(rec)
        self._write(rec)
        self._scalars("train", "acc", rec, ("loss", "tau_est", "lr", "tokens_per_s", "grad_norm", "clipped"))
        return rec

    def log_val(self, step: int, metrics: dict[str, torch.Tensor], extra: dict | None = None) -> dict:
        """One validation (training/validation.py): a `val` line, a metrics.jsonl record with split "val", and
        TensorBoard scalars under val/ (train/ and val/ share step numbers, so the curves overlay)."""
        acc = metrics["acc"].float().tolist()
        rec = {"split": "val", "step": step, "loss": float(metrics["loss"]), "acc": acc,
               "cond_acc": metrics["cond_acc"].float().tolist(), "tau_est": float(metrics["tau_est"])}
        rec.update(extra or {})
        line = (f"val  {step:>6}/{self.total_steps} | loss {rec['loss']:.4f} | acc@1 {acc[0]:.3f} "
                f"acc@4 {acc[min(3, len(acc) - 1)]:.3f} | tau~ {rec['tau_est']:.2f}")
        if "tau_decoding" in rec:  # training/validation.py: decoding's walk over the held-out replies
            line += f" | tau as decoded {rec['tau_decoding']:.2f}"
        if "tau_decoding_by_source" in rec:
            line += " (" + ", ".join(f"{k} {v:.2f}" for k, v in rec["tau_decoding_by_source"].items()) + ")"
        if "best_step" in rec:
            line += f" | best {rec['best_tau_decoding']:.2f} at step {rec['best_step']}"
        log.info(line)
        self.val_history.append(rec)
        self._write(rec)
        self._scalars("val", "val_acc", rec, ("loss", "tau_est", "tau_decoding"))
        if self._tb:
            for source, tau in rec.get("tau_decoding_by_source", {}).items():
                self._tb.add_scalar(f"val_by_source/{source}", tau, step)
        return rec

    def _scalars(self, group: str, acc_group: str, rec: dict, keys: tuple[str, ...]) -> None:
        """TensorBoard: rec's `keys` (those present) under group/, and acc@k per block position under acc_group/."""
        if not self._tb:
            return
        for key in keys:
            if key in rec:
                self._tb.add_scalar(f"{group}/{key}", rec[key], rec["step"])
        for k, a in enumerate(rec["acc"], start=1):
            self._tb.add_scalar(f"{acc_group}/pos{k:02d}", a, rec["step"])

    def _write(self, rec: dict) -> None:
        if self._jsonl:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()

    def close(self):
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._tb:
            self._tb.close()
            self._tb = None


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _grad_note(rec: dict) -> str:
    """' | gnorm 0.84 (max 2.10, 35% clipped)' from a record's window of gradient norms (before clipping), or ''."""
    if "grad_norm" not in rec:
        return ""
    clipped = f", {rec['clipped']:.0%} clipped" if "clipped" in rec else ""
    return f" | gnorm {rec['grad_norm']:.2f} (max {rec['grad_norm_max']:.2f}{clipped})"
