"""The lossless verdict (inference/verdict.py): the tie bound, the token classifier on synthetic logits, and the
whole evaluator in fp32 and bf16: a correct decoder says yes, a planted acceptance bug says NO naming the prompt and
the token, a constructed tie says `yes (... ties)`."""

from __future__ import annotations

import re

import pytest
import torch

from dflash_train.config import ModelConfig
from dflash_train.inference import batched, benchmark, speculative
from dflash_train.inference.benchmark import evaluate
from dflash_train.inference.report import format_summary, verdict_text
from dflash_train.inference.verdict import TIE_ULPS, judge_tokens, tie_bound
from dflash_train.models.build import build_drafter
from dflash_train.models.target import load_target, target_config_info

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

LAYERS = [1, 2]
PROMPTS = [[3, 4, 5], [7, 7, 8, 9], [20, 21], [50, 51, 52, 53, 54]]
NEW = 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ the bound and classifier

def test_tie_bound_is_k_ulps_at_the_logit_magnitude():
    x = torch.tensor([20.0, -20.0, 1.0, 0.75, 0.0])
    bf16 = tie_bound(x, torch.bfloat16).tolist()
    assert bf16[:4] == [TIE_ULPS * 2.0 ** (4 - 7), TIE_ULPS * 2.0 ** (4 - 7), TIE_ULPS * 2.0 ** -7,
                        TIE_ULPS * 2.0 ** -8]
    assert 0 < bf16[4] < 1e-30                                 # 0: the smallest normal's ulp, not nan
    assert tie_bound(x[:1], torch.float32).item() == TIE_ULPS * 2.0 ** (4 - 23)
    assert tie_bound(x[:1], torch.float16).item() == TIE_ULPS * 2.0 ** (4 - 10)
    # the bound is on bf16's own grid at 20: 20 - bound is representable, the next value below is one ulp further
    assert torch.tensor(20.0 - bf16[0], dtype=torch.bfloat16).item() == 20.0 - bf16[0]


def test_judge_tokens_on_synthetic_bf16_logits():
    ulp = 2.0 ** (4 - 7)                                         # bf16 at |x| in [16, 32)
    rows = []
    for second in (20.0 - 3, 20.0 - ulp, 20.0 - TIE_ULPS * ulp, 20.0 - (TIE_ULPS + 1) * ulp, 20.0 - 2.125, 20.0):
        r = torch.full((8,), -5.0)
        r[2], r[5] = 20.0, second
        rows.append(r)
    logits = torch.stack(rows).to(torch.bfloat16)                # [6, 8]: every value exact in bf16
    check = judge_tokens(logits, [2, 5, 5, 5, 5, 5], torch.bfloat16)
    # 0: the argmax; 1 and 2: within 4 ulps; 5: an exact tie that argmax breaks toward 2; 3: 5 ulps, the first wrong
    assert check.ties == [1, 2, 5] and check.tie_gaps == [ulp, TIE_ULPS * ulp, 0.0]
    assert check.first_wrong == 3 and check.wrong_gap == (TIE_ULPS + 1) * ulp
    # the same gaps in fp32 are far beyond fp32's rounding: every non-argmax token but the exact tie is wrong
    check32 = judge_tokens(logits.float(), [2, 5, 5, 5, 5, 5], torch.float32)
    assert check32.ties == [5] and check32.first_wrong == 1


def test_verdict_text_words():
    base = dict(num_prompts=80, identical_prompts=44, dtype="bf16", tie_prompts=0, wrong_prompts=0,
                first_wrong=None)
    assert verdict_text(dict(base, lossless=None)).startswith("n/a (sampling")
    assert verdict_text(dict(base, lossless=True, identical_prompts=80)) == "yes (80/80 identical)"
    assert verdict_text(dict(base, lossless=True, tie_prompts=36)) == \
        "yes (44/80 identical, 36 diverge only at bf16 ties)"
    wrong = dict(prompt=7, id=None, token=31, gap=2.1, plain=False)
    assert verdict_text(dict(base, lossless=False, wrong_prompts=1, first_wrong=wrong)) == \
        "NO: prompt 7 diverges at token 31, margin 2.1"
    assert verdict_text(dict(base, lossless=False, wrong_prompts=3, first_wrong=dict(wrong, id="math_03"))) == \
        "NO: prompt 7 (math_03) diverges at token 31, margin 2.1 (3/80 prompts wrong)"
    assert verdict_text(dict(base, lossless=False, wrong_prompts=1, first_wrong=dict(wrong, plain=True))) == \
        "NO: prompt 7: plain decoding diverges at token 31, margin 2.1"
    # an eval.json summary from before the re-scoring verdict
    assert verdict_text(dict(lossless=False, num_prompts=32, identical_prompts=17)) == "NO (17/32 identical)"


# ------------------------------------------------------------------------------------------ the whole evaluator

@pytest.fixture(scope="module", params=list(DTYPES))
def setup(request, tiny_llama):
    dtype = DTYPES[request.param]
    t = load_target(tiny_llama, LAYERS, dtype=dtype, truncate=False)
    torch.manual_seed(0)
    cfg = ModelConfig(target_layer_ids=LAYERS, mask_token_id=t.info.vocab_size - 1, block_size=4,
                      num_draft_layers=1)
    return request.param, t, build_drafter(cfg, target_config_info(tiny_llama))


def greedy_check(t, prompt: list[int], tokens: list[int]) -> list[tuple[int, float, float]]:
    """Obviously correct, independent of verdict.py: one full forward per token -> (argmax, its logit, the token's
    logit) before each token."""
    out = []
    with torch.no_grad():
        for j in range(len(tokens)):
            row = t.hf(input_ids=torch.tensor([prompt + tokens[:j]])).logits[0, -1].float()
            out.append((int(row.argmax()), float(row.max()), float(row[tokens[j]])))
    return out


def test_correct_decoder_is_lossless(setup):
    name, t, drafter = setup
    rep = evaluate(t, drafter, PROMPTS, NEW, warmup=False)
    s = rep.summary()
    assert s["lossless"] is True and s["wrong_prompts"] == 0 and s["first_wrong"] is None
    assert s["identical_prompts"] + s["tie_prompts"] == len(PROMPTS)
    text = verdict_text(s)
    assert s["verdict"] == text
    assert text.startswith(f"yes ({s['identical_prompts']}/{len(PROMPTS)} identical")
    if name == "fp32":  # fp32 paths agree to ~1e-6: identical outputs
        assert text == f"yes ({len(PROMPTS)}/{len(PROMPTS)} identical)"
    assert all(p.verdict in ("identical", "tie") for p in rep.prompts)
    assert text in format_summary(rep)


def one_too_many(real):
    """An acceptance bug: after a rejection, also accept the rejected draft token (when the block has room)."""
    def accept(target_logits, draft):
        n, emitted, last = real(target_logits, draft)
        B = target_logits.shape[0]
        if n >= B - 1:
            return n, emitted, last
        choice = target_logits.argmax(-1)
        return n + 1, draft[: n + 1].tolist() + [int(choice[n + 1])], choice[n + 1: n + 2]
    return accept


def test_planted_acceptance_bug_is_no_naming_prompt_and_token(setup, monkeypatch):
    name, t, drafter = setup
    buggy = 2
    real_spec, real_accept = speculative.speculative_generate, speculative.accept_greedy

    def spec_generate(t_run, d_run, prompt, *args, **kw):   # the bug strikes on one prompt only
        monkeypatch.setattr(speculative, "accept_greedy", one_too_many(real_accept) if prompt == PROMPTS[buggy]
                            else real_accept)
        return real_spec(t_run, d_run, prompt, *args, **kw)

    monkeypatch.setattr(benchmark, "speculative_generate", spec_generate)
    rep = evaluate(t, drafter, PROMPTS, NEW, warmup=False)
    s = rep.summary()
    assert s["lossless"] is False and s["wrong_prompts"] == 1
    w = s["first_wrong"]
    assert w["prompt"] == buggy and not w["plain"] and rep.prompts[buggy].verdict == "wrong"
    # the named token is really not the target's choice, by a gap beyond rounding, and every token before it is
    # the choice (fp32) or within rounding of it (bf16)
    spec = rep.prompts[buggy].speculative
    checks = greedy_check(t, PROMPTS[buggy], spec)
    best, top, mine = checks[w["token"]]
    assert best != spec[w["token"]] and w["gap"] == pytest.approx(top - mine, rel=0.05, abs=1e-2)
    assert w["gap"] > float(tie_bound(torch.tensor(top), DTYPES[name]))
    for j, (best, top, mine) in enumerate(checks[: w["token"]]):
        assert best == spec[j] or (name == "bf16" and top - mine <= float(tie_bound(torch.tensor(top),
                                                                                     torch.bfloat16)))
    assert re.fullmatch(rf"NO: prompt {buggy} diverges at token {w['token']}, margin [0-9.e-]+", verdict_text(s))
    assert rep.to_dict()["prompts"][buggy]["verdict"] == "wrong"


def test_constructed_tie_is_yes_with_ties(setup, tiny_llama, monkeypatch):
    """Token b's LM-head row is a copy of token a's, so wherever a is the target's choice, b ties it exactly; a decoder
    that breaks that tie toward b (as another pass's rounding might) diverges from plain decoding, losslessly."""
    name, _, drafter = setup
    t = load_target(tiny_llama, LAYERS, dtype=DTYPES[name], truncate=False)   # a private copy to edit
    base = evaluate(t, drafter, PROMPTS, NEW, warmup=False)
    counts: dict[int, int] = {}
    for p in base.prompts:
        for tok in p.baseline[1:]:                                            # tokens chosen by decode steps
            counts[tok] = counts.get(tok, 0) + 1
    a = max(counts, key=counts.get)
    b = t.info.vocab_size - 2                                                 # not the mask token
    assert a < b
    with torch.no_grad():
        t.hf.lm_head.weight[b] = t.hf.lm_head.weight[a]

    real_accept = speculative.accept_greedy

    def toward_b(target_logits, draft):
        choice = target_logits.argmax(-1)
        choice = torch.where(choice == a, torch.full_like(choice, b), choice)  # break the a/b tie toward b
        logits = torch.full_like(target_logits, -1e4).scatter_(1, choice[:, None], 0.0)
        return real_accept(logits, draft)

    monkeypatch.setattr(speculative, "accept_greedy", toward_b)
    rep = evaluate(t, drafter, PROMPTS, NEW, warmup=False)
    s = rep.summary()
    assert s["lossless"] is True and s["tie_prompts"] >= 1 and s["wrong_prompts"] == 0
    tied = [p for p in rep.prompts if p.verdict == "tie"]
    assert all(p.speculative[p.first_mismatch] == b and p.baseline[p.first_mismatch] == a for p in tied)
    assert all(p.tie_tokens and p.speculative[j] == b for p in tied for j in p.tie_tokens)
    assert verdict_text(s) == (f"yes ({s['identical_prompts']}/{len(PROMPTS)} identical, {s['tie_prompts']} "
                               f"diverge only at {name} ties)")


def test_a_wrong_plain_token_is_not_waved_through(setup, monkeypatch):
    """The divergence is held to the same bound on the plain side: a baseline bug is NO too, and says so."""
    _, t, drafter = setup
    real = benchmark.target_generate

    def plain_generate(t_run, prompt, *args, **kw):
        out = real(t_run, prompt, *args, **kw)
        if prompt == PROMPTS[1]:
            out.tokens[3] = (out.tokens[3] + 1) % (t.info.vocab_size - 1)
        return out

    monkeypatch.setattr(benchmark, "target_generate", plain_generate)
    s = evaluate(t, drafter, PROMPTS, NEW, warmup=False).summary()
    assert s["lossless"] is False and s["first_wrong"]["plain"] and s["first_wrong"]["token"] == 3
    assert s["verdict"].startswith("NO: prompt 1: plain decoding diverges at token 3, margin ")


# ------------------------------------------------------------------------------- plain decoding on a subset (timed)

def test_timed_indices_spread_evenly():
    assert benchmark.timed_indices(80, 16) == set(range(0, 80, 5))
    assert benchmark.timed_indices(5, 2) == {0, 2}
    assert benchmark.timed_indices(4, None) == benchmark.timed_indices(4, 9) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="at least 1"):
        benchmark.timed_indices(4, 0)


def test_untimed_prompts_are_checked_token_by_token(setup):
    """Plain decoding on 2 of 4 prompts: the other two get no plain output and no plain time, their verdict comes
    from the teacher-forced check alone, and every token they emit is the target's choice (or a tie in bf16)."""
    name, t, drafter = setup
    full = evaluate(t, drafter, PROMPTS, NEW, warmup=False)
    rep = evaluate(t, drafter, PROMPTS, NEW, warmup=False, timed=2)
    s = rep.summary()
    assert [p.timed for p in rep.prompts] == [True, False, True, False] and s["timed_prompts"] == 2
    assert [bool(p.baseline) for p in rep.prompts] == [True, False, True, False]
    assert [p.speculative for p in rep.prompts] == [p.speculative for p in full.prompts]
    for i in (1, 3):
        p = rep.prompts[i]
        assert p.baseline_s == 0.0 and p.first_mismatch is None and p.verdict in ("argmax", "tie")
        for j, (best, top, mine) in enumerate(greedy_check(t, PROMPTS[i], p.speculative)):
            assert (best == p.speculative[j]) == (j not in p.tie_tokens)
        assert p.tau_estimate == pytest.approx(full.prompts[i].tau_estimate, abs=1e-6) or name == "bf16"
    if name == "fp32":
        assert [p.verdict for p in rep.prompts] == ["identical", "argmax", "identical", "argmax"]
    assert s["lossless"] is True and s["identical_prompts"] + s["argmax_prompts"] + s["tie_prompts"] == 4
    # the speedup's plain rate comes from the timed prompts alone
    timed = [rep.prompts[0], rep.prompts[2]]
    ms = 1000 * sum(p.baseline_s for p in timed) / sum(len(p.baseline) for p in timed)
    assert s["baseline_ms_per_token"] == pytest.approx(ms)
    assert s["verdict"].startswith(f"yes ({s['identical_prompts'] + s['argmax_prompts']}/4 the target's argmax "
                                   "at every token")
    assert "plain decoding timed on 2 of them" in format_summary(rep)


@pytest.mark.parametrize("batch_rows", [1, 4])
def test_planted_bug_on_an_untimed_prompt_is_no(setup, monkeypatch, batch_rows):
    """The bug strikes on prompt 3, which plain decoding skips: decoded alone (batch_rows=1) or as row 1 of the
    untimed prompts decoded together (prompts 1 and 3)."""
    name, t, drafter = setup
    real_spec, real_accept = speculative.speculative_generate, speculative.accept_greedy

    def spec_generate(t_run, d_run, prompt, *args, **kw):
        monkeypatch.setattr(speculative, "accept_greedy", one_too_many(real_accept) if prompt == PROMPTS[3]
                            else real_accept)
        return real_spec(t_run, d_run, prompt, *args, **kw)

    real_agreed = batched.agreed_drafts

    def agreed_one_too_many_on_row_1(drafts, choice):
        agreed = real_agreed(drafts, choice)
        agreed[1] = min(int(agreed[1]) + 1, drafts.shape[1])
        return agreed

    monkeypatch.setattr(benchmark, "speculative_generate", spec_generate)
    monkeypatch.setattr(batched, "agreed_drafts", agreed_one_too_many_on_row_1)
    rep = evaluate(t, drafter, PROMPTS, NEW, warmup=False, timed=2, batch_rows=batch_rows)
    s = rep.summary()
    assert not rep.prompts[3].timed and rep.prompts[3].verdict == "wrong"
    assert s["lossless"] is False and s["first_wrong"]["prompt"] == 3 and not s["first_wrong"]["plain"]
    best, top, mine = greedy_check(t, PROMPTS[3], rep.prompts[3].speculative)[s["first_wrong"]["token"]]
    assert best != rep.prompts[3].speculative[s["first_wrong"]["token"]]
    assert s["verdict"].startswith("NO: prompt 3 diverges at token ")


def test_verdict_text_with_untimed_prompts():
    s = dict(num_prompts=80, timed_prompts=16, identical_prompts=10, argmax_prompts=40, dtype="bf16",
             tie_prompts=30, wrong_prompts=0, first_wrong=None, lossless=True)
    assert verdict_text(s) == "yes (50/80 the target's argmax at every token, 30 with bf16 ties)"
    assert verdict_text(dict(s, argmax_prompts=70, tie_prompts=0)) == "yes (80/80 the target's argmax at every token)"
