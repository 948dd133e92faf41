#!/usr/bin/env python3
"""Two drafters measured on the same prompts: is the difference in tau larger than the noise?

  python3 benchmarks/compare_evals.py BASE.json OTHER.json [...]

Each file is an evaluation report (`dflash-train eval` or a run's eval_final/eval.json, the demo's
eval_yardstick.json). Prompts are paired by id (by position when the reports carry none). Per report: mean tau and
the standard error of that mean over prompts (how far another set of prompts of the same kinds could move it). Per
OTHER: the mean of the per-prompt differences OTHER - BASE and its standard error. The prompts differ far more
from each other than two drafters differ on one prompt, so the paired error is the smaller one by far. Standard
library only.
"""

from __future__ import annotations

import json
import statistics
import sys


def per_prompt(path: str) -> dict[str, float]:
    prompts = json.load(open(path))["prompts"]
    return {str(p.get("id", i)): p["tau"] for i, p in enumerate(prompts)}


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
        m, se = mean_se([other[i] for i in ids])
        dm, dse = mean_se([other[i] - base[i] for i in ids])
        print(f"{path}: tau {m:.3f} ± {se:.3f}; paired difference over {len(ids)} prompts {dm:+.3f} ± {dse:.3f} "
              f"({dm / dse:+.1f} standard errors)")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
