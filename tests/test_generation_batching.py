"""Batched generation for dataset regeneration: windowed attention over a reused cache, length-sorted batches.

The reference is the same naive greedy decoder as tests/test_inference.py: a full forward over the whole sequence
for every new token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash_train.data.regenerate import RegenerateSettings, Regenerator, RegenerateStats
from dflash_train.data.sources import Conversation
from dflash_train.inference.baseline import BatchGenerator
from dflash_train.models.target import load_target


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@torch.no_grad()
def naive_greedy(hf, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kv_window", [None, 4])
def test_batch_generator_reused_across_batches_matches_greedy(tiny_qwen3, kv_window):
    """One generator (cache of 40 slots) serves batches of different lengths and sizes; with a 4-slot window the
    decode steps cross many windows (each its own step) and the prefill attends over its own slots only."""
    hf = load_target(tiny_qwen3, [0], truncate=False).hf
    gen = BatchGenerator(hf, 3, 40, kv_window=kv_window)
    batches = [[[3], [7, 8, 9, 10, 11, 12], [20, 21, 22]], [[5, 6], [9]], [[1, 2] * 9, [4] * 5, [6]]]
    for prompts in batches:
        assert gen.generate(prompts, 13) == [naive_greedy(hf, p, 13) for p in prompts]
    if kv_window:
        assert {v for _, v in gen.runner._steps} == set(range(4, 33, 4))  # windows of 4 slots up to 18 + 13


class WordTokenizer:
    """Just enough of a HF tokenizer for regeneration: a chat template, ids from characters, decode to text."""
    chat_template = "stub"
    pad_token_id = 0
    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(str(t) for t in tokens)


def test_length_sorted_pools_keep_every_reply_and_cut_padding(tiny_llama, monkeypatch):
    """Sorting a pool by prompt length changes which prompts share a batch, not what the target answers: every
    conversation (multi-turn ones turn by turn) gets the same records as with batches in arrival order, with less
    left padding."""
    hf = load_target(tiny_llama, [0], truncate=False).hf
    lengths = [3, 40, 5, 60, 4, 8, 50, 6, 7, 45, 2, 9]
    convs = []
    for i, n in enumerate(lengths):
        msgs = [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "old answer"}]
        if i % 4 == 0:  # a second turn: generated after the first reply, from a history holding it
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "old"}]
        convs.append((f"c{i}_0", Conversation(f"c{i}", msgs), True))
    settings = RegenerateSettings("test", "tiny", max_new_tokens=5, temperature=0.0, single_turn=False,
                                  max_length=256)
    padding = Counter()
    generate = BatchGenerator.generate

    def spy(self, prompts, *args, **kw):
        padding[lookahead] += sum(max(map(len, prompts)) - len(p) for p in prompts)
        return generate(self, prompts, *args, **kw)

    monkeypatch.setattr(BatchGenerator, "generate", spy)

    class Bar:
        def update(self, n=1): ...
        def set_postfix_str(self, *a, **k): ...

    records = {}
    for lookahead in (1, 4):
        out: list[dict] = []
        stats = RegenerateStats()
        Regenerator(hf, WordTokenizer(), settings, 3, stop_ids=[], lookahead=lookahead).run(
            iter(convs), out.append, lambda: None, stats, Bar())
        assert stats.turns == len(convs) + 3 and stats.conversations == len(convs)
        records[lookahead] = {r["id"]: r["messages"] for r in out}
    assert records[1] == records[4] and len(records[1]) == len(convs)
    assert padding[4] < padding[1] / 3, padding
