"""A fully predictable token stream for smoke tests and the tiny recipe.

Each document starts at a random token and then counts up by `stride` modulo `period` inside a vocabulary window:
given any token, every later token of the document is determined. A drafter that learns the rule reaches acc@k = 1
at every block position; chance is 1 / period.
"""

from __future__ import annotations

import random

from .packing import Sample


def synthetic_samples(num: int, period: int = 8, vocab_offset: int = 4, prompt_len: int = 4,
                      min_len: int = 24, max_len: int = 96, stride: int = 3, seed: int = 0) -> list[Sample]:
    """`num` documents; the first `prompt_len` tokens of each are unsupervised (a 'prompt')."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        start = rng.randrange(period)
        ids = [vocab_offset + (start + i * stride) % period for i in range(n)]
        mask = [i >= prompt_len for i in range(n)]
        out.append(Sample(ids, mask))
    return out
