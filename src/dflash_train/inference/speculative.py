"""Lossless DFlash speculative decoding of one prompt (docs/DESIGN.md "Inference").

1. Prefill the target on the prompt with feature taps; the first new token comes from its last logits and the
   drafter's context is the prompt's features (positions 0..P-1).
2. Draft: the block [last, MASK x (B-1)] at positions start..start+B-1 -> B-1 draft tokens in one drafter pass.
3. Verify: the target runs [last, d_1 .. d_{B-1}] at positions start..start+B-1 in one pass over its KV cache.
4. Accept the longest prefix d_1..d_n that the target agrees with, plus one token of the target's own (the bonus);
   the step's acceptance length is tau = n + 1 (1 <= tau <= B).
5. Both caches are cut to the accepted length by position (see target_runner / drafter_runner: stale slots are
   masked and later overwritten); the verification pass already computed the features of last, d_1..d_n, which
   become the drafter's new context. start += n + 1.

Acceptance rule
- Greedy (temperature 0): draft = the drafter's argmax; d_k is accepted while it equals the target's argmax at that
  position; the bonus is the target's argmax after the accepted prefix. The output is the target's greedy output,
  token for token.
- Sampling (temperature T > 0): standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Each d_k
  is sampled from the drafter's own q_k = softmax(drafter logits / T) and accepted with probability
  min(1, p_k(d_k) / q_k(d_k)), p_k = softmax(target logits / T) given the accepted prefix. At the first rejection
  the step emits a sample of norm(max(0, p_k - q_k)) and ends; if all B-1 are accepted, the bonus is a sample of
  p_B. Each emitted token is then distributed exactly as the target's own sample given the tokens before it. The
  proof needs q_k to be the distribution d_k was drawn from given the context and d_1..d_{k-1}: for DFlash the
  drafter proposes every position in one parallel pass and the draws are independent; DFlash 2's selector draws
  d_k from its softmax over candidates given d_{k-1} (speculative sampling's usual autoregressive draft), and
  that softmax, zero outside the candidates, is its q_k.
Stop tokens and max_new_tokens cut accepted blocks through the same TokenSink as plain decoding.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from .decoding import GenerationResult, TokenSink, device_sync, pick_tokens, probs_from_logits
from .target_runner import TargetRunner


class DraftSource(Protocol):
    """What the loop needs from a drafter (DrafterRunner, or a test double)."""
    block_size: int

    def begin(self, prompt_feats: torch.Tensor) -> None: ...                 # feats [P, k*H]
    def extend(self, block_feats: torch.Tensor, block_start: int) -> None: ...  # feats [B, k*H]
    def draft(self, last_token: torch.Tensor, start: int) -> torch.Tensor: ...  # -> logits [B-1, V]


def draft_tokens(drafter: DraftSource, last: torch.Tensor, start: int, temperature: float,
                 generator: torch.Generator | None = None):
    """-> (draft tokens [B-1], q [B-1, V] or None at temperature 0). A drafter with a proposal rule of its own
    (DFlash 2's candidate selector: drafter_runner.Drafter2Runner.propose) applies it; otherwise the drafts come
    from its logits (`propose`)."""
    own = getattr(drafter, "propose", None)
    if own is not None:
        return own(last, start, temperature, generator)
    return propose(drafter.draft(last, start), temperature, generator)


def propose(draft_logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """draft_logits [B-1, V] -> (draft tokens [B-1], q [B-1, V] or None at temperature 0)."""
    if temperature <= 0:
        return draft_logits.argmax(dim=-1), None
    q = probs_from_logits(draft_logits, temperature)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q


def accept_greedy(target_logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, list[int], torch.Tensor]:
    """target_logits [B, V] (row j: the target's next token after block token j), draft [B-1]
    -> (n accepted, emitted tokens d_1..d_n + bonus, bonus as a [1] device tensor). One host sync."""
    choice = target_logits.argmax(dim=-1)                                   # [B]
    B = choice.shape[0]
    vals = torch.cat([draft, choice]).tolist()
    drafts, choices = vals[: B - 1], vals[B - 1:]
    n = 0
    while n < B - 1 and drafts[n] == choices[n]:
        n += 1
    return n, drafts[:n] + [choices[n]], choice[n: n + 1]


def accept_sampled(target_logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor, temperature: float,
                   generator: torch.Generator | None = None) -> tuple[int, list[int], torch.Tensor]:
    """Speculative sampling (module docstring). target_logits [B, V], draft [B-1], q [B-1, V]. One host sync:
    the replacement token for every possible rejection point is drawn up front, vectorised."""
    p = probs_from_logits(target_logits, temperature)                      # [B, V]
    B = p.shape[0]
    rows = torch.arange(B - 1, device=p.device)
    ratio = p[rows, draft] / q[rows, draft]                                # q(d) > 0: d was sampled from q
    u = torch.rand(B - 1, device=p.device, generator=generator)
    accepted = u < ratio                                                   # prob min(1, p/q)
    residual = (p[:-1] - q).clamp_min_(0)
    # Where p <= q everywhere the rejection probability is 0: any finite distribution will do, never used.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:-1])
    fix = torch.multinomial(residual, 1, generator=generator)[:, 0]        # [B-1] token if rejected at k
    bonus = torch.multinomial(p[-1:], 1, generator=generator)[:, 0]        # [1] token if all accepted
    ends = torch.cat([fix, bonus])                                         # [B]: the step's last token per n
    vals = torch.cat([accepted.long(), ends, draft]).tolist()
    acc, end_tokens, drafts = vals[: B - 1], vals[B - 1: 2 * B - 1], vals[2 * B - 1:]
    n = 0
    while n < B - 1 and acc[n]:
        n += 1
    return n, drafts[:n] + [end_tokens[n]], ends[n: n + 1]


@torch.no_grad()
def speculative_generate(target: TargetRunner, drafter: DraftSource, prompt_ids: list[int], max_new_tokens: int,
                         temperature: float = 0.0, stop_ids=(),
                         generator: torch.Generator | None = None) -> GenerationResult:
    """Generate for one prompt. `target` needs a q = B step (B = drafter.block_size); both caches need
    max_len >= len(prompt_ids) + max_new_tokens + B."""
    B = drafter.block_size
    sink = TokenSink(max_new_tokens, stop_ids)
    device_sync(target.device)
    t0 = time.perf_counter()
    logits, feats = target.prefill(torch.tensor([prompt_ids]))             # [1, 1, V], [1, P, k*H]
    drafter.begin(feats[0])
    last = pick_tokens(logits[0, -1:], temperature, generator)             # [1] on the device
    sink.add([int(last)])
    start = len(prompt_ids)                                                # position of `last`
    accept_lengths: list[int] = []
    while not sink.done:
        draft, q = draft_tokens(drafter, last, start, temperature, generator)       # [B-1]
        t_logits, t_feats = target.step(torch.cat([last, draft])[None], start)    # [1, B, V], [1, B, k*H]
        if q is None:
            n, emitted, last = accept_greedy(t_logits[0], draft)
        else:
            n, emitted, last = accept_sampled(t_logits[0], draft, q, temperature, generator)
        accept_lengths.append(n + 1)
        drafter.extend(t_feats[0], start)                                  # rows 0..n become context
        start += n + 1
        sink.add(emitted)
    assert all(1 <= a <= B for a in accept_lengths)
    return GenerationResult(sink.tokens, time.perf_counter() - t0, accept_lengths)
