"""Every mistake a user can make is one `error:` line naming the fix, exit 2 (issue 17, findings 4-8).

Each test below pins one finding (it failed before the fix); the property test at the end feeds every config key
(read from the dataclasses, so a new key is covered the day it is added) out-of-range and unparseable values through
the CLI entry and asserts exit 2 with exactly one `error:` line, never a traceback and never a start. Training itself
is replaced by a function that fails the test: every error here must come before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections import Counter
from pathlib import Path

import pytest

from dflash_train import cli
from dflash_train.config import Config, ConfigError, load_config
from dflash_train.data.sources import iter_conversations
from dflash_train.errors import UserError


@pytest.fixture
def no_training(monkeypatch):
    """cli train reaching the training call is a failure here: the error had to come first."""
    import dflash_train.train

    def reached(*_a, **_k):
        raise AssertionError("the value was accepted: training started")

    monkeypatch.setattr(dflash_train.train, "train", reached)


def run_cli(argv, capsys) -> tuple[int, list[str]]:
    """cli.main in-process -> (exit code, the stderr lines)."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


def assert_one_error(rc: int, lines: list[str], *words: str) -> str:
    assert rc == 2, (rc, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def config_keys(message: str) -> set[str]:
    """The `name.name` words of a message that are not file names: each must be a real config key."""
    import re

    files = ("json", "jsonl", "jinja", "model", "txt", "gguf", "yaml", "tiktoken")
    return {m for m in re.findall(r"\b([a-z_]+\.[a-z_]+)\b", message) if m.split(".")[1] not in files}


def all_keys() -> set[str]:
    hints = typing.get_type_hints(Config)
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(hints[s.name])}


# ------------------------------------------------------------------------- 4: numbers nobody checked

@pytest.mark.parametrize("overrides, key", [
    (["train.max_steps=-5"], "train.max_steps"),                       # was: 0 steps, an untrained drafter
    (["train.max_steps=0"], "train.max_steps"),
    (["train.token_budget=4", "train.num_anchors=2"], "train.token_budget"),   # block 8: loss 0.0000 every step
    (["train.num_anchors=1024"], "train.num_anchors"),                 # budget 256: 3x slower for nothing
    (["train.log_every=0"], "train.log_every"),                        # was: ZeroDivisionError
    (["pipeline.stall_timeout_s=0"], "pipeline.stall_timeout_s"),
    (["train.betas=[0.9, 1.0]"], "train.betas"),                       # was: torch ValueError in drafter0
    (["train.betas=[-0.1, 0.9]"], "train.betas"),
    (["train.weight_decay=-0.1"], "train.weight_decay"),
    (["train.lr=.nan"], "train.lr"),                                   # a NaN passes every `x <= 0` check
    (["train.warmup_ratio=1.5"], "train.warmup_ratio"),
    (["train.epochs=0"], "train.epochs"),
    (["train.seed=-1"], "train.seed"),
    (["model.mask_token_id=-3"], "model.mask_token_id"),
])
def test_out_of_range_numbers_are_one_line(overrides, key, capsys, no_training):
    rc, lines = run_cli(["train", "--config", "tiny_cpu", *overrides], capsys)
    assert_one_error(rc, lines, key)


def test_recipes_still_load():
    """The new range and relation checks accept every bundled recipe (a refusal raises ConfigError here)."""
    for name in ("tiny_cpu", "smollm2_demo", "smollm2_gpu", "smollm2_gpu2", None):
        cfg = load_config(name)
        assert cfg.train.num_anchors < cfg.train.token_budget and cfg.model.block_size <= cfg.train.token_budget


# ------------------------------------------------------------------------- 5: tracebacks for user mistakes

@pytest.mark.parametrize("override, key", [("train.betas=[0.9,", "train.betas"),
                                           ("data.source=*.jsonl", "data.source"),
                                           ("train.lr={1: 2", "train.lr")])
def test_override_yaml_cannot_parse(override, key, capsys, no_training):
    rc, lines = run_cli(["train", "--config", "tiny_cpu", override], capsys)
    assert_one_error(rc, lines, key, "YAML")


def test_out_dir_is_a_file(tmp_path, capsys, no_training):
    f = tmp_path / "a_file"
    f.write_text("x")
    rc, lines = run_cli(["train", "--config", "tiny_cpu", f"run.out_dir={f}"], capsys)
    assert_one_error(rc, lines, "run.out_dir", "is a file")


def test_out_dir_cannot_be_created(tmp_path, capsys, tiny_llama):
    # /proc refuses new directories even to root (a chmod'ed directory would not stop root, who runs CI here).
    rc, lines = run_cli(["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", "train.max_steps=1",
                         "run.out_dir=/proc/dflash-train-test/run"], capsys)
    assert_one_error(rc, lines, "run.out_dir")


def test_config_file_not_utf8(tmp_path, capsys, no_training):
    p = tmp_path / "run.yaml"
    head = b"train:\n  lr: 1.0e-3  # caf"
    p.write_bytes(head + b"\xe9\n")
    rc, lines = run_cli(["train", "--config", str(p)], capsys)
    assert_one_error(rc, lines, "not UTF-8", f"byte {len(head)})")


def test_eval_prompt_file_is_read_before_training(tmp_path, capsys, no_training):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')      # was: read by the measurement after training
    rc, lines = run_cli(["train", "--config", "tiny_cpu", f"data.eval_prompts={p}", "train.final_eval_prompts=2"],
                        capsys)
    assert_one_error(rc, lines, "Prompt file", "not UTF-8")


def test_unwritable_cache_dir_is_a_warning(tmp_path, caplog):
    from tiny_chat import make_byte_tokenizer, write_chats

    from dflash_train.config import DataConfig
    from dflash_train.data.conversations import load_chat_dataset

    p = write_chats(tmp_path / "chats.jsonl", 4)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        split = load_chat_dataset(DataConfig(source=str(p), heldout_fraction=0.0), make_byte_tokenizer(),
                                  cache_dir="/proc/dflash-train-test/cache")   # was: FileNotFoundError traceback
    assert len(split.train) == 4 and split.stats["cache"] == "unwritable"
    assert "not cached" in caplog.text and "data.cache_dir" in caplog.text


def test_prompt_file_not_utf8_names_the_true_byte(tmp_path, capsys):
    from dflash_train.inference.prompts import PromptError, read_prompt_file

    good = (json.dumps({"prompt": "hello there " * 20}) + "\n").encode()
    head = good * 200                    # > 8 KB: past the text stream's first read chunk
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(head + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptError) as e:
        read_prompt_file(p)
    bad = len(head) + len(b'{"prompt": "caf')
    assert f"at byte {bad} (line 201)" in str(e.value) and "UTF-8" in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["regenerate", "--data", "chats.jsonl", "--out", "adir.jsonl"], ["is a directory"]),
    (["regenerate", "--data", "chats.jsonl", "--out", "o.jsonl", "--max-length", "1"], ["--max-length"]),
    (["eval", "--drafter", "nope", "--out", "A_FILE"], ["--out", "is a file"]),
    (["eval", "--drafter", "nope", "--out", "/proc/dflash-train-test/eval"], ["--out", "cannot be created"]),
    (["eval", "--drafter", "nope", "--num-prompts", "0"], ["--num-prompts"]),
    (["eval", "--drafter", "nope", "--timed-prompts", "0"], ["--timed-prompts"]),
])
def test_regenerate_and_eval_arguments(argv, words, tmp_path, monkeypatch, capsys):
    # Each is refused before a model loads (the drafter and target are never read): was a traceback, or minutes
    # of decoding before the unwritable --out failed.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir.jsonl").mkdir()
    (tmp_path / "A_FILE").write_text("x")
    (tmp_path / "chats.jsonl").write_text("")
    rc, lines = run_cli(argv, capsys)
    assert_one_error(rc, lines, *words)


@pytest.mark.parametrize("argv, words", [
    (["demo", "--minutes", "0"], ["--minutes must be positive (got 0)"]),   # was: train.max_minutes, not set by hand
    (["demo", "--out", "A_FILE/run"], ["the demo's cache directory A_FILE/.cache cannot be created", "another --out"]),
    (["demo", "--out", "run", "data.cache_dir=A_FILE/c"], ["A_FILE/c cannot be created", "another data.cache_dir"]),
])
def test_demo_arguments(argv, words, tmp_path, monkeypatch, capsys):
    # Each is refused before the GGUF is converted (was a FileNotFoundError traceback for an unwritable --out).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "A_FILE").write_text("x")
    rc, lines = run_cli(argv, capsys)
    assert_one_error(rc, lines, *words)


def test_a_training_run_passed_as_the_drafter_names_its_drafter(tmp_path, capsys):
    # `eval --drafter runs/x` (the run, not runs/x/drafter) said only that runs/x/config.json does not exist
    from dflash_train.models.checkpoint import CONFIG_NAME

    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / CONFIG_NAME).write_text("{}")
    rc, lines = run_cli(["eval", "--drafter", str(tmp_path / "run")], capsys)
    assert_one_error(rc, lines, "is a training run", f"{tmp_path / 'run' / 'drafter'}", "drafter_last/")
    rc, lines = run_cli(["eval", "--drafter", str(tmp_path / "elsewhere")], capsys)
    assert_one_error(rc, lines, "config.json does not exist", "pass a drafter directory")


# ------------------------------------------------------------------------- 6: misleading fixes

def test_target_without_tokenizer(tiny_llama):
    from dflash_train.models.target import TargetError, load_tokenizer

    with pytest.raises(TargetError) as e:
        load_tokenizer(tiny_llama)   # a model directory with weights and config.json only
    msg = str(e.value)
    assert "has no tokenizer" in msg and "sentencepiece" not in msg and "tiktoken" not in msg.replace(
        "tokenizer.tiktoken", "")


def test_tokenizer_without_chat_template_names_no_missing_key():
    from tiny_chat import make_byte_tokenizer

    from dflash_train.data.conversations import ChatEncoder, DataError

    tok = make_byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError) as e:
        ChatEncoder(tok, 64)
    msg = str(e.value)
    assert "no chat template" in msg
    assert config_keys(msg) <= all_keys(), config_keys(msg) - all_keys()   # was: tokenizer.chat_template


def _write_gguf(path: Path) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((64, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_truncated_gguf_says_truncated(tmp_path):
    from dflash_train.models.target import TargetError, _damaged_weights, load_causal_lm, load_tokenizer

    data = _write_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    assert _damaged_weights(tmp_path / "whole.gguf") is None        # whole: its own load error stays what it is
    for load in (load_tokenizer, load_causal_lm):
        with pytest.raises(TargetError) as e:
            load(str(cut))
        assert "truncated" in str(e.value) and "cannot reshape" not in str(e.value)


def test_truncated_safetensors_says_truncated(tmp_path, tiny_llama):
    import shutil

    from dflash_train.models.target import TargetError, load_causal_lm

    target = tmp_path / "cut"
    shutil.copytree(tiny_llama, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TargetError) as e:
        load_causal_lm(str(target))
    assert "model.safetensors" in str(e.value) and "truncated" in str(e.value)


def test_max_samples_zero(capsys, no_training):
    rc, lines = run_cli(["train", "--config", "tiny_cpu", "data.max_samples=0"], capsys)
    assert "format" not in assert_one_error(rc, lines, "data.max_samples")


@pytest.mark.parametrize("overrides, words, not_words", [
    ({"heldout_fraction": 0.99}, ["held-out side", "data.heldout_fraction"], ["format"]),
    ({"max_length": 2}, ["data.max_length"], ["format"]),
])
def test_no_training_data_names_the_real_cause(tmp_path, overrides, words, not_words):
    from tiny_chat import make_byte_tokenizer, write_chats

    from dflash_train.config import DataConfig
    from dflash_train.data.conversations import DataError, load_chat_dataset

    p = write_chats(tmp_path / "chats.jsonl", 8)
    with pytest.raises(DataError) as e:   # was: "check its format" for a well-formed file
        load_chat_dataset(DataConfig(source=str(p), **overrides), make_byte_tokenizer())
    assert all(w in str(e.value) for w in words) and not any(w in str(e.value) for w in not_words), str(e.value)


# ------------------------------------------------------------------------- 7: data lost quietly

@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_data_file_with_bom_keeps_its_first_record(tmp_path, suffix):
    from tiny_chat import write_chats

    p = write_chats(tmp_path / "chats.jsonl", 3)
    if suffix == ".json":
        p = tmp_path / "chats.json"
        p.write_text(json.dumps([json.loads(line) for line in (tmp_path / "chats.jsonl").read_text().splitlines()]))
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    counts = Counter()
    assert [c.key for c in iter_conversations(p, counts)] == ["chat0", "chat1", "chat2"]
    assert not counts


def test_prompt_file_with_bom(tmp_path):
    from dflash_train.inference.prompts import read_prompt_file

    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "one"}\n"two"\n')
    assert [x.value for x in read_prompt_file(p)] == ["one", "two"]


def test_data_file_not_utf8_names_the_true_byte(tmp_path):
    from dflash_train.data.sources import DataError
    from tiny_chat import write_chats

    p = write_chats(tmp_path / "chats.jsonl", 200)   # > 8 KB before the bad byte
    head = p.read_bytes()
    p.write_bytes(head + b'{"conversations": "\xff"}\n')
    with pytest.raises(DataError) as e:
        list(iter_conversations(p, Counter()))
    assert f"at byte {len(head) + 19} (line 201)" in str(e.value)


def test_content_parts_read_the_same_by_train_and_eval(tmp_path):
    from dflash_train.inference.prompts import read_prompt_file

    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                       {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]}
    p = tmp_path / "parts.jsonl"
    p.write_text(json.dumps(parts) + "\n")
    (conv,) = iter_conversations(p, Counter())          # train and regenerate read through iter_conversations
    (prompt,) = read_prompt_file(p)                      # eval (was: refused, "string content")
    assert prompt.kind == "messages" and prompt.value == conv.messages[:2]
    assert conv.messages[1]["content"] == "Hi\nthere"


def test_responses_api_parts_and_developer_role():
    from dflash_train.data.sources import normalise_record

    record = {"messages": [{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                           {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}]}
    conv = normalise_record(record, 0, Counter())
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]


def test_tool_call_conversations_counted_as_skipped(tmp_path, caplog):
    from tiny_chat import make_byte_tokenizer, write_chats

    from dflash_train.config import DataConfig
    from dflash_train.data.conversations import load_chat_dataset

    p = write_chats(tmp_path / "chats.jsonl", 4)
    tools = [
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                             "function": {"name": "w"}}]},
                      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]},
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function", "value": "{}"},
                           {"from": "gpt", "value": "y"}]},
    ]
    with open(p, "a") as f:
        for r in tools:
            f.write(json.dumps(r) + "\n")
    counts = Counter()
    assert len(list(iter_conversations(p, counts))) == 4
    assert counts == Counter({"skip:tool_calls": 2})
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        split = load_chat_dataset(DataConfig(source=str(p), heldout_fraction=0.0), make_byte_tokenizer())
    assert split.stats["skipped"] == {"tool_calls": 2}
    assert "tool_calls=2" in caplog.text


# ------------------------------------------------------------------------- 8: silence off a terminal

def test_plain_progress_lines_off_a_tty(caplog):
    from dflash_train.data.progress import PlainProgress, progress_bar

    assert isinstance(progress_bar(range(3), desc="x"), PlainProgress)   # pytest's stderr is not a TTY
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        with PlainProgress(total=4, desc="regenerating", unit="conv", every_s=0.0) as bar:
            bar.update(1)
            bar.set_postfix_str("123 tok/s")
            bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("regenerating: 1/4 conv (25%), ") and "conv/s" in lines[0] and "ETA" in lines[0]
    assert lines[1].startswith("regenerating: 2/4 conv (50%)") and lines[1].endswith("123 tok/s")
    assert lines[-1].startswith("regenerating: 2/4 conv (50%)") and "done in" in lines[-1]
    assert list(PlainProgress(range(3), every_s=1e9)) == [0, 1, 2]   # iterates like tqdm


def test_tokenizing_logs_progress_off_a_tty(tmp_path, caplog, monkeypatch):
    from tiny_chat import make_byte_tokenizer, write_chats

    from dflash_train.config import DataConfig
    from dflash_train.data import progress
    from dflash_train.data.conversations import load_chat_dataset

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # every update logs a line
    p = write_chats(tmp_path / "chats.jsonl", 5)
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        load_chat_dataset(DataConfig(source=str(p), heldout_fraction=0.0), make_byte_tokenizer())
    assert any(r.getMessage().startswith("tokenizing chats: ") and "conv/s" in r.getMessage()
               for r in caplog.records)


def test_train_without_config_says_what_it_does(monkeypatch, capsys):
    import dflash_train.train

    seen = []

    def fake_train(cfg, single=False):
        seen.append(capsys.readouterr().out)  # what was printed before the run began (the CLI logs to stdout)
        raise UserError("stop here")

    monkeypatch.setattr(dflash_train.train, "train", fake_train)
    rc = cli.main(["train"])
    assert rc == 2 and seen
    assert "without --config" in seen[0] and "sharegpt" in seen[0] and "runs/dflash" in seen[0]


# ------------------------------------------------------------------------- the property: every key

# Free-form strings need a value that is wrong for what they name; every other string is a choice: "bogus".
BAD_STRINGS = {
    "model.target": "/nonexistent/dflash-target",
    "model.drafter_init": "/nonexistent/dflash-drafter",
    "data.source": "chats.txt",
    "data.eval_prompts": "/nonexistent/prompts.jsonl",
    "data.cache_dir": "A_FILE",
    "train.compile_cache_dir": "A_FILE",
    "run.out_dir": "A_FILE",
}
BAD_LISTS = {
    "model.target_layer_ids": ["[-1]", "[1, 1]", "[a]"],
    "data.mix": ["[sharegpt:-1]", "[/nonexistent/x.jsonl:1]", "[synthetic]"],
    "train.betas": ["[0.9, 1.5]", "[0.9]", "[a, b]"],
    "pipeline.target_devices": ["[bogus]", "[]"],
    "pipeline.drafter_devices": ["[bogus]", "[]"],
}


def bad_values(key: str, tp) -> list[str]:
    """Override values that must all be refused for `key` of annotated type `tp`."""
    unparseable = "[1,"
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = args[0]
    if typing.get_origin(base) is list:
        assert key in BAD_LISTS, f"add out-of-range values for the new list key {key} to BAD_LISTS"
        return [unparseable, *BAD_LISTS[key]]
    if base is bool:
        return [unparseable, "maybe", "3"]
    if base is int:
        return [unparseable, "abc", "1.5", str(-10 ** 9)]
    if base is float:
        return [unparseable, "abc", ".nan", ".inf", "-1e9"]
    if base is str:
        return [unparseable, BAD_STRINGS.get(key, "bogus")]
    raise AssertionError(f"{key}: no bad values for type {tp}")


def test_every_key_refuses_bad_values_in_one_line(tmp_path, monkeypatch, capsys, no_training):
    monkeypatch.chdir(tmp_path)
    Path("A_FILE").write_text("not a directory")
    hints = typing.get_type_hints(Config)
    tried = 0
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        field_types = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section.name}.{f.name}"
            for value in bad_values(key, field_types[f.name]):
                rc = cli.main(["train", "--config", "tiny_cpu", f"{key}={value}"])
                err = capsys.readouterr().err
                lines = [line for line in err.splitlines() if line.strip()]
                assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (key, value, rc, err)
                assert "Traceback" not in err, (key, value, err)
                tried += 1
    assert tried >= 4 * len(all_keys()) // 2


def test_unknown_keys_and_sections(capsys, no_training):
    for override in ("train.nope=1", "nope.lr=1", "trainlr=1", "train.lr.x=1"):
        rc, lines = run_cli(["train", "--config", "tiny_cpu", override], capsys)
        assert_one_error(rc, lines)


def test_config_errors_are_user_errors():
    with pytest.raises(ConfigError):
        load_config("tiny_cpu", ["train.log_every=0"])
    assert issubclass(ConfigError, UserError)


# ------------------------------------------------------------------------- 7: config text read as written

@pytest.mark.parametrize("section_text", ["train: 5\n", "train: lr=3e-4\n", "train:\n  - lr: 1.0e-3\n"])
def test_a_config_section_that_is_not_a_mapping_is_one_line_with_an_override_too(section_text, tmp_path, capsys,
                                                                                   no_training):
    # Without an override the section was refused by name; with one into the same section it was a TypeError
    # traceback ('int' object does not support item assignment).
    p = tmp_path / "run.yaml"
    p.write_text(section_text)
    rc, lines = run_cli(["train", "--config", str(p), "train.max_steps=3"], capsys)
    assert_one_error(rc, lines, "'train'", "mapping")


@pytest.mark.parametrize("key", ["train.max_minutes", "data.regenerate_minutes", "train.max_steps"])
def test_a_time_written_as_minutes_colon_seconds_is_not_read_as_base_60(key, tmp_path, capsys, no_training):
    # YAML 1.1 reads 1:30 as the base-60 integer 90: train.max_minutes=1:30 (one and a half minutes, as the demo's
    # table writes times) silently trained for 90 minutes. It is refused, in an override and in a file alike.
    rc, lines = run_cli(["train", "--config", "tiny_cpu", f"{key}=1:30"], capsys)
    assert_one_error(rc, lines, key, "1:30")
    section, name = key.split(".")
    p = tmp_path / "run.yaml"
    p.write_text(f"{section}:\n  {name}: 1:30\n")
    rc, lines = run_cli(["train", "--config", str(p)], capsys)
    assert_one_error(rc, lines, key, "1:30")
    # A string key keeps what was written (was '90'); plain numbers and device names read as before.
    assert load_config("tiny_cpu", ["run.out_dir=runs/12:30"]).run.out_dir == "runs/12:30"
    assert load_config("tiny_cpu", ["run.out_dir=12:30"]).run.out_dir == "12:30"
    cfg = load_config("tiny_cpu", ["train.max_minutes=1.5", "train.max_steps=90", "pipeline.target_devices=[cpu:0]"])
    assert (cfg.train.max_minutes, cfg.train.max_steps, cfg.pipeline.target_devices) == (1.5, 90, ["cpu:0"])


def test_doctor_refuses_an_unknown_compile_mode_as_a_usage_error(capsys):
    # Was: a FAIL of the compiled step whose fix said to train eager and report the traceback as a bug.
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--compile", "bogus", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'bogus'" in err and "reduce-overhead" in err
    assert "Traceback" not in err


def test_demo_prompts_naming_a_bundled_set_is_refused_before_training(tmp_path, capsys, monkeypatch):
    # `eval --prompts yardstick` names the bundled set; `demo --prompts yardstick` measured it a second time over the
    # first (every prompt, plain decoding on each: past the GPU demo's evaluation allowance). Refused at once.
    import dflash_train.pipeline.coordinator as coordinator

    def reached(*_a, **_k):
        raise AssertionError("the demo started training")

    monkeypatch.setattr(coordinator, "train_pipeline", reached)
    monkeypatch.chdir(tmp_path)
    rc, lines = run_cli(["demo", "--device", "cpu", "--prompts", "yardstick", "--out", str(tmp_path / "demo")],
                        capsys)
    assert_one_error(rc, lines, "--prompts", "yardstick")


@pytest.mark.parametrize("override, key", [("pipeline.drafter_devices=cpu,cpu", "pipeline.drafter_devices"),
                                           ("data.mix=sharegpt:3,chats.jsonl:1", "data.mix"),
                                           ("train.betas=0.9,0.95", "train.betas")])
def test_a_list_written_with_commas_but_no_brackets_names_the_brackets(override, key, tmp_path, monkeypatch, capsys,
                                                                       no_training):
    # `regenerate --device cuda:0,cuda:1` takes commas; a list key read `cpu,cpu` as one device named 'cpu,cpu', and
    # data.mix as one file 'sharegpt:3,chats.jsonl' with a fix about data.source.
    monkeypatch.chdir(tmp_path)
    Path("chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    rc, lines = run_cli(["train", "pipeline.target_devices=[cpu]", override], capsys)
    value = override.split("=", 1)[1]
    assert_one_error(rc, lines, key, f"{key}=[{value}]")


@pytest.mark.parametrize("text, key", [
    ("train:\n  max_steps: 7\nrun:\n  plots: false\ntrain:\n  lr: 1.0e-3\n", "train"),
    ("train:\n  max_steps: 7\n  max_steps: 9\n", "max_steps"),
])
def test_a_key_written_twice_in_a_config_file_is_refused_not_dropped(text, key, tmp_path, capsys, no_training):
    # YAML keeps the last of two equal keys: a second `train:` block silently dropped the whole first one
    # (train.max_steps=7 here). Merge keys (<<) still override as YAML means them to.
    p = tmp_path / "run.yaml"
    p.write_text(text)
    rc, lines = run_cli(["train", "--config", str(p)], capsys)
    assert_one_error(rc, lines, repr(key), "twice")
    merged = tmp_path / "merged.yaml"
    merged.write_text("train:\n  <<: {max_steps: 7, lr: 1.0e-3}\n  max_steps: 9\n")
    cfg = load_config(merged)
    assert (cfg.train.max_steps, cfg.train.lr) == (9, 1e-3)
