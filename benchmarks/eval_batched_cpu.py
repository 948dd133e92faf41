#!/usr/bin/env python3
"""CPU benchmark: `evaluate` with its untimed prompts decoded one at a time (batch_rows=1) and together
(inference/batched.py), on the embedded SmolLM2 with a random 2-layer drafter, the bundled yardstick prompts.

  PYTHONPATH=src .venv/bin/python benchmarks/eval_batched_cpu.py [PROMPTS] [NEW_TOKENS] [ROWS]

PROMPTS yardstick prompts (default 8), NEW_TOKENS each (default 48), one of them timed (plain decoding and one-prompt
speculative decoding, as the demo times 16 a set); the rest decoded ROWS at a time (default 8) against one at a time,
alternating twice. Prints seconds per evaluation and whether both gave the same tokens and acceptance lengths. A
random drafter accepts almost nothing (tau ~1): every prompt takes ~NEW_TOKENS steps, the most steps a prompt can.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.config import ModelConfig
from dflash_train.demo import local_embedded_target
from dflash_train.inference.benchmark import evaluate, stop_token_ids
from dflash_train.inference.prompts import read_prompt_file, tokenize_prompts
from dflash_train.models.build import build_drafter
from dflash_train.models.target import default_layer_ids, load_target, load_tokenizer


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 8
    new_tokens = int(argv[1]) if len(argv) > 1 else 48
    rows = int(argv[2]) if len(argv) > 2 else 8
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(local_embedded_target(Path(tmp), None))
        target = load_target(hf_dir, default_layer_ids(30, 5), truncate=False)
        tok = load_tokenizer(hf_dir)
        drafter = build_drafter(ModelConfig(target_layer_ids=target.layer_ids, num_draft_layers=2,
                                            mask_token_id=target.info.vocab_size - 1), target.info)
        prompts = tokenize_prompts(read_prompt_file("yardstick")[:n], tok)
        stops = stop_token_ids(target.hf, tok)
        reports, seconds = {}, {1: [], rows: []}
        for _ in range(2):
            for r in (1, rows):
                t0 = time.perf_counter()
                reports[r] = evaluate(target, drafter, prompts, new_tokens, stop_ids=stops, timed=1, batch_rows=r)
                seconds[r].append(time.perf_counter() - t0)
    same = all((a.speculative, a.accept_lengths) == (b.speculative, b.accept_lengths)
               for a, b in zip(reports[1].prompts, reports[rows].prompts))
    print(f"{n} yardstick prompts x {new_tokens} new tokens, 1 timed, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; tau {reports[rows].summary()['mean_tau']:.2f}")
    for r, s in seconds.items():
        print(f"  untimed prompts {'one at a time' if r == 1 else f'{r} at a time'}: "
              f"{', '.join(f'{x:.1f}' for x in s)} s")
    print(f"  the same tokens and acceptance lengths: {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
