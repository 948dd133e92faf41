#!/usr/bin/env python3
"""Two drafters measured on the same prompts: is the difference in tau larger than the noise?

  python3 benchmarks/compare_evals.py BASE.json OTHER.json [...]

Each file (gzipped or not) is an evaluation report (`dflash-train eval` or a run's eval_final/eval.json, the demo's
eval_yardstick.json), or a run's validation_replies.json: validation's decoding walk per held-out reply at the best
step, keyed by conversation, so that `compare_evals.py RUN/validation_replies.json RUN/eval_heldout/eval.json` sets
the estimate against the measured tau on the same conversations (the demo measures the first held-out ShareGPT
conversations, which validation's rows hold too); with the replies' tokens on one side and plain decoding's text
(`baseline`) on the other it also says where the two texts first differ. Prompts are paired by id (by position when
the reports carry none). Per report: mean tau and the standard error of that mean over prompts (how far another set
of prompts of the same kinds could move it). Per OTHER: the mean of the per-prompt differences OTHER - BASE and its
standard error.
The prompts differ far more from each other than two drafters differ on one prompt, so the paired error is the
smaller one by far. Standard library only (so it does not call training/validation.py's paired_with_measured, which
pairs the same way for the demo's table).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter

from records import open_record


def read_json(path: str):
    """A JSON file, gzipped or not (docs/gpu-runs keeps its large records as .gz)."""
    with open_record(path) as f:
        return json.load(f)


def per_prompt(path: str, field: str = "tau") -> dict:
    """id -> tau (or another field of each prompt / reply). An id held by more than one prompt (ShareGPT keys the
    parts of one long chat alike) is left out: which of them pairs with which is unknown."""
    report = read_json(path)
    if "replies" in report:  # validation_replies.json: replies without a key (synthetic data) cannot be paired
        pairs = [(str(r["key"]), r.get(field)) for r in report["replies"] if r["key"] is not None]
    else:
        # a prompt plain decoding did not run (`timed` false: eval --timed-prompts) has no baseline to compare
        pairs = [(str(p.get("id", i)), None if field == "baseline" and not p.get("timed", True) else p.get(field))
                 for i, p in enumerate(report["prompts"])]
    counts = Counter(k for k, _ in pairs)
    if field == "tau" and (dup := sorted(k for k, n in counts.items() if n > 1)):
        print(f"{path}: {len(dup)} id(s) held by several prompts, left out: {', '.join(dup[:5])}")
    # a prompt with no verification step (its first token a stop token) has tau null: nothing to compare
    return {k: v for k, v in pairs if counts[k] == 1 and v is not None}


def texts_part(replies_path: str, report_path: str) -> None:
    """Where the replies validation walked (their tokens, kept since 2026-12-04) and plain decoding's text of the same
    prompts (the report's `baseline`) first differ: the regenerated training text against what the target produces
    when it decodes alone. Parting late and rarely is bf16 rounding at near-ties; parting early and often would mean
    the drafter trains on text the target does not produce."""
    replies, baselines = per_prompt(replies_path, "tokens"), per_prompt(report_path, "baseline")
    ids = [i for i in baselines if replies.get(i) is not None and baselines[i] is not None]
    if not ids:
        return
    parts = [next((k for k, (x, y) in enumerate(zip(replies[i], baselines[i])) if x != y), None) for i in ids]
    where = sorted(k for k in parts if k is not None)
    line = (f"texts: {len(ids) - len(where)} of {len(ids)} regenerated replies agree with plain decoding to the "
            "shorter's end")
    if where:
        line += f"; the others part at token {', '.join(map(str, where))}"
    print(line)


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def main(paths: list[str]) -> None:
    base = per_prompt(paths[0])
    m, se = mean_se(list(base.values()))
    print(f"{paths[0]}: tau {m:.3f} ± {se:.3f} over {len(base)} prompts")
    for path in paths[1:]:
        other = per_prompt(path)
        ids = [i for i in base if i in other]
        if not ids:
            print(f"{path}: no prompt in common with {paths[0]}")
            continue
        m, se = mean_se([other[i] for i in ids])
        dm, dse = mean_se([other[i] - base[i] for i in ids])
        z = f"{dm / dse:+.1f} standard errors" if dse > 0 else "the same on every prompt"
        print(f"{path}: tau {m:.3f} ± {se:.3f}; paired difference over {len(ids)} prompts {dm:+.3f} ± {dse:.3f} "
              f"({z})")
        texts_part(paths[0], path)  # says nothing unless paths[0] holds replies' tokens and path decoded texts


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
