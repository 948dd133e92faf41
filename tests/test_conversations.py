"""Chat data: readers, assistant-only loss masks under several chat templates, the split, the cache."""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_train.config import ConfigError, DataConfig
from dflash_train.data import conversations as conv_mod
from dflash_train.data.conversations import ChatEncoder, DataError, is_heldout, load_chat_dataset
from dflash_train.data.dataset import load_dataset
from dflash_train.data.sources import _iter_json_list, iter_conversations, normalise_record, open_source
from dflash_train.models.target import load_tokenizer


def chatml_with_markers(default_system: str) -> str:
    """ChatML with {% generation %} markers around exactly content + <|im_end|> (the Qwen2.5 layout)."""
    return (
        "{%- for m in messages %}"
        "{%- if loop.first and m.role != 'system' %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{% generation %}{{- m.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


QWEN_MARKED = chatml_with_markers("You are Qwen.")
# SmolLM2's own template plus markers: the reference that the span search must agree with.
CHATML_MARKED = chatml_with_markers("You are a helpful AI assistant named SmolLM, trained by Hugging Face")

# Qwen3-like, no markers: assistant turns after the last user turn get an (empty) think block before the content.
QWEN3_PLAIN = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.\nDone."},
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def _with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def qwen_marked(tok):
    return _with_template(tok, QWEN_MARKED)


@pytest.fixture(scope="module")
def qwen3_plain(tok):
    return _with_template(tok, QWEN3_PLAIN)


def masked_runs(tok, sample) -> list[str]:
    """Decoded contiguous runs of loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def many_chats(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"},
                                               {"from": "gpt", "value": f"Answer number {i}."}]} for i in range(n)]


# ---------------------------------------------------------------------------------------------- readers

def test_normalise_sharegpt_and_openai_records():
    counts = Counter()
    sharegpt = {"id": "x_3", "conversations": [
        {"from": "gpt", "value": "leading reply, nothing asked"},
        {"from": "system", "value": " sys "},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "   "},
        {"from": "chatgpt", "value": "hello\n"},
        {"from": "human", "value": "trailing question"},
    ]}
    c = normalise_record(sharegpt, 0, counts)
    assert c.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]
    assert c.key == "x"  # parts of one ShareGPT chat share the split key
    assert counts == {"leading_assistant_turns_dropped": 1, "empty_turns_dropped": 1}

    openai = {"messages": [{"role": "system", "content": "S"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "ok"}]}
    c = normalise_record(openai, 1, counts)
    assert c.messages[1] == {"role": "user", "content": "a\nb"}
    assert len(c.key) == 40  # no id: keyed by content
    assert normalise_record(openai, 7, Counter()).key == c.key


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "not_an_object"),
    ({"id": "a"}, "no_conversation_key"),
    ({"messages": "hi"}, "conversation_not_a_list"),
    ({"messages": ["hi"]}, "turn_not_an_object"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]}, "tool_calls"),
    ({"messages": [{"role": "user", "content": 5}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "non_text_content"),
    ({"messages": [{"role": "assistant", "content": None}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}, "no_assistant_turn"),
])
def test_malformed_records_are_counted_not_raised(record, reason):
    counts = Counter()
    assert normalise_record(record, 0, counts) is None
    assert {k: n for k, n in counts.items() if k.startswith("skip:")} == {f"skip:{reason}": 1}


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_streaming_json_list_matches_json_load(tmp_path, chunk):
    data = many_chats(5) + [{"s": "x" * 300 + "\\u00e9 \"q\" ]},", "n": [1.5e3, True, None, {}], "e": []}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(data, indent=1))
    with open(path) as f:
        assert list(_iter_json_list(f, path, Counter(), chunk_chars=chunk)) == data


def test_truncated_json_list_keeps_complete_records(tmp_path):
    text = json.dumps(many_chats(3))
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"c2"') + 10])  # cut inside the third record, like the bundled file
    counts = Counter()
    assert [c.key for c in iter_conversations(path, counts)] == ["c0", "c1"]
    assert counts["skip:truncated_file_tail"] == 1


def test_jsonl_with_malformed_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(3) + ["{not json", "[1, 2]", '{"messages": 3}', ""])
    counts = Counter()
    assert [c.key for c in iter_conversations(path, counts)] == ["c0", "c1", "c2"]
    assert counts == {"skip:bad_json_line": 1, "skip:not_an_object": 1, "skip:conversation_not_a_list": 1}


def test_bad_sources_raise_one_clear_sentence(tmp_path, tok):
    cfg = lambda source: DataConfig(source=str(source))  # noqa: E731
    for source, match in [(tmp_path / "missing.jsonl", "does not exist"),
                          (tmp_path / "data.csv", "not a .json or .jsonl"),
                          (tmp_path / "dir.json", "is a directory")]:
        if source.name == "dir.json":
            source.mkdir()
        with pytest.raises(DataError, match=match) as e:
            load_chat_dataset(cfg(source), tok)
        assert source.name in str(e.value) and "data.source" in str(e.value)
    obj = tmp_path / "obj.json"
    obj.write_text('{"conversations": []}')
    with pytest.raises(DataError, match="JSON list"):
        load_chat_dataset(cfg(obj), tok)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"messages": []} {"messages": []}]')
    with pytest.raises(DataError, match="broken.json.*expected ','"):
        load_chat_dataset(cfg(broken), tok)
    useless = write_jsonl(tmp_path / "useless.jsonl", ["oops", {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match=r"no usable training conversations.*bad_json_line.*no_assistant_turn"):
        load_chat_dataset(cfg(useless), tok)


def test_tokenizer_without_chat_template(tmp_path, tok):
    bare = _with_template(tok, None)
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(2))
    with pytest.raises(DataError, match="no chat template"):
        load_chat_dataset(DataConfig(source=str(path)), bare)


# ---------------------------------------------------------------------------------------------- masks

@pytest.mark.parametrize("template", ["smollm2", "qwen_marked", "qwen3_plain"])
@pytest.mark.parametrize("with_system", [True, False])
def test_loss_mask_is_exactly_assistant_content_and_end_of_turn(request, template, with_system):
    tokenizer = request.getfixturevalue("tok" if template == "smollm2" else template)
    messages = CHAT if with_system else CHAT[1:]
    encoder = ChatEncoder(tokenizer, max_length=4096)
    assert encoder.mask_rule == ("generation_markers" if template == "qwen_marked" else "template_spans")
    (sample,) = encoder.encode([messages])
    # ids are exactly what the template produces (SmolLM2's default system prompt included when none is given)
    assert sample.input_ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert masked_runs(tokenizer, sample) == ["4.<|im_end|>", "It is 6.\nDone.<|im_end|>"]
    if template == "qwen3_plain":
        assert "<think>" in tokenizer.decode(sample.input_ids)  # present in the input, outside the mask


@pytest.mark.parametrize("template", ["smollm2", "qwen_marked", "qwen3_plain"])
def test_a_truncated_reply_trains_no_end_of_turn(request, template):
    """A regenerated reply cut at max_new_tokens ("truncated") keeps its content in the loss but not the end-of-turn
    token the template closes it with (the target never emitted it there); the other replies keep theirs."""
    tokenizer = request.getfixturevalue("tok" if template == "smollm2" else template)
    messages = [dict(m) for m in CHAT]
    messages[2]["truncated"] = True
    (sample,) = ChatEncoder(tokenizer, max_length=4096).encode([messages])
    assert masked_runs(tokenizer, sample) == ["4.", "It is 6.\nDone.<|im_end|>"]
    messages[2].pop("truncated")
    messages[4]["truncated"] = True
    (sample,) = ChatEncoder(tokenizer, max_length=4096).encode([messages])
    assert masked_runs(tokenizer, sample) == ["4.<|im_end|>", "It is 6.\nDone."]


def test_span_search_agrees_with_generation_markers_on_sharegpt(tok):
    """The span search (SmolLM2's plain template) against the template's own markers, on real ShareGPT chats."""
    reference = ChatEncoder(_with_template(tok, CHATML_MARKED), max_length=2048)
    encoder = ChatEncoder(tok, max_length=2048)
    counts, chats = Counter(), []
    with open_source("sharegpt") as path:
        for c in iter_conversations(path, counts):
            chats.append(c.messages)
            if len(chats) == 48:
                break
    got, want = encoder.encode(chats), reference.encode(chats)
    assert sum(not isinstance(s, str) for s in got) >= 40  # a few open with a user paste past max_length
    for g, w in zip(got, want):
        assert g == w


def test_template_that_rerenders_history_falls_back_to_search(tok):
    # The system header counts the messages, so no shorter prefix render is a prefix of the full text.
    counting = _with_template(tok, "{{- '<|im_start|>system\\n' + messages|length|string + '<|im_end|>\\n' }}"
                                   "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
                                   "'<|im_end|>\\n' }}{%- endfor %}"
                                   "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    echo = [{"role": "user", "content": "Say 4."}, *CHAT[2:]]  # the first answer also stands inside the question
    (sample,) = ChatEncoder(counting, 4096).encode([echo])
    assert masked_runs(tok, sample) == ["4.<|im_end|>", "It is 6.\nDone.<|im_end|>"]
    first = sample.loss_mask.index(True)
    assert tok.decode(sample.input_ids[:first]).endswith("Say 4.<|im_end|>\n<|im_start|>assistant\n")
    shouting = _with_template(tok, tok.chat_template.replace("message['content']", "message['content'] | upper"))
    assert ChatEncoder(shouting, 4096).encode([CHAT]) == ["assistant_content_not_in_template_output"]


def test_truncation(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]
    full, = ChatEncoder(tok, 4096).encode([messages])
    (cut,) = ChatEncoder(tok, 40).encode([messages])
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]
    long_question = [{"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "because"}]
    assert ChatEncoder(tok, 40).encode([long_question]) == ["no_assistant_tokens_within_max_length"]


# ---------------------------------------------------------------------------------------------- split, cache

def test_split_is_deterministic_and_capped(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(200))
    cfg = DataConfig(source=str(path), heldout_fraction=0.2, heldout_max=30)
    a, b = load_chat_dataset(cfg, tok, seed=0), load_chat_dataset(cfg, tok, seed=0)
    assert a.heldout_messages == b.heldout_messages and a.train == b.train
    assert len(a.heldout) == len(a.heldout_messages) == 30  # ~40 hash under 0.2, capped
    c = load_chat_dataset(cfg, tok, seed=1)
    assert c.heldout_messages != a.heldout_messages
    held_q = {m[0]["content"] for m in a.heldout_messages}
    keys_held = [f"c{i}" for i in range(200) if is_heldout(f"c{i}", 0, 0.2)]
    assert held_q == {f"Question number {k[1:]}?" for k in keys_held[:30]}  # first 30 in file order
    assert a.heldout_keys == keys_held[:30]  # each held-out sample's conversation key, in the same order
    assert a.stats["heldout_overflow"] == len(keys_held) - 30
    assert len(a.train) == 200 - len(keys_held)  # overflow is dropped, never trained on


def test_max_samples_takes_first_train_conversations_and_stops_early(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(300))
    full = load_chat_dataset(DataConfig(source=str(path), heldout_fraction=0.1, heldout_max=5), tok)
    small = load_chat_dataset(DataConfig(source=str(path), heldout_fraction=0.1, heldout_max=5, max_samples=20), tok)
    assert small.train == full.train[:20] and small.heldout == full.heldout
    assert small.stats["stopped_early"] and small.stats["conversations"] < 100
    monkeypatch.setattr(conv_mod, "ENCODE_BATCH", 1)  # batching never changes the result
    one = load_chat_dataset(DataConfig(source=str(path), heldout_fraction=0.1, heldout_max=5, max_samples=20), tok)
    assert one.train == small.train and one.heldout == small.heldout


@pytest.mark.timeout(300)  # the hang this guards against: forked workers waiting on the tokenizer's thread pool
def test_worker_processes_give_the_in_process_split(tmp_path, tok, monkeypatch):
    """data.tokenize_workers=2 (forked processes, many small batches in flight) gives exactly what tokenizing in
    this process gives: the same samples in the same order, the same held-out set, the same counts, with caps
    reached mid-flight and conversations skipped on the way (a long question leaves no answer within max_length).
    TOKENIZERS_PARALLELISM=true, with the tokenizer's thread pool used in this process first: forked workers that
    kept it on would wait forever on threads that do not exist in them."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    monkeypatch.setattr(conv_mod, "ENCODE_BATCH", 3)
    chats = many_chats(400)
    for i in range(0, 400, 7):
        chats[i]["conversations"][0]["value"] = "word " * 200
    path = write_jsonl(tmp_path / "d.jsonl", chats)
    cfg = dict(source=str(path), heldout_fraction=0.2, heldout_max=30, max_length=64, max_samples=150)
    here = load_chat_dataset(DataConfig(**cfg, tokenize_workers=0), tok)
    pooled = load_chat_dataset(DataConfig(**cfg, tokenize_workers=2), tok)
    assert here.stats["skipped"]["no_assistant_tokens_within_max_length"] > 0
    assert here.stats["stopped_early"] and len(here.train) == 150 and len(here.heldout) == 30
    assert (pooled.train, pooled.heldout, pooled.heldout_messages) == (here.train, here.heldout, here.heldout_messages)
    assert pooled.stats == here.stats


def _die(batch):
    os._exit(3)  # a worker killed mid-batch (e.g. by the out-of-memory killer)


@pytest.mark.timeout(300)
def test_a_worker_that_dies_is_one_clear_error(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(conv_mod, "_encode_in_worker", _die)   # the forked workers inherit it
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(50))
    with pytest.raises(DataError, match="A tokenizing worker process died .* set data.tokenize_workers=0"):
        load_chat_dataset(DataConfig(source=str(path), tokenize_workers=2), tok)


def test_tokenize_workers_auto(tmp_path, monkeypatch):
    small = write_jsonl(tmp_path / "d.jsonl", many_chats(10))
    cfg = DataConfig(source=str(small))
    monkeypatch.setattr(conv_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert conv_mod.tokenize_workers(cfg, small) == 0                  # a small file: spawning costs more
    monkeypatch.setattr(conv_mod, "AUTO_WORKERS_MIN_BYTES", 1)
    assert conv_mod.tokenize_workers(cfg, small) == 15                 # one core left free
    monkeypatch.setattr(conv_mod.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert conv_mod.tokenize_workers(cfg, small) == 15                 # at most 15
    few = DataConfig(source=str(small), max_samples=512)
    assert conv_mod.tokenize_workers(few, small) == 0                  # a few conversations of a large file
    monkeypatch.setattr(conv_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert conv_mod.tokenize_workers(cfg, small) == 0                  # 2 cores (CI): in this process
    assert conv_mod.tokenize_workers(DataConfig(source=str(small), tokenize_workers=3), small) == 3
    with pytest.raises(ConfigError, match="data.tokenize_workers is -1"):
        DataConfig(source=str(small), tokenize_workers=-1)


def test_cache_hit_skips_the_tokenizer(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(50))
    cfg = DataConfig(source=str(path), heldout_fraction=0.1)
    first = load_chat_dataset(cfg, tok, cache_dir=str(tmp_path / "cache"))
    assert first.stats["cache"] == "miss"
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".npz"]  # no temporary file left behind

    def boom(*a, **k):
        raise AssertionError("tokenizer called on a cache hit")

    with monkeypatch.context() as m:
        m.setattr(type(tok), "__call__", boom)
        m.setattr(type(tok), "apply_chat_template", boom)
        second = load_chat_dataset(cfg, tok, cache_dir=str(tmp_path / "cache"))
    assert second.stats["cache"] == "hit"
    assert (second.train, second.heldout, second.heldout_messages, second.heldout_keys) == \
           (first.train, first.heldout, first.heldout_messages, first.heldout_keys)
    assert len(first.heldout_keys) == len(first.heldout) > 0
    other = load_chat_dataset(DataConfig(source=str(path), heldout_fraction=0.1, max_length=64), tok,
                              cache_dir=str(tmp_path / "cache"))
    assert other.stats["cache"] == "miss"  # a setting that changes the tokens changes the key


def test_load_dataset_end_to_end(tmp_path, tok, caplog):
    records = [{"id": "o1", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                                         {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", records + many_chats(20) + ["garbage"])
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        split = load_dataset(DataConfig(source=str(path), heldout_fraction=0.0), tok)
    assert len(split.train) == 21 and split.heldout == [] and split.heldout_messages == []
    assert masked_runs(tok, split.train[0]) == ["a<|im_end|>"]
    assert split.stats["skipped"] == {"bad_json_line": 1}
    assert "21 train / 0 held-out" in caplog.text


def test_the_embedded_target_tokenizes_digits_as_smollm2_does(tok):
    """The converted SmolLM2 tokenizer keeps its own pre-tokenizer (each digit a piece of its own, then ByteLevel),
    not the GPT-2 split transformers' GGUF conversion gives it: "\\n\\n" before a list's "1" is the one token the
    model emits (1116), where the GPT-2 split made two "\\n" (198, 198), and a reply round-trips through text."""
    ids = tok(":\n\n1. Apples", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids][:3] == [":", "\n\n", "1"]
    assert [tok.decode([i]) for i in tok(" 2021", add_special_tokens=False)["input_ids"]] == [" ", "2", "0", "2", "1"]
    pieces = [tok.decode([i]) for i in tok("a\n\nThe b", add_special_tokens=False)["input_ids"]]
    assert pieces == ["a", "\n", "\n", "The", " b"]  # no digit: the same split as GPT-2's (and the model's)


def write_gguf_with_every_value_type(path, order) -> None:
    """A GGUF in byte order `order` with each kind of metadata value before and after `tokenizer.ggml.pre`."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama", endianess=order)
    w.add_uint32("a.u32", 7)
    w.add_float64("a.f64", 0.5)
    w.add_bool("a.bool", True)
    w.add_array("a.strings", ["x", "", "yz" * 40])
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.floats", [0.25, 1.5])
    w.add_array("a.bools", [True, False, True])
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("after.tokens", [f"t{i}" for i in range(50)])
    w.add_string("after.name", "caf\u00e9")
    w.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_inside_gguf_parsed_once_a_file_is_parsed_once_and_the_names_come_back(tmp_path):
    """models/target.gguf_parsed_once: the demo's conversion loads the tokenizer and the model of one GGUF, and
    transformers parses the file for each; inside, the second parse is the first one's reader (and gguf's name map
    built once per architecture and depth), a different file gets its own, and on the way out, an error's too,
    gguf's own functions are back."""
    import gguf
    from gguf import GGUFEndian

    from dflash_train.models.target import gguf_parsed_once

    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf_with_every_value_type(first, GGUFEndian.LITTLE)
    write_gguf_with_every_value_type(second, GGUFEndian.LITTLE)
    real = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        from gguf import GGUFReader, get_tensor_name_map  # as transformers imports them, at each call
        reader = GGUFReader(first)
        assert GGUFReader(first) is reader and GGUFReader(second) is not reader
        assert bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]) == b"smollm"
        arch = gguf.MODEL_ARCH.LLAMA
        assert get_tensor_name_map(arch, 2) is get_tensor_name_map(arch, 2)
        assert get_tensor_name_map(arch, 3) is not get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real
    with pytest.raises(RuntimeError, match="mid-load"), gguf_parsed_once():
        raise RuntimeError("mid-load")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)
    ran = []
    with pytest.MonkeyPatch.context() as mp:  # gguf not installed: the load inside names the fix, not this
        mp.setitem(sys.modules, "gguf", None)
        with gguf_parsed_once():
            ran.append(True)
    assert ran == [True]


def test_gguf_string_value_reads_what_gguf_reads(tmp_path):
    """gguf_string_value skips every kind of metadata value on its way to a key (strings, scalars, arrays of numbers,
    strings and bools) and returns what gguf's own GGUFReader returns, in files of either byte order; a header cut
    short, also inside the value asked for, and a file that is not a GGUF are one clear error each."""
    from gguf import GGUFEndian, GGUFReader

    from dflash_train.models.gguf_header import GGUFError, gguf_string_value

    for order in (GGUFEndian.LITTLE, GGUFEndian.BIG):
        path = tmp_path / f"meta-{order.name}.gguf"
        write_gguf_with_every_value_type(path, order)
        fields = GGUFReader(path).fields
        for key in ("tokenizer.ggml.pre", "after.name", "general.architecture"):
            assert gguf_string_value(path, key) == bytes(fields[key].parts[-1]).decode(), (order, key)
        assert gguf_string_value(path, "a.u32") is None  # not a string
        assert gguf_string_value(path, "no.such.key") is None
    cut = tmp_path / "cut.gguf"
    whole = path.read_bytes()
    cut.write_bytes(whole[:60])
    with pytest.raises(GGUFError, match="ends inside its metadata"):
        gguf_string_value(cut, "no.such.key")
    cut.write_bytes(whole[:whole.index(b"smollm") + 3])  # cut inside the value itself
    with pytest.raises(GGUFError, match="ends inside its metadata"):
        gguf_string_value(cut, "tokenizer.ggml.pre")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(60))  # a zip archive
    with pytest.raises(GGUFError, match="not a GGUF file"):
        gguf_string_value(other, "tokenizer.ggml.pre")


def test_gguf_pre_tokenizer_restored_by_its_type(tmp_path):
    """restore_gguf_pre_tokenizer reads `tokenizer.ggml.pre` and rebuilds the types it knows; others are left alone."""
    from types import SimpleNamespace

    from gguf import GGUFWriter

    from dflash_train.models.gguf_header import GGUF_PRE_TOKENIZERS, restore_gguf_pre_tokenizer

    def gguf_with_pre(name: str | None):
        path = tmp_path / f"{name}.gguf"
        w = GGUFWriter(str(path), "llama")
        if name is not None:
            w.add_string("tokenizer.ggml.pre", name)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    for pre, changed in (("smollm", True), ("gpt2", False), (None, False)):
        tokenizer = SimpleNamespace(backend_tokenizer=SimpleNamespace(pre_tokenizer="as converted"))
        restore_gguf_pre_tokenizer(tokenizer, gguf_with_pre(pre))
        got = tokenizer.backend_tokenizer.pre_tokenizer
        assert (got != "as converted") == changed, pre
        if changed:
            assert pre in GGUF_PRE_TOKENIZERS and "Digits" in str(got.__getstate__())


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_the_cache_leaves_the_collector_as_it_found_it(tmp_path, tok, enabled):
    """The cache's samples are built with the garbage collector paused; it is on again after, unless it was off."""
    import gc
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(30))
    cfg = DataConfig(source=str(path), heldout_fraction=0.2)
    first = load_chat_dataset(cfg, tok, cache_dir=str(tmp_path / "cache"))
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        again = load_chat_dataset(cfg, tok, cache_dir=str(tmp_path / "cache"))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert again.stats["cache"] == "hit" and (again.train, again.heldout) == (first.train, first.heldout)


def test_a_tokenizer_replaced_at_the_same_path_is_not_served_from_the_cache(tmp_path):
    """A model directory whose tokenizer was replaced (same path, same vocabulary size, same chat template, other
    token ids: e.g. a corrected tokenizer.json) is tokenized afresh: a cache hit would train on the old ids."""
    from transformers import AutoTokenizer

    from tiny_chat import make_byte_tokenizer

    target = tmp_path / "target"
    path = write_jsonl(tmp_path / "d.jsonl", many_chats(20))
    cfg = DataConfig(source=str(path), heldout_fraction=0.0)
    cache = str(tmp_path / "cache")
    make_byte_tokenizer().save_pretrained(target)
    old = load_chat_dataset(cfg, AutoTokenizer.from_pretrained(target), cache_dir=cache)
    make_byte_tokenizer(reverse=True).save_pretrained(target)  # the same files, the ids reversed
    new_tok = AutoTokenizer.from_pretrained(target)
    new = load_chat_dataset(cfg, new_tok, cache_dir=cache)
    fresh = load_chat_dataset(cfg, new_tok, cache_dir=None)
    assert fresh.train != old.train  # the two tokenizers do give other ids
    assert new.stats["cache"] == "miss" and new.train == fresh.train


def test_ids_that_read_as_parts_of_one_chat_are_named_when_they_defeat_the_split(tmp_path, tok, caplog):
    """FastChat-style ids `identity_0`, `identity_1`, ... read as parts of one ShareGPT chat `identity`: every
    conversation then lands on the same side of the split. Training on all of them warns (validation would be off
    with advice to raise data.heldout_fraction, which cannot help), all held out fails, each naming the ids."""
    records = many_chats(30)
    for i, r in enumerate(records):
        r["id"] = f"identity_{i}"
    path = write_jsonl(tmp_path / "identity.jsonl", records)
    cfg = DataConfig(source=str(path), heldout_fraction=0.2)
    seeds = {side: next(s for s in range(100) if is_heldout("identity", s, 0.2) == side) for side in (False, True)}
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        split = load_chat_dataset(cfg, tok, seed=seeds[False])
    assert (len(split.train), len(split.heldout)) == (30, 0)
    assert "30 of the 30 conversations read share the split key 'identity'" in caplog.text
    assert "an id that does not end in _<number>" in caplog.text
    with pytest.raises(DataError, match="30 of the 30 conversations read share the split key 'identity'"):
        load_chat_dataset(cfg, tok, seed=seeds[True])
    caplog.clear()  # distinct ids, and ShareGPT parts of a few chats among many: no word of it
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        load_chat_dataset(DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", many_chats(30))),
                                     heldout_fraction=0.2), tok)
    assert "share the split key" not in caplog.text
