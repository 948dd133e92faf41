"""Prompts the target writes itself (generation/self_prompts.py) and several data sources mixed with weights."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from dflash_train.errors import UserError
from dflash_train.generation.self_prompts import (FREE, OPENERS_PATH, SelfPromptSettings, judge, normalised,
                                                  pick_openers, read_openers, user_turn_template, write_self_prompts)
from tiny_chat import CHATML, make_byte_tokenizer, make_tiny_chat_target, write_chats

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

QWEN_DEFAULT_SYSTEM = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def tokenizer_with(template: str, specials=()):
    tok = make_byte_tokenizer()
    if specials:
        tok.add_tokens(list(specials), special_tokens=True)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return make_tiny_chat_target(tmp_path_factory.mktemp("tiny_chat"))


def letter_lm(path: str, tok, alphabet: str = "ab ", p_end: float = 0.15):
    """The tiny target with an LM head that ignores the context: each next token is one of `alphabet`'s bytes
    (uniform) or <|im_end|> with probability p_end. Short strings over few letters: duplicates, truncated and too
    short rows all occur, and what is kept is printable text."""
    from dflash_train.models.target import load_causal_lm

    hf = load_causal_lm(path, "cpu")
    bias = torch.full((hf.config.vocab_size,), -1e4)
    for ch in alphabet:
        (i,) = tok.encode(ch, add_special_tokens=False)
        bias[i] = math.log((1 - p_end) / len(alphabet))
    bias[tok.convert_tokens_to_ids("<|im_end|>")] = math.log(p_end)
    head = torch.nn.Linear(hf.config.hidden_size, hf.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(bias)
    hf.lm_head = head
    return hf


def regenerate_data(cfg, out_dir, tok):
    """regenerate_for_run's DataConfig (it may also return the regeneration's stats)."""
    from dflash_train.generation.run_data import regenerate_for_run

    result = regenerate_for_run(cfg, out_dir, tok)
    return result[0] if isinstance(result, tuple) else result


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ the prefix

@pytest.mark.parametrize("template,specials,prefix,end", [
    (CHATML, (), "<|im_start|>user\n", "<|im_end|>"),
    (QWEN_DEFAULT_SYSTEM, (), "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
     "<|im_end|>"),
    (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
     "<|im_start|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),  # bos = <|im_start|> here
], ids=["chatml", "qwen_default_system", "llama3"])
def test_prefix_is_the_template_up_to_the_user_content(template, specials, prefix, end):
    tok = tokenizer_with(template, specials)
    tpl = user_turn_template(tok)
    assert tpl.prefix_text == prefix
    assert tok.decode(tpl.prefix_ids) == prefix
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids[:len(tpl.prefix_ids)] == tpl.prefix_ids  # the prompt's tokens start with exactly these
    assert tok.convert_ids_to_tokens(tpl.end_id) == end


@pytest.mark.parametrize("template,match", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\nsomething<|im_end|>{% endfor %}", "exactly once"),
    ("{% for m in messages %}{{ m.content }} {{ m.content }}<|im_end|>{% endfor %}", "exactly once"),
    ("{% for m in messages %}<|im_start|>{{ m.content[0] }}\n{{ m.content }}<|im_end|>{% endfor %}",
     "differently for different contents"),
    ("{% for m in messages %}User: {{ m.content }}\n{% endfor %}", "special token"),
    ("{% for m in messages %}{{ raise_exception('no lone user turns') }}{% endfor %}", "cannot render"),
], ids=["drops_content", "content_twice", "header_depends_on_content", "no_end_token", "refuses"])
def test_a_template_without_a_clean_prefix_is_one_error(template, match):
    with pytest.raises(UserError, match=match):
        user_turn_template(tokenizer_with(template))


def test_a_tokenizer_without_a_template_is_one_error():
    tok = make_byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(UserError, match="cannot render a lone user message"):
        user_turn_template(tok)


# ------------------------------------------------------------------------------------------ the filters

def test_the_filters_drop_truncated_special_empty_nonprintable_and_short_turns():
    stop, special = {9}, {7, 9}
    assert judge([1, 2, 3, 9], "What is a monad?", stop, special, 8) is None
    assert judge([1, 2, 3], "What is a monad?", stop, special, 8) == "truncated"   # no end of turn
    assert judge([], "", stop, special, 8) == "truncated"
    assert judge([1, 7, 2, 9], "What is a monad?", stop, special, 8) == "special_token"
    assert judge([9], "", stop, special, 8) == "empty"
    assert judge([1, 9], "What\x07 is it?", stop, special, 8) == "non_printable"
    assert judge([1, 9], "What \ufffd is it?", stop, special, 8) == "non_printable"  # bytes that are not UTF-8
    assert judge([1, 9], "Line one\n\tline two", stop, special, 8) is None          # newlines and tabs are text
    assert judge([1, 9], "Why?", stop, special, 8) == "too_short"
    assert normalised("  What IS a monad?! ") == normalised("what is a   monad") == "what is a monad"


# ------------------------------------------------------------------------------------------ sampling

def settings(seed=0, batch_size=8) -> SelfPromptSettings:
    return SelfPromptSettings(target="tiny", seed=seed, batch_size=batch_size, max_new_tokens=6, min_chars=2)


def test_self_prompts_are_filtered_reproducible_per_seed_and_resumable(chat_target, tmp_path):
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="ab", p_end=0.3)
    out = tmp_path / "a.jsonl"
    stats = write_self_prompts(hf, tok, out, 12, settings())
    records = _lines(out)
    assert stats.kept == stats.written == len(records) == 12
    assert [r["id"] for r in records] == [f"self_{i}" for i in range(12)]
    texts = [r["messages"][0]["content"] for r in records]
    assert all(r["messages"] == [{"role": "user", "content": t}] for r, t in zip(records, texts))
    assert all(len(t) >= 2 and set(t) <= set("ab") for t in texts)
    assert len({normalised(t) for t in texts}) == 12
    # This alphabet and p_end make each kind of drop common: a test that would pass with no filter cannot.
    assert stats.dropped["duplicate"] > 0 and stats.dropped["truncated"] > 0 and stats.dropped["too_short"] > 0
    assert stats.sampled == stats.written + sum(stats.dropped.values())

    # Same seed: the same file; another seed: another one.
    write_self_prompts(hf, tok, tmp_path / "b.jsonl", 12, settings())
    assert (tmp_path / "b.jsonl").read_text() == out.read_text()
    write_self_prompts(hf, tok, tmp_path / "c.jsonl", 12, settings(seed=1))
    assert (tmp_path / "c.jsonl").read_text() != out.read_text()

    # Asked for 5, then for 12: the file an uninterrupted run writes.
    grown = tmp_path / "grown.jsonl"
    assert write_self_prompts(hf, tok, grown, 5, settings()).kept == 5
    assert [r["messages"] for r in _lines(grown)] == [r["messages"] for r in records[:5]]
    write_self_prompts(hf, tok, grown, 12, settings())
    assert grown.read_text() == out.read_text()

    # A crash cut the last line: that batch is sampled again, and the result is the same file.
    data = out.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(data[: len(data) - 7])
    (tmp_path / "cut.meta.json").write_text(out.with_suffix(".meta.json").read_text())
    write_self_prompts(hf, tok, cut, 12, settings())
    assert cut.read_text() == data

    # A complete file is left alone: nothing is sampled again, whether as many or fewer are asked for.
    assert write_self_prompts(hf, tok, out, 12, settings()).sampled == 0
    assert write_self_prompts(hf, tok, out, 5, settings()).sampled == 0 and out.read_text() == data

    # A set stop event (a time limit) ends sampling before its next batch.
    stopped = threading.Event()
    stopped.set()
    assert write_self_prompts(hf, tok, tmp_path / "stopped.jsonl", 12, settings(), stop=stopped).sampled == 0

    # Other settings: refused, not extended.
    with pytest.raises(UserError, match="other settings.*batch_size=8 \\(now 4\\)"):
        write_self_prompts(hf, tok, out, 12, settings(batch_size=4))


def test_sampling_gives_up_when_the_target_writes_no_usable_prompt(chat_target, tmp_path, caplog):
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="a", p_end=0.999)  # nearly always an empty turn
    with caplog.at_level("WARNING", logger="dflash_train"):
        stats = write_self_prompts(hf, tok, tmp_path / "none.jsonl", 4, settings(batch_size=4))
    assert stats.sampled == 16 and stats.kept <= 1  # MAX_SAMPLED x 4 rows, then a warning
    assert "passed the filters" in caplog.text


# ------------------------------------------------------------------------------------------ steered by openers

OPENERS = {"coding": ["Write code:", "Fix bug:"], "math": ["Solve:"]}


def steered(openers=None, share=0.5, seed=0) -> SelfPromptSettings:
    return dataclasses.replace(settings(seed), openers=OPENERS if openers is None else openers, steered=share,
                               max_new_tokens=12)


def opener_of(record: dict, openers: dict[str, list[str]]) -> str:
    """The longest opener of a steered record's kind that its content starts with ("" if none)."""
    text = record["messages"][0]["content"]
    return max((o for o in openers[record["kind"]] if text.startswith(o)), key=len, default="")


def test_the_bundled_openers_parse_grouped_by_kind_without_duplicates():
    lines = OPENERS_PATH.read_text(encoding="utf-8").splitlines()
    assert all(line.strip() and line.count("\t") == 1 for line in lines)  # no empty line, one tab each
    openers = read_openers("builtin")
    assert len(openers) >= 8 and FREE not in openers and all(len(pool) >= 10 for pool in openers.values())
    flat = [o.casefold() for pool in openers.values() for o in pool]
    assert 150 <= len(flat) == len(lines) and len(set(flat)) == len(flat)
    kinds = [line.split("\t")[0] for line in lines]
    assert [k for i, k in enumerate(kinds) if not i or k != kinds[i - 1]] == list(openers)  # each kind in one run


def test_a_kind_is_picked_uniformly_whatever_its_number_of_openers():
    openers = {"one": ["a"], "ten": [f"t{i}" for i in range(10)], "hundred": [f"h{i}" for i in range(100)]}
    g = torch.Generator().manual_seed(0)
    picks = [p for _ in range(20) for p in pick_openers(openers, 0.5, 1000, g)]
    chosen = [p for p in picks if p is not None]
    assert abs(len(chosen) / len(picks) - 0.5) < 0.02
    kinds = Counter(k for k, _ in chosen)
    assert set(kinds) == set(openers) and all(abs(n / len(chosen) - 1 / 3) < 0.02 for n in kinds.values())
    tens = Counter(o for k, o in chosen if k == "ten")  # ~330 each: uniform within the kind too
    assert len(tens) == 10 and max(tens.values()) < 1.3 * min(tens.values())
    assert None not in pick_openers(openers, 1.0, 200, g)
    state = g.get_state()
    assert pick_openers(openers, 0.0, 8, g) == [None] * 8 and torch.equal(g.get_state(), state)  # nothing drawn


def test_steered_prompts_start_with_their_opener_and_render_as_conversations(chat_target, tmp_path):
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="abc ", p_end=0.2)
    stats = write_self_prompts(hf, tok, tmp_path / "s.jsonl", 16, steered())
    records = _lines(tmp_path / "s.jsonl")
    assert len(records) == 16 and all(list(r) == ["id", "messages", "batch", "kind"] for r in records)
    kinds = Counter(r["kind"] for r in records)
    assert set(kinds) == {FREE, "coding", "math"} and stats.kinds == kinds and "new by kind: coding=" in stats.line()
    assert stats.dropped["empty"] > 0  # a turn that ends right after its opener is dropped, not kept as the opener
    tpl = user_turn_template(tok)
    for r in records:
        text = r["messages"][0]["content"]
        opener = "" if r["kind"] == FREE else opener_of(r, OPENERS)
        assert opener or r["kind"] == FREE
        own = text[len(opener):]
        assert own.strip() and set(own) <= set("abc ")  # everything after the opener is the target's
        rendered = tok.apply_chat_template(r["messages"], tokenize=False)
        assert rendered == f"<|im_start|>user\n{text}<|im_end|>\n"
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        assert ids[:len(tpl.prefix_ids)] == tpl.prefix_ids and ids.count(tpl.end_id) == 1

    assert write_self_prompts(hf, tok, tmp_path / "all.jsonl", 8, steered(share=1.0)).kept == 8
    assert {r["kind"] for r in _lines(tmp_path / "all.jsonl")} <= set(OPENERS)  # share 1: every row steered


def test_without_steering_the_file_is_plain_magpie(chat_target, tmp_path):
    """Share 0, or no openers: not one draw more, so the same file (and meta) as plain Magpie for the same seed."""
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="ab", p_end=0.3)
    files = []
    for name, s in (("plain", dataclasses.replace(settings(), max_new_tokens=12)),
                    ("share0", steered(read_openers("builtin"), share=0.0)), ("none", steered({}, share=0.75))):
        write_self_prompts(hf, tok, tmp_path / f"{name}.jsonl", 12, s)
        files.append(((tmp_path / f"{name}.jsonl").read_text(), (tmp_path / f"{name}.meta.json").read_text()))
    assert files[0] == files[1] == files[2]
    assert all("kind" not in r for r in _lines(tmp_path / "plain.jsonl"))


def test_steered_prompts_are_reproducible_resumable_and_tied_to_their_openers(chat_target, tmp_path):
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="abc ", p_end=0.2)
    out = tmp_path / "a.jsonl"
    write_self_prompts(hf, tok, out, 12, steered())
    data = out.read_text()
    write_self_prompts(hf, tok, tmp_path / "b.jsonl", 12, steered())
    assert (tmp_path / "b.jsonl").read_text() == data
    write_self_prompts(hf, tok, tmp_path / "c.jsonl", 12, steered(seed=1))
    assert (tmp_path / "c.jsonl").read_text() != data

    # Asked for 5, then for 12; a crash that cut the last line: both the file an uninterrupted run writes.
    grown = tmp_path / "grown.jsonl"
    write_self_prompts(hf, tok, grown, 5, steered())
    write_self_prompts(hf, tok, grown, 12, steered())
    assert grown.read_text() == data
    cut = tmp_path / "cut.jsonl"
    cut.write_text(data[: len(data) - 7])
    (tmp_path / "cut.meta.json").write_text(out.with_suffix(".meta.json").read_text())
    write_self_prompts(hf, tok, cut, 12, steered())
    assert cut.read_text() == data

    # Other openers or another share: refused, not extended; with replace, the file starts over.
    other = {"coding": ["Write code:"], "math": ["Solve:"]}
    with pytest.raises(UserError, match="other settings.*openers_sha1="):
        write_self_prompts(hf, tok, out, 12, steered(other))
    with pytest.raises(UserError, match="other settings.*steered=0.5 \\(now 0.25\\)"):
        write_self_prompts(hf, tok, out, 12, steered(share=0.25))
    assert out.read_text() == data
    write_self_prompts(hf, tok, out, 12, steered(other), replace=True)
    assert len(_lines(out)) == 12 and all(opener_of(r, other) for r in _lines(out) if r["kind"] != FREE)


@pytest.mark.parametrize("content,match", [
    ("coding\tWrite code:\nmath Solve:\n", "Line 2 of the opener file"),       # no tab
    ("free\tAnything\n", "Line 1 of"),                                         # the unsteered rows' kind
    ("coding\t   \n", "Line 1 of"),                                            # no opener
    ("two words\tSolve:\n", "Line 1 of"),                                      # a kind is one word
    ("\n\n", "holds no openers"),
    (b"coding\t\xff\xfe\n", "not UTF-8"),
])
def test_a_malformed_opener_file_is_one_error(tmp_path, content, match):
    path = tmp_path / "openers.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=match) as e:
        read_openers(str(path))
    assert "kind<TAB>opener" in str(e.value) and "\n" not in str(e.value)


def test_a_user_opener_file_is_read_and_checked_before_any_model_loads(chat_target, tmp_path, monkeypatch):
    import dflash_train.generation.run_data as regen_mod
    from dflash_train.config import ConfigError, build_config

    path = tmp_path / "openers.txt"
    path.write_text("coding\tWrite code:\n\nmath\tSolve:\nmath\tProve:\n")
    assert read_openers(str(path)) == {"coding": ["Write code:"], "math": ["Solve:", "Prove:"]}
    assert read_openers("none") == {}
    with pytest.raises(ConfigError, match="data.self_prompt_openers must be"):
        build_config({"data": {"self_prompt_openers": str(tmp_path / "missing.txt")}})
    with pytest.raises(ConfigError, match="data.self_prompt_steered"):
        build_config({"data": {"self_prompt_steered": 1.5}})

    path.write_text("coding Write code:\n")
    monkeypatch.setattr(regen_mod, "load_causal_lm", lambda *a: pytest.fail("a model loaded"))
    cfg = build_config({"model": {"target": chat_target},
                        "data": {"source": str(write_chats(tmp_path / "chats.jsonl", 2)), "regenerate": True,
                                 "self_prompts": 2, "self_prompt_openers": str(path)},
                        "pipeline": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]}})
    with pytest.raises(UserError, match="Line 1 of the opener file"):
        regenerate_data(cfg, tmp_path / "run", make_byte_tokenizer())


def test_self_prompts_are_answered_into_the_run_data_and_tokenize_as_conversations(chat_target, tmp_path,
                                                                                     monkeypatch, caplog):
    """data.regenerate + data.self_prompts through regenerate_for_run: the prompts are written, answered by the
    target into self_regenerated.jsonl, and come back from the chat data loader (mixed with the regenerated
    source, each once) as user + assistant samples."""
    import dflash_train.generation.run_data as regen_mod  # where regenerate_for_run finds load_causal_lm
    from dflash_train.config import build_config
    from dflash_train.data.conversations import ChatEncoder
    from dflash_train.data.dataset import load_dataset
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, p_end=0.08)
    monkeypatch.setattr(regen_mod, "load_causal_lm", lambda target, device: hf)
    data = write_chats(tmp_path / "chats.jsonl", 6)
    cfg = build_config({"model": {"target": chat_target},
                        "data": {"source": str(data), "regenerate": True, "self_prompts": 5, "max_samples": 3,
                                 "heldout_fraction": 0.0, "regenerate_max_new_tokens": 8,
                                 "self_prompt_max_tokens": 24},
                        "pipeline": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]},
                        "run": {"out_dir": str(tmp_path / "run")}})
    d = regenerate_data(cfg, tmp_path / "run", tok)
    run = tmp_path / "run"
    assert d.mix == [str(run / "regenerated.jsonl"), str(run / "self_regenerated.jsonl")] and not d.regenerate
    prompts = _lines(run / "self_prompts.jsonl")
    assert len(prompts) == 5
    builtin = read_openers("builtin")  # the defaults steer: data.self_prompt_openers=builtin, a share of 0.75
    assert any(p["kind"] != FREE for p in prompts)
    assert all(opener_of(p, builtin) for p in prompts if p["kind"] != FREE)
    regen = {r["id"]: r for r in _lines(run / "self_regenerated.jsonl")}
    assert len(regen) == 5
    for p in prompts:
        messages = regen[f"{p['id']}_0"]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[0] == p["messages"][0] and messages[1]["content"]
    with caplog.at_level("INFO", logger="dflash_train"):
        split = load_dataset(d, tok, cache_dir="")
    assert len(split.train) == 3 + 5
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.mix")]
    assert "regenerated.jsonl: 3 training conversations (each once)" in lines[0]
    assert "self_regenerated.jsonl: 5 training conversations (each once)" in lines[1] and "share 62.5%" in lines[1]
    encoder = ChatEncoder(tok, 512)
    by_text = {tuple(s.input_ids): s for s in split.train}
    for p in prompts:
        messages = regen[f"{p['id']}_0"]["messages"]
        sample = by_text[tuple(encoder.encode([messages])[0].input_ids)]
        text = tok.decode(sample.input_ids)
        assert text == (f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n"
                        f"<|im_start|>assistant\n{messages[1]['content']}<|im_end|>\n")
        trained = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        # the answer and its end, never the prompt; an answer cut at max_new_tokens trains no end of turn
        assert trained == messages[1]["content"] + ("" if messages[1].get("truncated") else "<|im_end|>")
    # A rerun resumes: nothing is sampled or answered again.
    before = [(run / f).read_text() for f in ("regenerated.jsonl", "self_prompts.jsonl", "self_regenerated.jsonl")]
    regenerate_data(cfg, run, tok)
    assert [(run / f).read_text() for f in ("regenerated.jsonl", "self_prompts.jsonl", "self_regenerated.jsonl")] \
        == before


def test_prompts_written_again_with_other_settings_get_answers_of_their_own(chat_target, tmp_path, monkeypatch):
    """run.overwrite=true into a data directory kept across runs (the demo's <out>-data): the prompts written with
    other settings replace the old ones under the same ids (self_<n>), and the answers to the old prompts must not
    pass for answers to the new ones: the answers start over, every answer answers its own id's prompt; with fewer
    prompts asked for, the answers file (which the run's data.mix reads whole) holds the answers to those only."""
    import dflash_train.generation.run_data as regen_mod
    from dflash_train.config import build_config
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, p_end=0.08)
    monkeypatch.setattr(regen_mod, "load_causal_lm", lambda target, device: hf)
    data, where = write_chats(tmp_path / "chats.jsonl", 4), tmp_path / "data"

    def cfg(overwrite=True, **data_over):
        return build_config({"model": {"target": chat_target},
                             "data": {"source": str(data), "regenerate": True, "self_prompts": 5,
                                      "heldout_fraction": 0.0, "regenerate_max_new_tokens": 8,
                                      "self_prompt_max_tokens": 24, **data_over},
                             "pipeline": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]},
                             "run": {"out_dir": str(tmp_path / "run"), "overwrite": overwrite}})

    regenerate_data(cfg(), where, tok)
    first, old_answers = _lines(where / "self_prompts.jsonl"), (where / "self_regenerated.jsonl").read_text()
    regenerate_data(cfg(), where, tok)  # the same settings again: every answer kept as it is, none written again
    assert (where / "self_regenerated.jsonl").read_text() == old_answers
    assert len(_lines(where / "self_regenerated.jsonl")) == 5
    regenerate_data(cfg(self_prompt_steered=0.0), where, tok)
    prompts = {r["id"]: r["messages"][0] for r in _lines(where / "self_prompts.jsonl")}
    assert list(prompts.values()) != [r["messages"][0] for r in first]  # written again, with the new settings
    answers = {r["id"]: r["messages"][0] for r in _lines(where / "self_regenerated.jsonl")}
    assert answers == {f"{k}_0": m for k, m in prompts.items()}
    # Fewer prompts asked for: the mix reads the answers whole, so they hold the answers to those only.
    d = regenerate_data(cfg(self_prompt_steered=0.0, self_prompts=3), where, tok)
    answers = {r["id"]: r["messages"][0] for r in _lines(where / "self_regenerated.jsonl")}
    assert answers == {f"{k}_0": m for k, m in list(prompts.items())[:3]}
    assert d.mix == [str(where / "regenerated.jsonl"), str(where / "self_regenerated.jsonl")]
    # Without run.overwrite, answers to other prompts are refused, not trained on.
    (where / "self_regenerated.jsonl").write_text(old_answers)
    with pytest.raises(UserError, match="answers to other prompts"):
        regenerate_data(cfg(overwrite=False, self_prompt_steered=0.0), where, tok)


@pytest.mark.parametrize("self_prompts", [5, 0])
def test_tokenized_ahead_the_run_loads_its_data_from_the_cache(chat_target, tmp_path, monkeypatch, caplog,
                                                                self_prompts):
    """data.tokenize_ahead=true (here on a CPU, where auto leaves it off): every file the regeneration writes is
    tokenized by a child process as it is written, with the settings the run then loads it with (a source of the
    mix beside the self-written prompts' answers, or data.source alone with its data.max_samples), so that the
    run's load is a cache hit, and the data are those a fresh tokenizing of the finished files gives."""
    import dflash_train.generation.run_data as regen_mod
    from dflash_train.config import build_config
    from dflash_train.data.dataset import load_dataset, tokenized_cache_dir
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, p_end=0.08)
    monkeypatch.setattr(regen_mod, "load_causal_lm", lambda target, device: hf)
    cfg = build_config({"model": {"target": chat_target},
                        "data": {"source": str(write_chats(tmp_path / "chats.jsonl", 40)), "regenerate": True,
                                 "self_prompts": self_prompts, "max_samples": 30, "heldout_fraction": 0.1,
                                 "regenerate_max_new_tokens": 8, "self_prompt_max_tokens": 24,
                                 "tokenize_ahead": True},
                        "pipeline": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]},
                        "run": {"out_dir": str(tmp_path / "run")}})
    run = tmp_path / "run"
    with caplog.at_level("INFO", logger="dflash_train"):
        d = regenerate_data(cfg, run, tok)
    files = 2 if self_prompts else 1
    assert sum("while it was written: in the cache" in r.getMessage() for r in caplog.records) == files
    assert not (run / ".tokenize_ahead").exists()
    caplog.clear()
    with caplog.at_level("INFO", logger="dflash_train"):
        split = load_dataset(d, tok, cache_dir=tokenized_cache_dir(d, run))
    loads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat data")]
    assert len(loads) == files and all("cache hit" in line for line in loads)
    fresh = load_dataset(d, tok, cache_dir="")
    assert (split.train, split.heldout, split.heldout_keys) == (fresh.train, fresh.heldout, fresh.heldout_keys)
    assert len(split.train) >= 30 and split.heldout


# ------------------------------------------------------------------------------------------ data.mix

def write_source(path: Path, name: str, n: int) -> str:
    """n one-turn OpenAI records whose text names the source (to count where each training sample came from)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{name}{i}", "messages": [
                {"role": "user", "content": f"{name} question {i}?"},
                {"role": "assistant", "content": f"{name} answer {i}."}]}) + "\n")
    return str(path)


def origins(tok, samples) -> list[str]:
    return [tok.decode(s.input_ids).split("user\n")[1].split(" ")[0] for s in samples]


def test_mix_counts_sum_to_the_total_and_round_each_share_within_one():
    from dflash_train.data.dataset import mix_counts

    assert mix_counts([3, 1], 10) == [8, 2]            # 7.5 and 2.5: the tie goes to the first
    assert mix_counts([1, 1, 1], 10) == [4, 3, 3]
    assert mix_counts([0.5, 0.25, 0.25], 7) == [3, 2, 2]   # 3.5, 1.75, 1.75: the largest remainders round up
    for weights, total in (([1, 2, 3, 4], 97), ([5, 1e-3], 10), ([1], 3)):
        counts = mix_counts(weights, total)
        assert sum(counts) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights))


@pytest.fixture(scope="module")
def byte_tok():
    return make_byte_tokenizer()


def test_a_weighted_mix_follows_its_weights_and_repeats_a_small_source(tmp_path, byte_tok, caplog):
    from dflash_train.config import DataConfig
    from dflash_train.data.dataset import load_dataset

    big, small = write_source(tmp_path / "big.jsonl", "big", 60), write_source(tmp_path / "small.jsonl", "small", 6)
    cfg = DataConfig(mix=[f"{big}:3", f"{small}:1"], max_samples=40, heldout_fraction=0.2)
    with caplog.at_level("INFO", logger="dflash_train"):
        split = load_dataset(cfg, byte_tok, cache_dir=str(tmp_path / "cache"))
    got = origins(byte_tok, split.train)
    assert len(got) == 40 and got.count("big") == 30 and got.count("small") == 10
    small_train = [s for s, o in zip(split.train, got) if o == "small"]
    assert len({tuple(s.input_ids) for s in small_train}) < 10  # fewer than 10 exist on its training side: repeated
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.mix")]
    assert len(lines) == 2 and "share 75.0%" in lines[0] and "share 25.0%" in lines[1]
    assert "(each once)" in lines[0] and "repeated" in lines[1] and "unique tokens" in lines[1]
    # Each source is split on its own; nothing held out is trained on.
    held = origins(byte_tok, split.heldout)
    assert set(held) == {"big", "small"}
    assert not {tuple(s.input_ids) for s in split.heldout} & {tuple(s.input_ids) for s in split.train}
    assert len(split.heldout_messages) == len(split.heldout)
    # Other weights, same cache directory: the cache never hands back another mix's sources.
    other = load_dataset(DataConfig(mix=[f"{big}:1", f"{small}:1"], max_samples=40, heldout_fraction=0.2), byte_tok,
                         cache_dir=str(tmp_path / "cache"))
    assert sorted(Counter(origins(byte_tok, other.train)).items()) == [("big", 20), ("small", 20)]


def test_a_mix_without_weights_takes_every_source_once(tmp_path, byte_tok):
    from dflash_train.config import DataConfig
    from dflash_train.data.dataset import load_dataset

    a, b = write_source(tmp_path / "a.jsonl", "alpha", 12), write_source(tmp_path / "b.jsonl", "beta", 5)
    split = load_dataset(DataConfig(mix=[a, b], heldout_fraction=0.0), byte_tok, cache_dir="")
    assert Counter(origins(byte_tok, split.train)) == {"alpha": 12, "beta": 5}
    capped = load_dataset(DataConfig(mix=[a, b], max_samples=10, heldout_fraction=0.0), byte_tok, cache_dir="")
    assert Counter(origins(byte_tok, capped.train)) == {"alpha": 7, "beta": 3}  # 10 shared by size, 7.06 and 2.94
    roomy = load_dataset(DataConfig(mix=[a, b], max_samples=100, heldout_fraction=0.0), byte_tok, cache_dir="")
    assert Counter(origins(byte_tok, roomy.train)) == {"alpha": 12, "beta": 5}  # at most, never repeated
    weighted = load_dataset(DataConfig(mix=[f"{a}:1", f"{b}:1"], heldout_fraction=0.0), byte_tok, cache_dir="")
    assert Counter(origins(byte_tok, weighted.train)) == {"alpha": 9, "beta": 8}  # 17 in all, half each


@pytest.mark.parametrize("mix,match", [
    (["a.jsonl:0"], "positive weight"), (["a.jsonl:x"], "positive weight"), (["synthetic:1"], "chat data"),
    (["a.jsonl:1", "b.jsonl"], "a weight .* or none"), (["a.jsonl:1", "a.jsonl:2"], "twice"),
])
def test_a_bad_mix_is_one_config_error(mix, match):
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=match):
        build_config({"data": {"mix": mix}})


def test_mix_and_self_prompts_refuse_settings_they_cannot_honour():
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="replaces data.source"):
        build_config({"data": {"mix": ["a.jsonl"], "source": "synthetic"}})
    with pytest.raises(ConfigError, match="regenerate rewrites data.source only"):
        build_config({"data": {"mix": ["a.jsonl"], "regenerate": True}})
    with pytest.raises(ConfigError, match="needs data.regenerate=true"):
        build_config({"data": {"self_prompts": 3}})


def test_a_target_that_writes_no_usable_prompt_trains_on_the_regenerated_source_alone(chat_target, tmp_path,
                                                                                         monkeypatch, caplog):
    import dflash_train.generation.run_data as regen_mod  # where regenerate_for_run finds load_causal_lm
    from dflash_train.config import build_config
    tok = make_byte_tokenizer()
    hf = letter_lm(chat_target, tok, alphabet="a", p_end=0.999)  # every sampled turn is empty
    monkeypatch.setattr(regen_mod, "load_causal_lm", lambda target, device: hf)
    cfg = build_config({"model": {"target": chat_target},
                        "data": {"source": str(write_chats(tmp_path / "chats.jsonl", 4)), "regenerate": True,
                                 "self_prompts": 2, "heldout_fraction": 0.0, "regenerate_max_new_tokens": 4},
                        "pipeline": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]}})
    with caplog.at_level("WARNING", logger="dflash_train"):
        d = regenerate_data(cfg, tmp_path / "run", tok)
    assert d.mix == [] and d.source == str(tmp_path / "run" / "regenerated.jsonl") and d.self_prompts == 0
    assert "no self-written conversation to train on" in caplog.text


def test_a_share_that_rounds_to_nothing_is_said_and_its_held_out_side_kept(tmp_path, byte_tok, caplog):
    from dflash_train.config import DataConfig
    from dflash_train.data.dataset import load_dataset

    big, small = write_source(tmp_path / "big.jsonl", "big", 30), write_source(tmp_path / "small.jsonl", "small", 6)
    with caplog.at_level("WARNING", logger="dflash_train"):
        split = load_dataset(DataConfig(mix=[f"{big}:1000", f"{small}:1"], max_samples=20, heldout_fraction=0.2),
                             byte_tok, cache_dir="")
    assert Counter(origins(byte_tok, split.train)) == {"big": 20}
    assert "gets no training conversations" in caplog.text
    assert "small" in origins(byte_tok, split.heldout)


def test_a_mix_interleaves_its_held_out_sources_so_validation_sees_each(tmp_path, byte_tok):
    """Validation packs its rows from the front of the held-out list: the first rows must hold every source."""
    from dflash_train.config import DataConfig
    from dflash_train.data.dataset import interleave, load_dataset

    assert interleave([[1, 2, 3, 4], ["a", "b"]]) == [1, "a", 2, 3, "b", 4]
    assert interleave([[], [1, 2]]) == [1, 2] and interleave([]) == []
    a, b = write_source(tmp_path / "a.jsonl", "alpha", 60), write_source(tmp_path / "b.jsonl", "beta", 30)
    split = load_dataset(DataConfig(mix=[a, b], heldout_fraction=0.3), byte_tok, cache_dir="")
    names = origins(byte_tok, split.heldout)
    assert Counter(names)["alpha"] > 0 and Counter(names)["beta"] > 0
    half = len(names) // 2
    assert "beta" in names[:half] and "alpha" in names[half:]  # spread over the list, not one source then the other
    alone = {n: load_dataset(DataConfig(source=p, heldout_fraction=0.3), byte_tok, cache_dir="").heldout
             for n, p in (("alpha", a), ("beta", b))}
    for n in ("alpha", "beta"):  # each source's held-out conversations, in their own order
        assert [s.input_ids for s, o in zip(split.heldout, names) if o == n] == [s.input_ids for s in alone[n]]
    assert len(split.heldout_messages) == len(split.heldout)
    assert [{"alpha": "a", "beta": "b"}[n] for n in names] == split.heldout_sources  # validation's by-source labels
    for sample, messages in zip(split.heldout, split.heldout_messages):  # still paired after the interleave
        assert messages[0]["content"] in byte_tok.decode(sample.input_ids)
    alone_keys = {n: load_dataset(DataConfig(source=p, heldout_fraction=0.3), byte_tok, cache_dir="").heldout_keys
                  for n, p in (("alpha", a), ("beta", b))}
    for n in ("alpha", "beta"):  # the keys travel with their samples through the interleave
        assert [k for k, o in zip(split.heldout_keys, names) if o == n] == alone_keys[n]


def test_no_bundled_opener_begins_a_yardstick_prompt():
    """The yardstick measures prompts of another source: an opener of three or more words that begins one of its
    prompts would steer the training data toward it."""
    from dflash_train.generation.self_prompts import read_openers

    openers = [o.casefold() for pool in read_openers("builtin").values() for o in pool if len(o.split()) >= 3]
    assert openers
    prompts = [p.casefold() for p in _yardstick_texts()]
    assert not [(o, p) for o in openers for p in prompts if p.startswith(o)]


def _yardstick_texts() -> list[str]:
    path = Path(__file__).resolve().parent.parent / "src" / "dflash_train" / "prompts" / "yardstick.jsonl"
    return [json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines() if line.strip()]


def test_a_file_with_a_training_side_is_read_only_up_to_its_first_training_conversation(tmp_path, monkeypatch):
    """run_data._has_training_side decides whether a regenerated file joins the mix: it stops at the first training-
    side conversation (the answers file holds 100,000) and reads a file through only when every one is held out."""
    from dflash_train.generation import run_data

    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"id": f"self_{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i in range(5)))
    read = []
    real = run_data.iter_conversations

    def counting(p, counts):
        for conv in real(p, counts):
            read.append(conv)
            yield conv

    monkeypatch.setattr(run_data, "iter_conversations", counting)
    assert run_data._has_training_side(path, seed=0, fraction=0.0) and len(read) == 1  # nothing held out
    read.clear()
    assert not run_data._has_training_side(path, seed=0, fraction=1.0) and len(read) == 5  # everything held out
    assert not run_data._has_training_side(tmp_path / "missing.jsonl", seed=0, fraction=0.0)
