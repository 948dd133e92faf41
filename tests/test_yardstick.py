"""The bundled yardstick prompt set: loads by name, 80+ distinct prompts over the 8 categories, each renders
through a chat template, and its categories reach the eval report."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dflash_train.inference.prompts import (YARDSTICK_PATH, PromptError, read_prompt_file, tokenize_prompts,
                                            yardstick_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_yardstick_file_shape():
    records = [json.loads(line) for line in YARDSTICK_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(records) >= 80
    counts = Counter(r["category"] for r in records)
    assert set(counts) == CATEGORIES and min(counts.values()) >= 10
    assert len({r["id"] for r in records}) == len(records)
    texts = [r["messages"][0]["content"].strip().lower() for r in records]
    assert len(set(texts)) == len(texts)
    for r in records:
        assert r["id"].startswith(r["category"] + "_")
        assert [m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"].strip()
    lengths = sorted(len(t) for t in texts)   # a line to a paragraph
    assert lengths[0] < 80 and lengths[-1] > 300


def test_yardstick_loads_by_name_and_tokenizes():
    from tiny_chat import make_byte_tokenizer

    prompts = yardstick_prompts()
    assert [p.id for p in prompts] == [p.id for p in read_prompt_file("yardstick")]
    assert all(p.kind == "messages" and p.category in CATEGORIES and p.id for p in prompts)
    tok = make_byte_tokenizer()
    ids = tokenize_prompts(prompts, tok)
    tail = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert len(ids) == len(prompts) and all(x[-len(tail):] == tail and len(x) > len(tail) + 10 for x in ids)


def test_category_must_be_a_string(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"category": 3, "prompt": "hi"}) + "\n")
    with pytest.raises(PromptError, match='"category" must be a string'):
        read_prompt_file(f)
    with pytest.raises(PromptError, match="bundled set"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_question_records_are_one_user_turn(tmp_path):
    """Prompt sets as other benchmarks write them: MT-Bench's "turns" (the first: the second needs the model's own
    answer), Alpaca's "instruction" + "input", Dolly's "context", a bare "question"; integer ids kept as strings; in
    JSON lines or as one JSON list."""
    f = tmp_path / "q.jsonl"
    records = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another one."]},
               {"instruction": "Summarise this:", "input": "A long text.", "output": "ignored"},
               {"instruction": "Name three rivers.", "input": ""},
               {"instruction": "Answer from the text:", "context": "Rivers flow.", "response": "ignored"},
               {"question": "Why is the sky blue?", "id": "q4"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = read_prompt_file(f)
    assert [p.kind for p in prompts] == ["messages"] * 5
    assert [p.value[0]["content"] for p in prompts] == ["Write a haiku.", "Summarise this:\n\nA long text.",
                                                         "Name three rivers.", "Answer from the text:\n\nRivers flow.",
                                                         "Why is the sky blue?"]
    assert all(p.value == [{"role": "user", "content": p.value[0]["content"]}] for p in prompts)
    assert [p.id for p in prompts] == ["81", None, None, None, "q4"] and prompts[0].category == "writing"
    from tiny_chat import make_byte_tokenizer

    tok = make_byte_tokenizer()
    ids = tokenize_prompts(prompts, tok)  # rendered with the chat template, as chats are
    tail = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert all(x[-len(tail):] == tail for x in ids)
    listed = tmp_path / "q.json"  # the same records as one JSON list (Alpaca's own files are such lists)
    listed.write_text(json.dumps(records, indent=2))
    assert read_prompt_file(listed) == prompts
    listed.write_text(json.dumps(records)[:-1])
    with pytest.raises(PromptError, match="is not valid JSON"):
        read_prompt_file(listed)
    listed.write_text(json.dumps([records[0], {"answer": "no question"}]))
    with pytest.raises(PromptError, match="q.json record 1 is not a prompt record"):
        read_prompt_file(listed)
    for bad, words in (({"turns": []}, '"turns" must start with the question'),
                       ({"question": "hi", "id": 1.5}, '"id" must be a string or an integer'),
                       ({"answer": "no question here"}, "is not a prompt record")):
        f.write_text(json.dumps(bad) + "\n")
        with pytest.raises(PromptError, match=words):
            read_prompt_file(f)


def test_a_prompt_is_a_user_turn_and_text_is_raw(tmp_path):
    """{"prompt": ...} and a bare string are requests: rendered as a user turn with the chat template, as the DFlash
    authors' benchmark renders its prompts (a chat drafter measured on raw continuations would read low); without a
    chat template, raw. {"text": ...} is always the raw text, for a continuation."""
    from tiny_chat import make_byte_tokenizer

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ({"prompt": "Hi there"}, "Hi there", {"text": "Hi there"},
                                                    {"messages": [{"role": "user", "content": "Hi there"}]})))
    prompts = read_prompt_file(f)
    assert [p.kind for p in prompts] == ["request", "request", "text", "messages"]
    tok = make_byte_tokenizer()
    request, bare, raw, chat = tokenize_prompts(prompts, tok)
    assert request == bare == chat != raw
    assert raw == tok("Hi there")["input_ids"]

    def no_template(text, **kw):  # the same tokenizer, without its chat template
        return tok(text, **kw)
    no_template.chat_template = None
    assert tokenize_prompts(prompts[:3], no_template) == [raw, raw, raw]
    with pytest.raises(PromptError, match="no chat template"):
        tokenize_prompts(prompts[3:], no_template)


def test_eval_reports_tau_per_category(tiny_llama):
    import torch

    from dflash_train.config import ModelConfig
    from dflash_train.inference.benchmark import evaluate
    from dflash_train.inference.report import format_summary
    from dflash_train.models.build import build_drafter
    from dflash_train.models.target import load_target

    t = load_target(tiny_llama, [1, 2], truncate=False)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(target_layer_ids=[1, 2], block_size=4, num_draft_layers=1,
                                        mask_token_id=t.info.vocab_size - 1), t.info)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    rep = evaluate(t, drafter, prompts, 8, categories=["math", "math", None], warmup=False)
    s = rep.summary()
    taus = [p.tau for p in rep.prompts]
    assert set(s["tau_by_category"]) == {"math"}
    assert s["tau_by_category"]["math"] == pytest.approx((taus[0] + taus[1]) / 2)
    assert "tau by category" in format_summary(rep)
    assert evaluate(t, drafter, prompts[:1], 4, warmup=False).summary()["tau_by_category"] is None
