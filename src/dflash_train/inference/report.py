"""Write an EvalReport: eval.json (summary + per prompt), eval.png (tau histogram + per-position acceptance), and
the one console table."""

from __future__ import annotations

import json
import math
from pathlib import Path


def write_report(report, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(report_json(report))
    plot_report(report, out / "eval.png")


def report_json(report) -> str:
    """The summary indented; one line per prompt (its token lists would otherwise take one line per token)."""
    d = report.to_dict()
    summary = json.dumps(d["summary"], indent=2, allow_nan=False).replace("\n", "\n  ")
    prompts = ",\n    ".join(json.dumps(p, allow_nan=False) for p in d["prompts"])
    return f'{{\n  "summary": {summary},\n  "prompts": [\n    {prompts}\n  ]\n}}\n'


def plot_report(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    s = report.summary()
    B = report.block_size
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(range(1, B + 1), s["accept_histogram"], color="tab:blue")
    ax1.set_xlabel("acceptance length tau (accepted drafts + 1)")
    ax1.set_ylabel("verification steps")
    tau = s["mean_tau"]
    ax1.set_title(f"tau per step (mean over prompts {tau:.2f})" if tau is not None else "tau per step")
    ax1.set_xticks(range(1, B + 1))
    ks = list(range(1, B))
    for key, label, style in (("acceptance_by_position", "P(draft k accepted)", "o-"),
                              ("conditional_acceptance", "P(k accepted | 1..k-1 accepted)", "s--")):
        ax2.plot(ks, [math.nan if v is None else v for v in s[key]], style, label=label)
    ax2.set_xlabel("draft position k")
    ax2.set_ylabel("rate")
    ax2.set_ylim(0, 1.02)
    ax2.set_xticks(ks)
    ax2.legend()
    ax2.set_title(f"B={B}, T={report.temperature:g}, {s['num_prompts']} prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tau_text(s: dict) -> str:
    """An EvalReport summary -> its mean tau with the standard error over prompts, e.g. `3.52 ± 0.22` (`3.52`
    without one: older reports, a single prompt; `-` without a step)."""
    se = s.get("mean_tau_se")
    return _fmt(s["mean_tau"], ".2f") + ("" if se is None or s["mean_tau"] is None else f" ± {se:.2f}")


def verdict_text(s: dict) -> str:
    """An EvalReport summary (or eval.json's "summary") -> the lossless verdict in words, e.g.
    `yes (32/32 identical)`, `yes (44/80 identical, 36 diverge only at bf16 ties)`,
    `NO: prompt 7 diverges at token 31, margin 2.1` (inference/verdict.py says what a tie is). With plain decoding
    on a subset only, identical prompts and those checked token by token count together:
    `yes (50/80 the target's argmax at every token, 30 with bf16 ties)`."""
    if s["lossless"] is None:
        return "n/a (sampling; distribution-preserving rule)"
    n, same = s["num_prompts"], s["identical_prompts"]
    if s["lossless"]:
        ties = s.get("tie_prompts", 0)
        if s.get("timed_prompts", n) < n:
            return (f"yes ({same + s['argmax_prompts']}/{n} the target's argmax at every token"
                    + (f", {ties} with {s['dtype']} ties)" if ties else ")"))
        return f"yes ({same}/{n} identical" + (f", {ties} diverge only at {s['dtype']} ties)" if ties else ")")
    w = s.get("first_wrong")
    if not w:  # a summary written before the verdict re-scored divergences
        return f"NO ({same}/{n} identical)"
    name = f"prompt {w['prompt']}" + (f" ({w['id']})" if w.get("id") else "")
    where = f": plain decoding diverges at token {w['token']}" if w.get("plain") else f" diverges at token {w['token']}"
    text = f"NO: {name}{where}, margin {w['gap']:.3g}"
    wrong = s.get("wrong_prompts", 1)
    return text + (f" ({wrong}/{n} prompts wrong)" if wrong > 1 else "")


def format_summary(report) -> str:
    s = report.summary()
    verdict = verdict_text(s)
    margins = [p.mismatch_margin for p in report.prompts if p.mismatch_margin is not None]
    if margins:  # a top-2 logit margin near 0 at the divergence = a numerical tie, not a broken rule
        shown = ", ".join(f"{m:.3g}" for m in margins[:8]) + (", ..." if len(margins) > 8 else "")
        verdict += f"; target top-2 margins where the outputs part: {shown}"
    tau = tau_text(s)
    rows = [
        ("", "plain", "speculative"),
        ("tokens", str(sum(len(p.baseline) for p in report.prompts)),
         str(sum(len(p.speculative) for p in report.prompts))),
        ("tokens/s", _fmt(s["baseline_tokens_per_s"], ".1f"), _fmt(s["speculative_tokens_per_s"], ".1f")),
        ("ms/token", _fmt(s["baseline_ms_per_token"], ".3f"), _fmt(s["speculative_ms_per_token"], ".3f")),
        ("speedup", "", _fmt(s["speedup"], ".2f") + "x"),
        (f"mean tau (B={s['block_size']})", "", tau + (" (standard error over prompts)" if "±" in tau else "")),
        ("tau estimate (acc@k)", "", _fmt(s["tau_estimate"], ".2f") + "  training's metric on the greedy outputs"),
        ("lossless", "", verdict),
    ]
    if s["tau_by_category"]:
        rows.insert(-2, ("tau by category", "", "  ".join(f"{c} {t:.2f}" for c, t in s["tau_by_category"].items())))
    w0 = max(len(r[0]) for r in rows)
    head = (f"eval: {s['num_prompts']} prompts, max {s['max_new_tokens']} new tokens, T={s['temperature']:g}, "
            f"{s['device']}, {s['dtype']}, cuda graphs {'on' if s['cuda_graphs'] else 'off'}")
    if s.get("timed_prompts", s["num_prompts"]) < s["num_prompts"]:
        head += f", plain decoding timed on {s['timed_prompts']} of them"
    return "\n".join([head] + [f"  {a:<{w0}}  {b:>12}  {c}" for a, b, c in rows])
