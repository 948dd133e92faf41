"""PNG plots of a training run, written into the run directory when training ends.

  training.png   loss vs step | acc@k per block position (a few logged steps, early to late) | tau estimate vs step
                 (training and validation on the same axes: a gap that widens is memorisation)

`history` is the list of logged step records (MetricsLogger.history / metrics.jsonl): step, loss, acc [B-1],
tau_est; `val_history` the validation records (MetricsLogger.val_history), same keys. Plotting is a convenience: a
missing matplotlib or an empty history is logged, never an error.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger("dflash_train")

PLOT_NAME = "training.png"
MAX_ACC_CURVES = 5  # acc@k curves drawn, spread evenly over the logged steps (always the last one)


def write_training_plots(out_dir: str | Path, history: list[dict], val_history: list[dict] = ()) -> Path | None:
    """Write <out_dir>/training.png; returns its path, or None when there is nothing to plot or no matplotlib."""
    records = [r for r in history if _finite(r.get("loss"))]
    val = [r for r in val_history if _finite(r.get("loss"))]
    if not records:
        log.info("no logged steps: no training plots written")
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no training plots (pip install matplotlib)")
        return None

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc, ax_tau) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], "-", color="tab:red", label="train")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", ms=3, color="tab:blue",
                     label="validation (held out)")
        ax_loss.legend(fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (position-weighted CE)")
    ax_loss.set_yscale("log")
    ax_loss.set_title("training loss")

    picks = _spread(len(records), MAX_ACC_CURVES)
    cmap = plt.get_cmap("viridis")
    for n, i in enumerate(picks):
        acc = records[i]["acc"]
        color = cmap(n / max(1, len(picks) - 1))
        ax_acc.plot(range(1, len(acc) + 1), acc, "o-", ms=3, color=color, label=f"step {records[i]['step']}")
    width = len(records[-1]["acc"])
    ax_acc.set_xticks(range(1, width + 1))
    ax_acc.set_xlabel("block position k")
    ax_acc.set_ylabel("acc@k (greedy draft correct)")
    ax_acc.set_ylim(0, 1.02)
    ax_acc.legend(fontsize=8)
    ax_acc.set_title("accuracy per block position")

    ax_tau.plot(steps, [r["tau_est"] for r in records], "-", color="tab:green", label="train")
    title = f"tau estimate (train {records[-1]['tau_est']:.2f}"
    if val:
        ax_tau.plot([r["step"] for r in val], [r["tau_est"] for r in val], "o-", ms=3, color="tab:blue",
                    label="validation (held out)")
        if all("tau_decoding" in r for r in val):  # decoding's walk: what speculative decoding would accept
            ax_tau.plot([r["step"] for r in val], [r["tau_decoding"] for r in val], "s--", ms=3, color="tab:purple",
                        label="validation, as decoded")
            title += f", val as decoded {val[-1]['tau_decoding']:.2f}"
        ax_tau.legend(fontsize=8)
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("1 + sum_k prod_{j<=k} cond_acc_j")
    ax_tau.set_ylim(bottom=1.0)
    ax_tau.set_title(title + ")")
    fig.tight_layout()
    path = Path(out_dir) / PLOT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info(f"training plots: {path}")
    return path


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over 0..n-1, first and last included, no repeats."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
