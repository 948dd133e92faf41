"""Plain target-only generation on the speculative harness (same static cache, same graphs): the honest baseline.

`target_generate` decodes one prompt token by token with a q = 1 step; `BatchGenerator` / `generate_batch` decode a
left-padded batch until its longest reply ends (self-written prompts sample from it; the generate benchmark's static
rows). Dataset regeneration runs on generation/engine.py instead: continuous batching, rows refilled as they end.
Greedy at temperature 0, plain sampling otherwise.

Batched decoding cost is memory traffic over the KV cache: every step reads, for every row, all the slots attention
looks at. Two things keep that proportional to what the batch really holds: the batch generator attends over a
window that grows with the sequence (TargetRunner kv_window) rather than the whole cache, and its cache can be
sized once for the longest batch and reused by shorter ones (a captured step per window, not per cache size). The
caller keeps padding low by batching prompts of similar length (generation/regenerate.py sorts a lookahead pool).
"""

from __future__ import annotations

import time

import torch

from .decoding import GenerationResult, TokenSink, device_sync, pick_tokens
from .target_runner import TargetRunner

STOP_CHECK_EVERY = 16  # batched decoding syncs with the host only this often to see whether every row has stopped
KV_WINDOW = 128  # batched decoding attends over the filled slots rounded up to this (one captured step per window)


@torch.no_grad()
def target_generate(runner: TargetRunner, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                    stop_ids=(), generator: torch.Generator | None = None) -> GenerationResult:
    """Decode one prompt with the target alone. `runner` needs a q = 1 step and max_len >= prompt + max_new_tokens."""
    sink = TokenSink(max_new_tokens, stop_ids)
    device_sync(runner.device)
    t0 = time.perf_counter()
    logits, _ = runner.prefill(torch.tensor([prompt_ids]))
    tok = pick_tokens(logits[:, -1], temperature, generator)          # [1] on the device
    sink.add([int(tok)])                                               # .item(): host sync, once per token
    pos = len(prompt_ids)                                              # slot of the token being fed
    while not sink.done:
        logits, _ = runner.step(tok[None], pos)
        tok = pick_tokens(logits[:, -1], temperature, generator)
        sink.add([int(tok)])
        pos += 1
    return GenerationResult(sink.tokens, time.perf_counter() - t0)


class BatchGenerator:
    """Reusable batched decoder: one static cache of `max_len` slots for `batch_size` rows; any batch whose longest
    prompt + max_new_tokens fits reuses it (and the steps captured so far, one per attention window)."""

    def __init__(self, hf, batch_size: int, max_len: int, graphs: bool | None = None, kv_window: int | None = KV_WINDOW,
                 packed_gqa: bool = True):
        self.runner = TargetRunner.for_hf(hf, max_len, batch_size, (1,), graphs, kv_window, packed_gqa)
        self.last_steps = 0  # decoding steps (tokens per row, finished rows included) of the last generate()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=(), temperature: float = 0.0,
                 generator: torch.Generator | None = None, pad_id: int = 0) -> list[list[int]]:
        """Up to batch_size prompts -> their generated tokens (each ends after its first stop token, kept)."""
        run = self.runner
        n, b = len(prompts), run.batch_size
        if not 0 < n <= b or any(len(p) == 0 for p in prompts):
            raise ValueError(f"need 1..{b} non-empty prompts, got {n}")
        rows = [list(p) for p in prompts] + [[pad_id]] * (b - n)      # dummy rows keep the captured batch shape
        P = max(len(r) for r in rows)
        if P + max_new_tokens > run.max_len:
            raise ValueError(f"prompt of {P} tokens + {max_new_tokens} new exceeds the cache of {run.max_len} slots")
        pad = [P - len(r) for r in rows]
        ids = torch.tensor([[pad_id] * k + r for k, r in zip(pad, rows)])  # [b, P], left-padded
        stop = torch.tensor(sorted(set(int(t) for t in stop_ids)), dtype=torch.long, device=run.device)
        out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=run.device)

        logits, _ = run.prefill(ids, pad)
        tok = pick_tokens(logits[:, -1], temperature, generator)      # [b]
        out[:, 0] = tok
        finished = torch.isin(tok, stop)
        filled = 1
        while filled < max_new_tokens:
            if filled % STOP_CHECK_EVERY == 0 and bool(finished[:n].all()):
                break
            logits, _ = run.step(tok[:, None], P + filled - 1)
            tok = pick_tokens(logits[:, -1], temperature, generator)
            out[:, filled] = tok
            finished |= torch.isin(tok, stop)
            filled += 1
        self.last_steps = filled
        return [_cut_at_stop(row, stop_ids) for row in out[:n, :filled].tolist()]


def _cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    stop = set(int(t) for t in stop_ids)
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def generate_batch(target_hf, prompt_ids_list: list[list[int]], max_new_tokens: int, eos_ids=(),
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   graphs: bool | None = None) -> list[list[int]]:
    """Greedy (or sampled) generation for a batch of prompts with any HF causal LM: left-padded, static KV cache,
    CUDA-graphed decode step on GPU. Returns each prompt's new tokens, ending with its first eos token (kept) if
    one was produced. For many batches, keep one `BatchGenerator` (its graph is captured once)."""
    if not prompt_ids_list:
        return []
    max_len = max(len(p) for p in prompt_ids_list) + max_new_tokens
    gen = BatchGenerator(target_hf, len(prompt_ids_list), max_len, graphs)
    return gen.generate(prompt_ids_list, max_new_tokens, eos_ids, temperature, generator)
