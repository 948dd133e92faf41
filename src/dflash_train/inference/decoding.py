"""What every generation path shares: token choice from logits, the stop rule, and the result record.

Stop rule (the same as HF `generate`): the output ends after the first stop token (which is kept) or after
`max_new_tokens` tokens, whichever comes first. Speculative decoding appends accepted tokens through the same
`TokenSink`, so a stop token or the length limit in the middle of an accepted block cuts exactly where plain
decoding would have stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationResult:
    tokens: list[int]                     # generated tokens only (no prompt), ending with the stop token if any
    seconds: float                        # wall time from prefill to the last token, device synced
    accept_lengths: list[int] = field(default_factory=list)  # speculative only: tau per verification step

    @property
    def tau(self) -> float:
        """Mean acceptance length over this generation's steps (0 when no step ran)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


class TokenSink:
    """Collects generated tokens and says when to stop."""

    def __init__(self, max_new_tokens: int, stop_ids=()):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        self.max_new_tokens, self.stop_ids = max_new_tokens, frozenset(int(t) for t in stop_ids)
        self.tokens: list[int] = []
        self.done = False

    def add(self, tokens: list[int]) -> None:
        """Append tokens in order until a stop token (kept) or the length limit; the rest are dropped."""
        for t in tokens:
            if self.done:
                return
            self.tokens.append(t)
            self.done = t in self.stop_ids or len(self.tokens) >= self.max_new_tokens


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] in fp32 at this temperature (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [n, V] -> tokens [n] on the device: argmax at temperature 0, else one sample per row."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probs_from_logits(logits, temperature), 1, generator=generator)[:, 0]


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
