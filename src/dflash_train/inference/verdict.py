"""The lossless verdict: is every token speculative decoding emitted the target's greedy choice given its prefix?

Comparing the speculative tokens with plain greedy decoding is exact only in exact arithmetic. The two paths compute
the target's logits in different passes (verification feeds B tokens at once, plain decoding one), and in bf16 the
different kernel shapes and reduction orders round a near-tie between the top two logits differently; from there on
the two texts differ, although each decoder followed its own logits correctly. So for every prompt whose speculative
output differs from plain decoding, the verdict re-scores the speculative output with ONE teacher-forced target
forward over prompt + speculative tokens (the decoding dtype) and checks each emitted token against the target's
argmax given that token's own prefix:

- the argmax: right;
- not the argmax, but its logit within the dtype's rounding of the top logit (`tie_bound`): a tie, which another
  pass may legitimately round the other way;
- otherwise: wrong. One wrong token makes the verdict NO, naming the prompt, the token and the logit gap.

The plain token at the first divergence is held to the same bound (both share the prefix there), so a divergence
caused by the plain path, not the speculative one, is not waved through either. A prompt that plain decoding did not
run (the evaluator times plain decoding on a subset) gets the same teacher-forced check on every token: the
definition itself, with no plain output to compare.

The bound: a logit x in a floating dtype with p significand bits (eps = 2^(1-p): bf16 2^-7, fp16 2^-10, fp32 2^-23)
sits on a grid of spacing ulp(x) = eps * 2^floor(log2|x|). Two passes that each round every logit once to that grid
can disagree on a difference of two logits by up to 2 ulps (half an ulp per logit per pass); the hidden state feeding
the LM head is itself rounded to the dtype in each pass, which moves both logits again by about as much. k = TIE_ULPS
= 4 ulps therefore covers what two passes can round apart (the first-mismatch margins seen on SmolLM2 in bf16 are
0 to 3 ulps at their logit magnitude), while a decoder bug (a draft token the target did not choose) leaves a gap of
ordinary logit size, hundreds of ulps. The bound is relative, so it holds for any target's logit scale; in fp32 it
is ~1e-6 at |x| ~ 20, so an fp32 verdict is exact in practice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIE_ULPS = 4  # a tie: the emitted token's logit within this many ulps of the top logit (module docstring)


def tie_bound(top: torch.Tensor, dtype: torch.dtype, k: float = TIE_ULPS) -> torch.Tensor:
    """top [...] (the top logits, any float dtype) -> k ulps of `dtype` at |top|: the largest gap a tie may have."""
    mag = top.float().abs().clamp_min(torch.finfo(dtype).tiny)            # log2(0) = -inf: use the smallest normal
    return k * torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))


@dataclass
class TokenCheck:
    """The emitted tokens judged against one teacher-forced pass (indices into the generated tokens)."""
    ties: list[int] = field(default_factory=list)          # not the argmax, within tie_bound of it
    tie_gaps: list[float] = field(default_factory=list)    # top logit minus the emitted token's logit there
    first_wrong: int | None = None                         # first token neither the argmax nor a tie
    wrong_gap: float | None = None                         # its gap


def judge_tokens(logits: torch.Tensor, tokens: list[int], dtype: torch.dtype, k: float = TIE_ULPS) -> TokenCheck:
    """logits [L, V] (row j: the target's logits before token j, computed in `dtype`), tokens [L] -> TokenCheck."""
    lg = logits.float()
    top, best = lg.max(dim=-1)                                             # [L], [L]
    emitted = lg.gather(1, torch.tensor(tokens, device=lg.device)[:, None])[:, 0]
    gaps = (top - emitted).tolist()                                        # >= 0; 0 with another argmax: exact tie
    bounds = tie_bound(top, dtype, k).tolist()
    check = TokenCheck()
    for j, (tok, first, g, b) in enumerate(zip(tokens, best.tolist(), gaps, bounds)):
        if tok == first:
            continue
        if g <= b:
            check.ties.append(j)
            check.tie_gaps.append(g)
        elif check.first_wrong is None:
            check.first_wrong, check.wrong_gap = j, g
    return check


@torch.no_grad()
def rescore(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One teacher-forced forward of the target (its own dtype) over prompt + tokens[:-1] -> logits [L, V], row j
    the target's next-token logits after prompt + tokens[:j]."""
    dev = next(hf.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=dev)
    return hf(input_ids=ids, logits_to_keep=len(tokens)).logits[0]


@dataclass
class PromptVerdict:
    kind: str                          # "identical" | "argmax" (judge_alone) | "tie" | "wrong"
    ties: list[int] = field(default_factory=list)
    tie_gaps: list[float] = field(default_factory=list)
    wrong_token: int | None = None     # first generated token that is neither the target's argmax nor a tie
    wrong_gap: float | None = None     # top logit minus that token's logit
    mismatch_margin: float | None = None  # top-1 minus top-2 logit at the first divergence from plain decoding
    plain_wrong: bool = False          # the divergence is the plain token's fault (speculative tokens all right)


def judge_alone(hf, prompt: list[int], spec: list[int], k: float = TIE_ULPS) -> PromptVerdict:
    """The verdict of a prompt that plain decoding did not run (evaluate's `timed`): one teacher-forced forward over
    every emitted token, "argmax" when each is the target's choice there, else "tie" or "wrong" as above."""
    if not spec:
        return PromptVerdict("argmax")
    check = judge_tokens(rescore(hf, prompt, spec), spec, next(hf.parameters()).dtype, k)
    kind = "wrong" if check.first_wrong is not None else "tie" if check.ties else "argmax"
    return PromptVerdict(kind, check.ties, check.tie_gaps, check.first_wrong, check.wrong_gap)


def judge_prompt(hf, prompt: list[int], plain: list[int], spec: list[int], first_mismatch: int | None,
                 k: float = TIE_ULPS) -> PromptVerdict:
    """Greedy outputs of one prompt -> its verdict (module docstring). One target forward when they differ."""
    if first_mismatch is None:
        return PromptVerdict("identical")
    dtype = next(hf.parameters()).dtype
    logits = rescore(hf, prompt, spec)                                     # [L, V]
    check = judge_tokens(logits, spec, dtype, k)
    v = PromptVerdict("wrong" if check.first_wrong is not None else "tie", check.ties, check.tie_gaps,
                      check.first_wrong, check.wrong_gap)
    if first_mismatch < min(len(plain), len(spec)):                        # the prefix is shared up to here
        row = logits[first_mismatch].float()
        top2 = row.topk(2).values
        v.mismatch_margin = float(top2[0] - top2[1])
        plain_gap = float(top2[0] - row[plain[first_mismatch]])
        if v.kind == "tie" and plain_gap > float(tie_bound(top2[0], dtype, k)):
            v.kind, v.plain_wrong = "wrong", True
            v.wrong_token, v.wrong_gap = first_mismatch, plain_gap
    return v
