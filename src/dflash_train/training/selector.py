"""DFlash 2's selector objective on the training layout (docs/DESIGN.md "DFlash 2: the selector objective").

At inference block position k drafts argmax (or a sample) over c in top-K(logit_k) of
    score_k(c) = logit_k(c) + <P[prev] * W h_k, S[c]>,   prev = the draft at k-1 (the anchor token at k = 1).
A draft at k counts only if the drafts before it were accepted, i.e. equal the target's tokens a+1..a+k-1. So
wherever a choice matters, prev is the true token a+k-1: teacher forcing with the sequence's own tokens is the
inference condition at every position that can be accepted, and the one-pass training layout stays exact.

Loss: cross-entropy of softmax(score_k) over the K candidates against the label's slot, at the positions whose label
is among the candidates (elsewhere no choice of the selector can be accepted), weighted by the same position
weights as the drafter's loss. The candidates and their logits come out of the drafter's own cross-entropy pass
(objective.blockwise_ce takes each chunk's top-K while its logits exist) and enter as constants: that cross-entropy
over the whole vocabulary trains the logits; the selector term trains the codebooks and the hidden projection (and,
through it, h).
The drafts for the acceptance metrics are the selector's teacher-forced picks, so acc@k, the tau estimate and each
block's accept_len measure what DFlash 2 decoding would accept.

Shapes are fixed (A anchors, B-1 positions, K candidates): the step compiles once.
"""

from __future__ import annotations

import torch

from ..models.drafter2 import CandidateSelector


def teacher_forced_picks(selector: CandidateSelector, h: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                         block_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [A, B-1, H], unary / candidates [A, B-1, K], block_ids [A, B], labels [A, B-1] -> (scores [A, B-1, K],
    the selector's pick [A, B-1]) with the true previous token as each position's predecessor."""
    prev = torch.cat([block_ids[:, :1], labels[:, :-1]], dim=1)                          # [A, B-1]
    scores = selector.scores(h, unary, candidates, prev)
    return scores, candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]


def selector_objective(selector: CandidateSelector, h: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                       block_ids: torch.Tensor, labels: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [A, B-1, H] drafter states, unary / candidates [A, B-1, K] (the top-K logits, constants, and their ids),
    block_ids [A, B], labels [A, B-1], weights [A, B-1] (position weight x valid) -> (selector loss, the selector's
    picks [A, B-1])."""
    scores, picks = teacher_forced_picks(selector, h, unary, candidates, block_ids, labels)
    scores = scores.float()
    hit = candidates == labels[..., None]                                                # [A, B-1, K]
    slot = hit.float().argmax(-1, keepdim=True)       # the label's candidate slot (0 where absent: weight 0 there)
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(-1, slot)[..., 0]
    w = weights * hit.any(-1).float()
    return (ce * w).sum() / w.sum().clamp_min(1e-6), picks
