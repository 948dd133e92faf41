#!/usr/bin/env python3
"""CPU measurement: how many tokens the demo's self-written prompts take to sample, kept and dropped, and what a
lower data.self_prompt_max_tokens would keep and cost (tokens sampled per kept prompt).

  PYTHONPATH=src .venv/bin/python benchmarks/self_prompt_lengths_cpu.py [ROWS]

The embedded SmolLM2 (converted once under /tmp), the demo's sampler and settings (temperature 1, the builtin
openers on 75% of rows, 128 tokens at most, seed 0, 64 rows a batch), on the CPU, until ROWS prompts (default 256)
are kept. A row that has not ended after the cap is dropped as truncated, having cost the whole cap; the table
replays the same rows under lower caps (a row longer than the cap is dropped there and costs the cap).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import dflash_train.generation.self_prompts as sp
from dflash_train.demo import local_embedded_target
from dflash_train.models.target import load_causal_lm, load_tokenizer

CAP = 128


def main(argv: list[str]) -> None:
    rows = int(argv[0]) if argv else 256
    seen: list[tuple[int, str | None]] = []  # (tokens sampled, why dropped or None)
    judge = sp.judge

    def recording_judge(tokens, text, stop_ids, special, min_chars):
        reason = judge(tokens, text, stop_ids, special, min_chars)
        seen.append((len(tokens), reason))
        return reason

    sp.judge = recording_judge
    cache = Path(tempfile.gettempdir()) / "dflash_self_prompt_lengths"
    cache.mkdir(exist_ok=True)
    hf_dir = str(local_embedded_target(cache, None))
    settings = sp.SelfPromptSettings(target=hf_dir, seed=0, batch_size=64, max_new_tokens=CAP,
                                     openers=sp.read_openers("builtin"), steered=0.75)
    with tempfile.TemporaryDirectory() as tmp:
        sp.write_self_prompts(load_causal_lm(hf_dir, "cpu"), load_tokenizer(hf_dir), Path(tmp) / "p.jsonl", rows,
                              settings)
    n, total = len(seen), sum(t for t, _ in seen)
    truncated = [t for t, r in seen if r == "truncated"]
    kept = [t for t, r in seen if r is None]
    print(f"{n} rows sampled, {len(kept)} kept (mean {sum(kept) / len(kept):.1f} tokens), {len(truncated)} "
          f"truncated at {CAP}: {sum(truncated) / total:.0%} of the {total} tokens sampled")
    for cap in (48, 64, 80, 96, 112, CAP):
        k = sum(1 for t, r in seen if r is None and t <= cap)
        cost = sum(min(t, cap) for t, _ in seen)
        print(f"  cap {cap:3d}: {k} kept ({k / len(kept):.0%} of the cap {CAP}'s), {cost / k:.1f} tokens sampled a "
              f"kept prompt")


if __name__ == "__main__":
    main(sys.argv[1:])
