"""Batched speculative decoding (inference/batched.py): every row takes the steps it takes alone.

The references are one-prompt decoding (speculative.py, itself pinned to naive greedy in test_inference.py) and the
one-sequence drafter runner. Drafts that the target accepts in part come from a scripted drafter (the target's own
greedy continuation, each token corrupted by a rule keyed on prompt, position and block index), so that rows keep
different numbers of tokens at every step and the target's holes and offsets are exercised.
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash_train.inference.baseline import target_generate
from dflash_train.inference.batched import BatchedDrafterRunner, decode_batched, speculative_generate_batch
from dflash_train.inference.benchmark import evaluate
from dflash_train.inference.drafter_runner import DrafterRunner
from dflash_train.inference.speculative import speculative_generate
from dflash_train.inference.target_runner import TargetRunner
from dflash_train.models.target import load_target
from test_inference import LAYERS, V, eval_setup, make_drafter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

B, NEW = 4, 21
LENGTHS = [1, 3, 9, 17, 30, 5, 2]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tiny_llama, tiny_qwen3):
    path = {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]
    return path, load_target(path, LAYERS, truncate=False)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in lengths]


def proposal(sequence: list[int], key: int, start: int, k: int, p_correct: float) -> int:
    """The scripted draft at position start + k: the known token, or another where the rule says so."""
    pos = start + k
    tok = sequence[pos] if pos < len(sequence) else 0
    return tok if random.Random(hash((key, start, k))).random() < p_correct else (tok + 1) % V


class Scripted:
    """One-prompt DraftSource double (speculative.py's interface)."""

    def __init__(self, sequence, key, p_correct):
        self.sequence, self.key, self.p, self.block_size = sequence, key, p_correct, B

    def begin(self, prompt_feats):
        pass

    def extend(self, block_feats, block_start):
        pass

    def draft(self, last_token, start):
        logits = torch.zeros(B - 1, V)
        for k in range(1, B):
            logits[k - 1, proposal(self.sequence, self.key, start, k, self.p)] = 1.0
        return logits


class ScriptedRows:
    """The same drafts for rows of prompts (BatchedDrafterRunner's interface)."""

    def __init__(self, sequences, keys, p_correct, rows):
        self.sequences, self.keys, self.rows, self.block_size = sequences, keys, rows, B
        self.p = p_correct if isinstance(p_correct, list) else [p_correct] * len(sequences)
        self.starts: list[list[int]] = []  # each step's row positions

    def begin(self, prompt_feats, lengths):
        assert prompt_feats.shape[0] == self.rows == len(lengths)

    def extend(self, block_feats, starts):
        assert block_feats.shape[:2] == (self.rows, B)

    def draft(self, last, starts):
        logits = torch.zeros(self.rows, B - 1, V)
        self.starts.append(starts.tolist())
        for r, start in enumerate(starts.tolist()[: len(self.sequences)]):
            for k in range(1, B):
                logits[r, k - 1, proposal(self.sequences[r], self.keys[r], start, k, self.p[r])] = 1.0
        return logits

    def propose_rows(self, last, starts):
        return self.draft(last, starts).argmax(-1)


@pytest.mark.parametrize("p_correct", [0.0, 0.7, 1.0])
def test_rows_keeping_different_lengths_decode_as_each_alone(target, p_correct):
    """Lossless and step for step: every row's tokens and acceptance lengths are those of its prompt decoded alone,
    with rows that keep 1..B tokens a step side by side, finish at different steps (a stop token mid-block, the
    length limit), and a spare row when the batch is not full."""
    _, t = target
    prompts = prompts_of(LENGTHS)
    max_len = max(LENGTHS) + B * (NEW + 1)
    t_one = TargetRunner.for_target(t, max_len, step_lens=(1, B))
    greedy = [target_generate(t_one, p, NEW + B).tokens for p in prompts]
    stop = (greedy[2][5],)  # one prompt stops early, at a token it emits mid-block
    sequences = [p + g for p, g in zip(prompts, greedy)]
    alone = [speculative_generate(t_one, Scripted(s, i, p_correct), p, NEW, stop_ids=stop)
             for i, (s, p) in enumerate(zip(sequences, prompts))]
    rows = len(prompts) + 1
    t_rows = TargetRunner.for_target(t, max_len, step_lens=(B,), batch_size=rows)
    together = speculative_generate_batch(t_rows, ScriptedRows(sequences, range(len(prompts)), p_correct, rows),
                                          prompts, NEW, stop_ids=stop)
    assert [tokens for tokens, _ in together] == [a.tokens for a in alone]
    assert [steps for _, steps in together] == [a.accept_lengths for a in alone]
    assert len(together[2][0]) < NEW and together[2][0][-1] == stop[0]
    kept = {a for _, steps in together for a in steps}
    if p_correct == 0.0:
        assert kept == {1}
    elif p_correct == 1.0:
        assert kept == {B}
    else:
        assert len(kept) > 2  # rows kept different numbers of tokens in the same steps


def test_a_finished_row_stops_moving(tiny_llama):
    """A row done at its first token keeps no later block, even one its drafts would fill: its position stays where
    it ended (the caches were sized for the tokens rows keep) while the other row decodes on."""
    t = load_target(tiny_llama, LAYERS, truncate=False)
    prompts = prompts_of([4, 6])
    t_one = TargetRunner.for_target(t, 200, step_lens=(1, B))
    greedy = [target_generate(t_one, p, NEW + B).tokens for p in prompts]
    stop = (greedy[0][0],)
    assert stop[0] not in greedy[1][:NEW]  # the other row runs to the length limit
    drafts = ScriptedRows([p + g for p, g in zip(prompts, greedy)], [0, 1], [1.0, 0.0], 2)
    t_rows = TargetRunner.for_target(t, 6 + B * (NEW + 1), step_lens=(B,), batch_size=2)
    together = speculative_generate_batch(t_rows, drafts, prompts, NEW, stop_ids=stop)
    assert together[0] == ([stop[0]], []) and len(together[1][0]) == NEW
    assert {starts[0] for starts in drafts.starts} == {len(prompts[0])}


def test_the_batched_drafter_drafts_what_the_single_one_drafts(target):
    """Same context, same block: the batched runner's logits per row equal the one-sequence runner's, after the
    prompt and after an extension of which each row keeps a different number of rows."""
    path, t = target
    drafter = make_drafter(path, B, seed=3)
    prompts = prompts_of([2, 7, 11])
    max_len = 40
    feats = [t.features(torch.tensor(p), torch.arange(len(p)), torch.zeros(len(p), dtype=torch.long))
             for p in prompts]
    P = max(len(p) for p in prompts)
    padded = torch.zeros(len(prompts), P, feats[0].shape[-1])
    for r, f in enumerate(feats):
        padded[r, P - f.shape[0]:] = f
    rows = BatchedDrafterRunner(drafter, t, len(prompts), max_len, B)
    rows.begin(padded, [len(p) for p in prompts])
    last = torch.tensor([5, 6, 7])
    starts = torch.tensor([len(p) for p in prompts])
    block = torch.randn(len(prompts), B, feats[0].shape[-1], generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([1, 3, 4])
    first = rows.draft(last, starts).clone()
    rows.extend(block, starts)
    second = rows.draft(last + 1, starts + keep).clone()
    for r, p in enumerate(prompts):
        one = DrafterRunner(drafter, t, max_len, B)
        one.begin(feats[r])
        torch.testing.assert_close(one.draft(last[r:r + 1], len(p)), first[r], rtol=1e-5, atol=1e-5)
        one.extend(block[r], len(p))
        torch.testing.assert_close(one.draft(last[r:r + 1] + 1, len(p) + int(keep[r])), second[r], rtol=1e-5,
                                   atol=1e-5)


def test_decode_batched_with_the_real_drafter_equals_one_prompt_decoding(target):
    """decode_batched (the runners built for it, prompts in chunks of `rows`) gives each prompt's own decoding."""
    path, t = target
    drafter = make_drafter(path, B, seed=1)
    prompts = prompts_of(LENGTHS, seed=2)
    max_len = max(LENGTHS) + NEW + B
    t_one = TargetRunner.for_target(t, max_len, step_lens=(1, B))
    d_one = DrafterRunner(drafter, t, max_len, B)
    alone = [speculative_generate(t_one, d_one, p, NEW) for p in prompts]
    for rows in (3, 16):
        together = decode_batched(t, drafter, prompts, NEW, B, rows=rows)
        assert [tok for tok, _ in together] == [a.tokens for a in alone]
        assert [steps for _, steps in together] == [a.accept_lengths for a in alone]


def test_evaluate_decodes_untimed_prompts_together_with_the_same_report(tiny_llama):
    """evaluate with batch_rows: the untimed prompts' tau, tokens and verdicts are those of one-at-a-time decoding;
    the speedup comes from the timed prompts alone (speculative_s 0 on the others)."""
    t = load_target(tiny_llama, LAYERS, truncate=False)
    drafter = make_drafter(tiny_llama, B, seed=1)
    prompts = prompts_of(LENGTHS, seed=4)
    one = evaluate(t, drafter, prompts, NEW, timed=2, batch_rows=1)
    rows = evaluate(t, drafter, prompts, NEW, timed=2, batch_rows=4)
    for a, b in zip(one.prompts, rows.prompts):
        assert (a.speculative, a.accept_lengths, a.verdict, a.timed) == (b.speculative, b.accept_lengths, b.verdict,
                                                                       b.timed)
        assert b.timed or b.speculative_s == 0.0
    assert sum(p.timed for p in rows.prompts) == 2 and rows.summary()["speedup"] is not None
    assert rows.summary()["mean_tau"] == one.summary()["mean_tau"] and rows.summary()["lossless"]


def test_a_batch_needs_room_for_every_row(tiny_llama):
    t = load_target(tiny_llama, LAYERS, truncate=False)
    t_rows = TargetRunner.for_target(t, 30, step_lens=(B,), batch_size=2)
    drafts = ScriptedRows([[1] * 60] * 2, [0, 1], 1.0, 2)
    with pytest.raises(ValueError, match="3 prompts for 2 rows"):
        speculative_generate_batch(t_rows, drafts, [[1], [2], [3]], 4)
    with pytest.raises(ValueError, match="need 45 target slots; the runner has 30"):
        speculative_generate_batch(t_rows, drafts, [[1], [2]], 10)


def test_eval_cli_batch_rows(eval_setup, capsys):
    """`dflash-train eval --timed-prompts 1 --batch-rows 2`: the untimed prompts decoded together, lossless, the same
    tau as one at a time; --batch-rows 0 is one clear error."""
    import json

    from dflash_train.cli import main

    root, target, drafter, prompts = eval_setup
    args = ["eval", "--drafter", drafter, "--target", target, "--prompts", prompts, "--max-new-tokens", "20",
            "--device", "cpu", "--timed-prompts", "1"]
    reports = {}
    for rows in ("1", "2"):
        assert main(args + ["--batch-rows", rows, "--out", str(root / f"rows{rows}")]) == 0
        reports[rows] = json.loads((root / f"rows{rows}" / "eval.json").read_text())
    one, two = reports["1"], reports["2"]
    assert two["summary"]["lossless"] is True and two["summary"]["timed_prompts"] == 1
    assert [p["speculative"] for p in two["prompts"]] == [p["speculative"] for p in one["prompts"]]
    assert two["summary"]["mean_tau"] == one["summary"]["mean_tau"] and two["summary"]["speedup"] > 0
    capsys.readouterr()
    assert main(args + ["--batch-rows", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-rows must be at least 1" in err[0]


def test_a_failed_batch_is_a_warning_and_one_at_a_time(tiny_llama, monkeypatch, caplog):
    """If decoding together fails, evaluate says so and decodes those prompts one at a time: the same report."""
    import logging

    from dflash_train.inference import benchmark

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (planted)")

    t = load_target(tiny_llama, LAYERS, truncate=False)
    drafter = make_drafter(tiny_llama, B, seed=1)
    prompts = prompts_of(LENGTHS[:4], seed=5)
    one = evaluate(t, drafter, prompts, NEW, timed=1, batch_rows=1)
    monkeypatch.setattr(benchmark, "decode_batched", broken)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        rows = evaluate(t, drafter, prompts, NEW, timed=1, batch_rows=4)
    assert "decoding the untimed prompts together failed (RuntimeError: CUDA out of memory (planted))" in caplog.text
    assert [(p.speculative, p.accept_lengths) for p in rows.prompts] == \
        [(p.speculative, p.accept_lengths) for p in one.prompts]
    assert all(p.speculative_s > 0 for p in rows.prompts)  # decoded alone, as before


def test_rows_that_fit_half_the_memory(tiny_llama):
    from dflash_train.inference.batched import rows_that_fit

    t = load_target(tiny_llama, LAYERS, truncate=False)
    info = t.info
    per_slot = info.num_layers * 2 * info.num_key_value_heads * info.head_dim * 4  # fp32 K and V, every layer
    assert rows_that_fit(t, 100, 8) == 8
    assert rows_that_fit(t, (4 << 30) // (3 * per_slot), 8) == 3  # a CPU's budget is 4 GiB
    assert rows_that_fit(t, 10 ** 12, 8) == 1  # always at least one row


def test_rows_that_fit_count_what_the_allocator_holds_idle(monkeypatch):
    """After the demo's training the caching allocator keeps the feature cache's freed memory reserved; the driver
    counts it as taken, this process can reuse it. (Was: mem_get_info's free alone, ~8 GiB of an H200.)"""
    import types

    from dflash_train.inference import batched

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 130 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)   # 120 GiB reserved and idle
    info = types.SimpleNamespace(num_layers=30, num_key_value_heads=3, head_dim=64)   # SmolLM2: 23,040 B a slot
    target = types.SimpleNamespace(info=info, device=torch.device("cuda", 0),
                                   embed_tokens=types.SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16)))
    row = 5_000 * 23_040
    assert batched.rows_that_fit(target, 5_000, 32) == 32          # 60.5 GiB to spend: every row
    assert batched.rows_that_fit(target, 5_000, 10_000) == (121 * gib // 2) // row


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_real_drafters_that_are_accepted_in_part_decode_as_each_prompt_alone(biased_llama, architecture):
    """The real runners, with drafts the target accepts in runs of every length: on the biased target (its greedy
    choice is token 0 or 1) a drafter whose final norm keeps one unit proposes 0s and 1s. DFlash 2's selector walks
    every row at once (select_greedy_rows) and must pick what it picks for each block alone."""
    from test_dflash2 import coin_drafter, make_drafter2

    from dflash_train.inference.drafter_runner import Drafter2Runner

    t = load_target(biased_llama, LAYERS, truncate=False)
    if architecture == "dflash":
        drafter = make_drafter(biased_llama, B, seed=2)
        with torch.no_grad():
            drafter.norm.weight.zero_()
            drafter.norm.weight[0] = 1.0
        one_runner = DrafterRunner
    else:
        drafter, one_runner = coin_drafter(make_drafter2(biased_llama)), Drafter2Runner
    prompts = prompts_of(LENGTHS, seed=6)
    max_len = max(LENGTHS) + NEW + B
    t_one = TargetRunner.for_target(t, max_len, step_lens=(1, B))
    d_one = one_runner(drafter, t, max_len, B)
    alone = [speculative_generate(t_one, d_one, p, NEW) for p in prompts]
    together = decode_batched(t, drafter, prompts, NEW, B, rows=4)
    assert [tok for tok, _ in together] == [a.tokens for a in alone]
    assert [steps for _, steps in together] == [a.accept_lengths for a in alone]
    assert len({a for a_ in alone for a in a_.accept_lengths}) > 2  # runs of several lengths were accepted


def test_the_selector_walks_rows_as_it_walks_one_block(tiny_llama):
    """select_greedy_rows on R blocks = select on each block alone, with a pairwise term as large as the logits (so
    the predecessor decides picks)."""
    from test_dflash2 import make_drafter2

    sel = make_drafter2(tiny_llama).candidate_selector
    g = torch.Generator().manual_seed(7)
    R, n = 5, B - 1
    hidden = torch.randn(R, n, sel.hidden_projection.in_features, generator=g)
    logits = torch.randn(R, n, V, generator=g)
    anchors = torch.randint(0, V, (R,), generator=g)
    rows = sel.select_greedy_rows(hidden, logits, anchors)
    alone = torch.stack([sel.select(hidden[r], logits[r], anchors[r:r + 1])[0] for r in range(R)])
    assert torch.equal(rows, alone)
    unary_only = logits.topk(sel.top_k, dim=-1)[1][..., 0]  # what ignoring the predecessor would pick
    assert not torch.equal(rows, unary_only)


def test_a_row_that_overshoots_its_limit_writes_only_its_own_drafter_context(biased_llama, monkeypatch):
    """A row's last step can keep up to B - 1 tokens past max_new_tokens (the sink drops them, its position does
    not), and while other rows decode on, each step still appends its block's B context rows at that position. The
    drafter's cache must hold them inside the row: past it they land on the next row's prompt context (silently
    other drafts for that row) or, for the last row, past the buffer (IndexError). Equal-length prompts, B = 8."""
    from dflash_train.inference import batched

    b, new = 8, 12
    t = load_target(biased_llama, LAYERS, truncate=False)
    drafter = make_drafter(biased_llama, b, seed=2)
    with torch.no_grad():  # drafts of 0s and 1s: runs of every length accepted (as in the test above)
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
    prompts = prompts_of([6, 6, 6, 6], seed=0)
    max_len = 6 + new + b
    t_one = TargetRunner.for_target(t, max_len, step_lens=(1, b))
    d_one = DrafterRunner(drafter, t, max_len, b)
    alone = [speculative_generate(t_one, d_one, p, new) for p in prompts]
    assert any(sum(a.accept_lengths) + 1 > new + 2 for a in alone[:-1])  # an overshooting row, not the last ...
    assert sum(alone[-1].accept_lengths) + 1 > new + 2                    # ... and the last one

    writes = []  # (row of each flat slot, position) of every context write
    real_write = batched.BatchedDrafterRunner._write_context

    def recording(self, feats, pos, slots):
        writes.append((self.max_len, pos.tolist(), slots.tolist()))
        return real_write(self, feats, pos, slots)

    monkeypatch.setattr(batched.BatchedDrafterRunner, "_write_context", recording)
    together = decode_batched(t, drafter, prompts, new, b, rows=4)
    assert [tok for tok, _ in together] == [a.tokens for a in alone]
    assert [steps for _, steps in together] == [a.accept_lengths for a in alone]
    for L, pos, slots in writes:  # every write stays in its own row's L slots
        assert all(p < L and s % L == p for p, s in zip(pos, slots))


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_batch_after_batch_of_uneven_rows_that_stop_or_overshoot_stays_in_each_rows_memory(biased_llama,
                                                                                            architecture, monkeypatch):
    """Runners reused batch after batch (9 prompts, 4 rows: a last batch of one prompt and three spare rows), prompts
    of 1 to 60 tokens (left padding), a stop token that ends rows at their first token or mid-block, rows that
    overshoot max_new_tokens, B = 4 and B = 16 with max_new_tokens not a multiple of B and below it. Each row
    decodes as its prompt alone (tokens, acceptance lengths, and the drafter's logits at every step), the drafter
    writes only its own row's context, and at every target step each row, done or spare ones included, sees exactly
    its own kept tokens at positions 0..p-1 and queries from p on: nothing of an earlier batch (offsets, holes,
    masks), of a finished step or of another row shows through."""
    from test_dflash2 import coin_drafter, make_drafter2

    from dflash_train.inference import batched
    from dflash_train.inference.drafter_runner import Drafter2Runner

    t = load_target(biased_llama, LAYERS, truncate=False)
    prompts = prompts_of([1, 45, 2, 33, 6, 6, 60, 12, 25], seed=2)
    stop, rows = (1,), 4
    seen = {"mid-block stop": False, "overshoot": False, "first-token stop": False}
    for b, new in [(4, 21), (16, 21), (16, 5), (16, 40)]:
        if architecture == "dflash":
            drafter, one_runner = make_drafter(biased_llama, b, seed=2), DrafterRunner
            with torch.no_grad():  # drafts of 0s and 1s: runs of every length accepted
                drafter.norm.weight.zero_()
                drafter.norm.weight[0] = 1.0
        else:
            drafter, one_runner = coin_drafter(make_drafter2(biased_llama, f"model.block_size={b}")), Drafter2Runner
        max_len = max(map(len, prompts)) + new + b
        t_one = TargetRunner.for_target(t, max_len, step_lens=(1, b))
        alone, alone_logits = [], []
        for p in prompts:
            d_one, logits = one_runner(drafter, t, max_len, b), []

            def draft_one(last, start, real=d_one.draft, logits=logits):
                out = real(last, start)
                logits.append((out[1] if isinstance(out, tuple) else out).clone())  # DFlash 2: (hidden, logits)
                return out

            d_one.draft = draft_one
            alone.append(speculative_generate(t_one, d_one, p, new, stop_ids=stop))
            alone_logits.append(logits)

        writes, drafts, slot_pos = [], [], {}  # slot_pos: slot -> each row's position there (this batch)
        real_write, real_bdraft = batched.BatchedDrafterRunner._write_context, batched.BatchedDrafterRunner.draft
        real_prefill, real_step = TargetRunner.prefill, TargetRunner.step

        def write(self, feats, pos, slots):
            writes.append((self.max_len, self.rows, pos.tolist(), slots.tolist()))
            return real_write(self, feats, pos, slots)

        def draft(self, last, starts):
            out = real_bdraft(self, last, starts)
            drafts[-1].append((out[1] if isinstance(out, tuple) else out).clone())
            return out

        def prefill(self, ids, pad_len=None):
            drafts.append([])
            slot_pos.clear()
            slot_pos.update({s: [max(0, s - pad) for pad in pad_len] for s in range(ids.shape[1])})
            return real_prefill(self, ids, pad_len)

        def step(self, ids, start):
            visible = self.valid[:, :start].clone()
            out = real_step(self, ids, start)
            pos = self._bufs[ids.shape[-1]]["pos"]
            for r in range(self.batch_size):
                assert [slot_pos[s][r] for s in range(start) if visible[r, s]] == list(range(int(pos[r, 0])))
            slot_pos.update({start + k: pos[:, k].tolist() for k in range(ids.shape[-1])})
            return out

        monkeypatch.setattr(batched.BatchedDrafterRunner, "_write_context", write)
        monkeypatch.setattr(batched.BatchedDrafterRunner, "draft", draft)
        monkeypatch.setattr(TargetRunner, "prefill", prefill)
        monkeypatch.setattr(TargetRunner, "step", step)
        together = decode_batched(t, drafter, prompts, new, b, stop_ids=stop, rows=rows)
        monkeypatch.undo()
        assert [tok for tok, _ in together] == [a.tokens for a in alone]
        assert [steps for _, steps in together] == [a.accept_lengths for a in alone]
        for L, R, pos, slots in writes:  # every drafter context write stays in its own row's L slots
            assert all(p < L and s % L == p and s // L < R for p, s in zip(pos, slots))
        for i, logits in enumerate(alone_logits):  # the row's drafts at each of its steps are its prompt's alone
            batch, r = divmod(i, rows)
            for k, one in enumerate(logits):
                torch.testing.assert_close(drafts[batch][k][r], one, rtol=1e-4, atol=1e-4)
        for a in alone:
            seen["mid-block stop"] |= a.tokens[-1] in stop and sum(a.accept_lengths) + 1 > len(a.tokens)
            seen["overshoot"] |= sum(a.accept_lengths) + 1 > new
            seen["first-token stop"] |= not a.accept_lengths
    assert all(seen.values()), seen
