"""The continuous-batching engine (generation/engine.py) against one-prompt-at-a-time decoding, its seeded sampling,
and sampled regeneration (`regenerate --samples`), on tiny models (CPU)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tiny_chat import make_tiny_chat_target, write_chats

from dflash_train.cli import main
from dflash_train.data.sources import iter_conversations
from dflash_train.generation.engine import Engine, Request, _PrefillInputs, pick_seeded, seeded_uniform
from dflash_train.models.target import load_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_greedy(hf, prompt: list[int], n: int, stop=()) -> list[int]:
    """Obviously correct: a full forward over the whole sequence for every new token; ends after a stop token."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        seq.append(out[-1])
        if out[-1] in stop:
            break
    return out


def run_engine(engine: Engine, requests: list[Request], on_done=None) -> dict:
    got = {}

    def done(req, tokens):
        assert req.key not in got
        got[req.key] = tokens
        if on_done:
            on_done(req, tokens)

    stats = engine.run(iter(requests), done)
    assert stats.requests == len(got) and stats.generated_tokens == sum(map(len, got.values()))
    return got


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    return load_causal_lm(tiny_qwen3, torch.device("cpu"))


@pytest.fixture(scope="module")
def cases(hf):
    """Prompts of 1..29 tokens with their own max_new_tokens (1..30), greedy references, and a stop token that ends
    some replies early."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (12,), generator=g)]
    prompts[0] = [5]                                                       # a one-token prompt
    news = [3, 17, 1, 9, 25, 5, 12, 2, 30, 7, 14, 20]
    refs = [naive_greedy(hf, p, n) for p, n in zip(prompts, news)]
    counts = Counter(t for r in refs for t in set(r[1:-1]))
    stop = counts.most_common(1)[0][0]  # inside several replies: they end there, at different steps
    return prompts, news, refs, stop


@pytest.mark.parametrize("batch, window, check, overlap", [(1, 128, 8, False), (3, 8, 3, False), (5, 4, 1, False),
                                                             (16, 16, 8, False), (3, 8, 3, True), (5, 4, 1, True)])
def test_engine_greedy_equals_one_prompt_at_a_time(hf, cases, batch, window, check, overlap):
    """Rows of different lengths ending at different times, refilled mid-batch (batch < requests), windows crossed,
    more rows than requests; with and without a stop token; refills queued before or after the steps."""
    prompts, news, refs, stop = cases
    engine = Engine(hf, batch, 64, stop_ids=[], window=window, check_every=check, overlap_prefill=overlap)
    got = run_engine(engine, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])
    assert [got[i] for i in range(len(prompts))] == refs
    engine = Engine(hf, batch, 64, stop_ids=[stop], window=window, check_every=check, overlap_prefill=overlap)
    got = run_engine(engine, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])
    cut = [r[: r.index(stop) + 1] if stop in r else r for r in refs]
    assert [got[i] for i in range(len(prompts))] == cut
    assert sum(stop in r for r in refs) >= 2 and cut != refs


def test_engine_flex_decode_folds_grouped_heads_into_rows(tmp_path):
    """Three query heads a K/V head (SmolLM2 has 9 on 3; flex's decoding kernel takes grouped heads only in powers of
    two): the step's query heads of a K/V head attend as rows of that head (inference/attention.row_length_attention),
    with the same answers as one prompt at a time, rows refilled mid-batch and crossing a tile boundary."""
    from conftest import make_tiny_target

    hf3 = load_causal_lm(make_tiny_target(tmp_path / "gqa3", "llama", hidden_size=96, num_attention_heads=6,
                                          num_key_value_heads=2), torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in (1, 5, 17, 29, 126, 130)]
    news = [9, 4, 12, 6, 8, 10]
    refs = [naive_greedy(hf3, p, n) for p, n in zip(prompts, news)]
    engine = Engine(hf3, 3, 160, check_every=2, decode_attention="flex")
    assert engine._rows_mask.q_rows == 3
    got = run_engine(engine, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])
    assert [got[i] for i in range(len(prompts))] == refs


@pytest.mark.parametrize("batch, check, overlap", [(3, 3, True)])  # the refill's variants: the masked tests'
def test_engine_flex_decode_equals_one_prompt_at_a_time(hf, cases, batch, check, overlap):
    """decode_attention='flex' (each row reads its own 128-slot tiles; eager flex on CPU, compiled on CUDA): the same
    answers as one prompt at a time, with and without a stop token, and rows crossing a tile boundary."""
    prompts, news, refs, stop = cases
    g = torch.Generator().manual_seed(1)
    long = [torch.randint(1, 128, (k,), generator=g).tolist() for k in (120, 127, 128, 140)]  # they cross slot 128
    long_refs = [naive_greedy(hf, p, 12) for p in long]
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))]
    reqs += [Request(("long", i), p, 12) for i, p in enumerate(long)]
    engine = Engine(hf, batch, 160, check_every=check, overlap_prefill=overlap, decode_attention="flex")
    got = run_engine(engine, reqs)
    assert [got[i] for i in range(len(prompts))] == refs
    assert [got[("long", i)] for i in range(len(long))] == long_refs
    engine = Engine(hf, batch, 160, stop_ids=[stop], check_every=check, overlap_prefill=overlap,
                    decode_attention="flex")
    got = run_engine(engine, reqs[: len(prompts)])
    assert [got[i] for i in range(len(prompts))] == [r[: r.index(stop) + 1] if stop in r else r for r in refs]


def test_engine_flex_sampled_answers_equal_the_masked_ones(hf, cases):
    prompts, news, _, _ = cases
    sampled = [Request(i, p, n, 1.0, seed=1000 + i) for i, (p, n) in enumerate(zip(prompts, news))]
    masked = run_engine(Engine(hf, 4, 64, window=16, check_every=3, decode_attention="mask"), sampled)
    assert run_engine(Engine(hf, 4, 64, check_every=3, decode_attention="flex"), sampled) == masked


def test_engine_decode_attention_is_checked(hf):
    with pytest.raises(ValueError, match="pick one of mask, flex"):
        Engine(hf, 2, 32, decode_attention="paged")
    assert Engine(hf, 2, 32).flex is False  # None: the masked step on a CPU


def test_engines_of_either_attention_share_one_model(hf, cases):
    """A flex engine switches the model to its attention; a masked engine built after it switches it back to packed
    GQA (its mask-free prefill included) and still gives the greedy answers."""
    prompts, news, refs, _ = cases
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))]
    Engine(hf, 2, 64, decode_attention="flex")
    assert hf.config._attn_implementation == "row_length_flex"
    masked = Engine(hf, 3, 64, window=8, decode_attention="mask")
    assert hf.config._attn_implementation == "packed_gqa_sdpa" and masked._causal_prefill
    got = run_engine(masked, reqs)
    assert [got[i] for i in range(len(prompts))] == refs


def test_engine_reused_small_prefill_chunks_and_max_len_boundary(hf):
    """One engine, several runs; prefill chunks of one request each; a request filling the cache exactly (prompt +
    max_new_tokens = max_len) and one that does not fit (an error, not a wrong answer)."""
    engine = Engine(hf, 2, 24, window=8, check_every=2, prefill_tokens=1)
    reqs = [Request("full", list(range(1, 15)), 10), Request("short", [7, 8], 22), Request("one", [9], 1)]
    for _ in range(2):
        got = run_engine(engine, reqs)
        assert got == {r.key: naive_greedy(hf, r.prompt_ids, r.max_new_tokens) for r in reqs}
    with pytest.raises(ValueError, match="does not fit"):
        engine.run(iter([Request("long", list(range(1, 20)), 6)]), lambda *a: None)
    assert run_engine(engine, reqs[:1])["full"] == got["full"]  # still usable after the error


def test_engine_follow_up_requests_continue_a_conversation(hf):
    """on_done submits the next turn (prompt = history + reply + a new user token): the answers equal decoding the
    whole history from scratch, turn by turn."""
    engine = Engine(hf, 2, 96, window=16, check_every=4)
    starts = {k: [k + 1] * (k + 2) for k in range(4)}
    turns = Counter()

    def follow(req, tokens):
        turns[req.key[0]] += 1
        if turns[req.key[0]] < 3:
            engine.submit(Request((req.key[0], turns[req.key[0]]), req.prompt_ids + tokens + [50], 6 + req.key[0]))

    got = run_engine(engine, [Request((k, 0), p, 6 + k) for k, p in starts.items()], follow)
    assert len(got) == 12
    for k, p in starts.items():
        history = list(p)
        for t in range(3):
            ref = naive_greedy(hf, history, 6 + k)
            assert got[(k, t)] == ref, (k, t)
            history += ref + [50]


def test_seeded_sampling_follows_the_distribution():
    """Inverse-CDF sampling with hashed uniforms: frequencies match softmax(logits / T); uniforms are in (0, 1) and
    differ across seeds and token indices."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    seeds, index = torch.arange(n), torch.zeros(n, dtype=torch.long)
    for T in (1.0, 0.5):
        toks = pick_seeded(logits.expand(n, 5), torch.full((n,), T), seeds, index, sampled=True)
        freq = torch.bincount(toks, minlength=5).float() / n
        torch.testing.assert_close(freq, torch.softmax(logits[0] / T, -1), atol=0.015, rtol=0)
    u = seeded_uniform(torch.tensor([3] * 1000), torch.arange(1000))
    assert 0 < float(u.min()) and float(u.max()) < 1 and len(set(u.tolist())) > 990
    assert (pick_seeded(logits, torch.zeros(1), seeds[:1], index[:1], sampled=True) == 0).all()  # greedy row


def test_sampled_answers_depend_on_their_seed_only(hf, cases):
    """The same requests at temperature 1 in other batch sizes, orders and rows (beside greedy rows): each answer is
    the same; other seeds give other answers; greedy rows still equal greedy decoding."""
    prompts, news, refs, _ = cases
    sampled = [Request(i, p, n, 1.0, seed=1000 + i) for i, (p, n) in enumerate(zip(prompts, news))]
    greedy = [Request(("g", i), p, n) for i, (p, n) in enumerate(zip(prompts, news))]
    a = run_engine(Engine(hf, 1, 64, window=8), sampled)
    b = run_engine(Engine(hf, 4, 64, window=16, check_every=3), [x for pair in zip(greedy, sampled[::-1])
                                                                   for x in pair])
    assert {k: b[k] for k in a} == a
    assert [b[("g", i)] for i in range(len(prompts))] == refs
    other = run_engine(Engine(hf, 4, 64), [Request(r.key, r.prompt_ids, r.max_new_tokens, 1.0, seed=r.seed + 1)
                                           for r in sampled])
    long = [k for k in a if len(a[k]) >= 5]
    assert sum(other[k] != a[k] for k in long) >= len(long) - 1
    assert sum(a[k] != refs[k] for k in long) >= len(long) - 1


# ------------------------------------------------------------------------------------------ regenerate --samples

@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return make_tiny_chat_target(tmp_path_factory.mktemp("chat_target"), "llama")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_samples_are_reproducible_resumable_and_keep_the_split(chat_target, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 6, turns=2)
    base = ["regenerate", "--target", chat_target, "--data", str(data), "--max-new-tokens", "6", "--device", "cpu",
            "--samples", "3", "--temperature", "1.0"]
    one = tmp_path / "one.jsonl"
    assert main(base + ["--out", str(one), "--batch-size", "4"]) == 0
    recs = _records(one)
    ids = {r["id"] for r in recs}
    assert ids == {f"chat{i}_0_s{k}" for i in range(6) for k in range(3)}  # random weights: no two samples equal
    per_chat = Counter(json.dumps(r["messages"]) for r in recs)
    assert max(per_chat.values()) == 1
    # Resumed after 2 of 6 conversations, in another batch size: the same records.
    two = tmp_path / "two.jsonl"
    assert main(base + ["--out", str(two), "--batch-size", "2", "--max-samples", "2"]) == 0
    assert len(_records(two)) == 6
    assert main(base + ["--out", str(two), "--batch-size", "5"]) == 0
    assert sorted(_records(two), key=lambda r: r["id"]) == sorted(recs, key=lambda r: r["id"])
    # Every sample of a conversation keys on the conversation: one side of the train/held-out split.
    keys = {c.key for c in iter_conversations(one, Counter())}
    assert keys == {f"chat{i}" for i in range(6)}
    assert main(base[:-4] + ["--out", str(tmp_path / "x.jsonl"), "--samples", "2"]) == 2
    assert "needs --temperature > 0" in capsys.readouterr().err


def test_regenerate_samples_drop_duplicates(chat_target, tmp_path, capsys):
    """At a temperature near 0 every sample is the greedy answer: one record per conversation, the rest counted as
    duplicates, also when a rerun regenerates the dropped ones."""
    data = write_chats(tmp_path / "chats.jsonl", 4, turns=1)
    out = tmp_path / "dup.jsonl"
    args = ["regenerate", "--target", chat_target, "--data", str(data), "--out", str(out), "--max-new-tokens", "6",
            "--device", "cpu", "--samples", "3", "--temperature", "0.0001", "--batch-size", "3"]
    assert main(args) == 0
    assert "duplicate_sample=8" in capsys.readouterr().out
    recs = _records(out)
    assert sorted(r["id"] for r in recs) == [f"chat{i}_0_s0" for i in range(4)]
    greedy = tmp_path / "greedy.jsonl"
    assert main(args[:-6] + ["--out", str(greedy), "--batch-size", "3"]) == 0
    assert {r["id"]: r["messages"] for r in _records(greedy)} == {r["id"][:-3]: r["messages"] for r in recs}
    assert main(args) == 0  # rerun: the dropped samples come back as duplicates of what the file holds
    assert "duplicate_sample=8" in capsys.readouterr().out and _records(out) == recs


def test_engine_counts_the_kv_it_reads(hf):
    """One row, a window of one slot, a check every step: the steps read exactly each token's own context."""
    reqs = [Request(i, [3 + i] * (4 + i), 5 + i) for i in range(3)]
    stats = Engine(hf, 1, 32, window=1, check_every=1).run(iter(reqs), lambda *a: None)
    assert stats.kv_slots_needed == sum((n - 1) * (P + 1) + (n - 1) * (n - 2) // 2 for P, n in ((4, 5), (5, 6), (6, 7)))
    assert stats.kv_slots_read == stats.kv_slots_needed and stats.row_steps == stats.steps == 4 + 5 + 6
    wide = Engine(hf, 4, 32, window=8).run(iter(reqs), lambda *a: None)
    assert wide.kv_slots_needed == stats.kv_slots_needed < wide.kv_slots_read


def test_a_prefill_that_cannot_be_captured_runs_eagerly_with_one_warning(hf, cases, monkeypatch, caplog):
    """A model whose prefill a CUDA graph cannot hold: the engine says so once and decodes the same tokens eagerly.
    (CPU stand-in: the capture is made to fail.)"""
    import dflash_train.generation.engine as engine_mod

    real = engine_mod.GraphedStep

    def failing(fn, graphs, **kw):
        if graphs:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(fn, graphs, **kw)

    monkeypatch.setattr(engine_mod, "GraphedStep", failing)
    prompts, news, refs, _ = cases
    engine = Engine(hf, 3, 64, window=8, check_every=3)
    engine.prefill_graphs = True  # as on a GPU
    with caplog.at_level("WARNING", logger="dflash_train"):
        got = run_engine(engine, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])
    assert [got[i] for i in range(len(prompts))] == refs
    warned = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == 1 and engine.prefill_graphs is False


class _HostTensorSpy(TorchDispatchMode):
    """Records every tensor made from host data (torch.tensor(...), `x[i] = 1`): a CUDA graph cannot hold the copy of
    one to the device, so a capture of a step that makes one fails on GPU (found there: `count[rows] = 1`)."""

    def __init__(self):
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.made.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampled", [False, True])
def test_engine_device_steps_make_no_host_tensors(hf, sampled):
    engine = Engine(hf, 4, 64, window=8)
    inputs = _PrefillInputs.empty(4, 16, engine.device)
    inputs.fill(ids=torch.randint(1, 100, (4, 16)), rows=[0, 1, 2, engine.spare], lens=[16, 5, 9, 1],
                temp=[0.7 if sampled else 0.0] * 4, seed=[1, 2, 3, 0], limit=[5, 5, 5, 1])
    spy = _HostTensorSpy()
    with torch.no_grad(), spy:
        engine._prefill_device(inputs, sampled)
        engine._decode(4, 24, sampled)
    assert spy.made == []


def test_flex_decode_mask_makes_no_host_tensors(hf):
    """The flex step's own part, its BlockMask (flex_attention itself compiles, which a dispatch mode prevents)."""
    engine = Engine(hf, 4, 64, decode_attention="flex")
    spy = _HostTensorSpy()
    with spy:
        engine._rows_mask.block_mask(4)
    assert spy.made == []


def test_engine_falls_back_to_the_masked_step_when_flex_fails(hf, cases, monkeypatch, caplog):
    """A flex step that cannot be built (a compile or capture error on some GPU) costs speed, not the run."""
    import dflash_train.generation.engine as engine_mod

    real = engine_mod.GraphedStep
    prompts, news, refs, _ = cases
    engine = Engine(hf, 3, 64, check_every=3, decode_attention="flex")

    def failing(fn, graphs, **kw):
        if engine.flex and "pool" in kw:  # a decoding step (the eager prefill's step is built without a pool)
            raise RuntimeError("flex_attention: no kernel for this shape")
        return real(fn, graphs, **kw)

    monkeypatch.setattr(engine_mod, "GraphedStep", failing)
    with caplog.at_level("WARNING", logger="dflash_train"):
        got = run_engine(engine, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])
    assert [got[i] for i in range(len(prompts))] == refs
    warned = [r for r in caplog.records if "flex decoding step failed" in r.getMessage()]
    assert len(warned) == 1 and engine.flex is False


def test_a_second_regeneration_pass_reuses_the_engine_and_writes_the_same(chat_target, tmp_path):
    """data.self_prompts regenerates two files in a row (the source, then the answers): with `engines` kept across
    the passes the second one runs on the first one's engine, and writes what a fresh engine would."""
    from dflash_train.generation.regenerate import RegenerateSettings, iter_source_records, regenerate_dataset
    from dflash_train.models.target import load_tokenizer

    hf, tok = load_causal_lm(chat_target, torch.device("cpu")), load_tokenizer(chat_target)
    first, second = write_chats(tmp_path / "a.jsonl", 5, turns=2), write_chats(tmp_path / "b.jsonl", 7)

    def items(path):
        return [(rid, conv, True) for rid, conv in iter_source_records(str(path), Counter())]

    def settings(path):
        return RegenerateSettings(str(path), chat_target, 6, 0.0, False, 256)

    engines: dict = {}
    regenerate_dataset(hf, tok, items(first), tmp_path / "a_out.jsonl", settings(first), 3, engines=engines)
    built = engines[0]
    assert isinstance(built, Engine)
    regenerate_dataset(hf, tok, items(second), tmp_path / "b_out.jsonl", settings(second), 3, engines=engines)
    assert engines[0] is built                                     # reused, not rebuilt
    regenerate_dataset(hf, tok, items(second), tmp_path / "b_fresh.jsonl", settings(second), 3)
    assert _records(tmp_path / "b_out.jsonl") == _records(tmp_path / "b_fresh.jsonl")
    # Another shape (batch size) or model gets its own engine.
    regenerate_dataset(hf, tok, items(second), tmp_path / "b_4.jsonl", settings(second), 4, engines=engines)
    assert engines[0] is not built and engines[0].b == 4
    stops = built.stop_ids.tolist()
    assert built.fits(hf, 3, 256, stops, built.pad_id)
    assert not built.fits(load_causal_lm(chat_target, torch.device("cpu")), 3, 256, stops, built.pad_id)
    assert not built.fits(hf, 3, 256, stops + [5], built.pad_id) and not built.fits(hf, 3, 255, stops, built.pad_id)


def test_a_reply_cut_at_max_new_tokens_is_marked_truncated(chat_target, tmp_path):
    """A reply that ends without a stop token (max_new_tokens reached) is written with "truncated": true, one that
    ends with its stop token is not, and the mark survives reading the file back (training then leaves that reply's
    end-of-turn token out of the loss: tests/test_conversations.py)."""
    from types import SimpleNamespace

    from tqdm import tqdm

    from dflash_train.generation.regenerate import (RegenerateSettings, RegenerateStats, Regenerator,
                                                    iter_source_records)
    from dflash_train.models.target import load_tokenizer

    tok = load_tokenizer(chat_target)
    stop = tok.eos_token_id
    words = tok("alpha beta gamma", add_special_tokens=False)["input_ids"]

    class ScriptedEngine:  # the engine as Regenerator uses it: every other request ends with its stop token
        def fits(self, *args):
            return True

        def run(self, requests, on_done, stop_event):
            for i, req in enumerate(requests):
                on_done(req, words + [stop] if i % 2 == 0 else words)
            return SimpleNamespace(row_steps=0, prefill_tokens=0)

    data = write_chats(tmp_path / "chats.jsonl", 4)
    settings = RegenerateSettings(str(data), chat_target, len(words), 0.0, True, 256)
    regen = Regenerator(None, tok, settings, 2, [stop], engine=ScriptedEngine())
    written = []
    items = [(rid, conv, True) for rid, conv in iter_source_records(str(data), Counter())]
    with tqdm(disable=True) as bar:
        regen.run(items, written.append, lambda: None, RegenerateStats(), bar)
    replies = [r["messages"][-1] for r in written]
    assert len(replies) == 4 and sum(bool(m.get("truncated")) for m in replies) == 2
    assert all(m.get("truncated") in (None, True) for m in replies)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in written))
    read_back = [c.messages[-1] for c in iter_conversations(out, Counter())]
    assert [m.get("truncated", False) for m in read_back] == [bool(m.get("truncated")) for m in replies]
