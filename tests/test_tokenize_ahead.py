"""data.tokenize_ahead: a chat file tokenized as it is written gives the cache entry that loading the finished file
would, and a child that fails or stalls costs a warning, never the run or its data."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import dflash_train.data.tokenize_ahead as ahead_mod
from dflash_train.beside import NICENESS
from dflash_train.config import DataConfig
from dflash_train.data.conversations import load_chat_dataset, tokenize_into_cache
from dflash_train.data.sources import DataError, growing_lines, iter_conversations
from dflash_train.data.tokenize_ahead import TokenizeAhead, TokenizeAheads, wants_tokenize_ahead
from dflash_train.models.target import load_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def chat_lines(n: int) -> list[str]:
    """Records as regeneration writes them, with the odd ones a reader must count the same way as grown: a bad
    line, a blank one, a record with no answer, non-ASCII text (a UTF-8 sequence may be cut between two writes)."""
    lines = []
    for i in range(n):
        answer = f"Answer number {i}: caf\u00e9 \u2014 \U0001f600." if i % 5 else f"Answer {i}."
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                                            {"role": "assistant", "content": answer}]},
                                ensure_ascii=False))
    lines[7] = '{"id": "cut", "messages": [{"role": "us'
    lines[11] = ""
    lines[13] = json.dumps({"id": "q", "messages": [{"role": "user", "content": "No answer"}]})
    return lines


def write_slowly(path: Path, data: bytes, done: threading.Event, pieces: int = 23) -> threading.Thread:
    """Append `data` to path in `pieces` uneven writes (cutting lines and UTF-8 sequences), then set `done`."""
    def run():
        with open(path, "ab") as f:
            step = max(1, len(data) // pieces)
            for start in range(0, len(data), step):
                f.write(data[start:start + step])
                f.flush()
                time.sleep(0.01)
        done.set()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_growing_lines_are_the_finished_files_lines(tmp_path):
    path = tmp_path / "grow.jsonl"
    data = ("\ufeff" + "\n".join(chat_lines(60)) + "\r\nlast line without a newline").encode("utf-8")
    done = threading.Event()
    writer = write_slowly(path, data, done)  # the file does not exist before the first write
    grown = list(growing_lines(path, done.is_set, poll_s=0.002))
    writer.join()
    with open(path, encoding="utf-8-sig") as f:
        assert grown == list(f)
    assert grown[-1] == "last line without a newline"


def test_a_file_cut_while_read_is_an_error_not_wrong_data(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(chat_lines(20)) + "\n")
    calls = []

    def until():  # the file is cut (as read_done_ids would) after the reader has passed that point
        calls.append(1)
        if len(calls) == 2:
            path.write_text("\n".join(chat_lines(20)[:5]) + "\n")
        return len(calls) >= 2

    with pytest.raises(DataError, match="replaced or cut while it was read"):
        list(iter_conversations(path, Counter(), until))


def test_tokenized_as_written_is_the_cache_entry_of_the_finished_file(tmp_path, tok):
    """tokenize_into_cache over a file written in pieces saves exactly what load_chat_dataset would build from the
    finished file (samples, held-out side, counts), under the key that load then finds."""
    path = tmp_path / "answers.jsonl"
    cfg = DataConfig(source=str(path), heldout_fraction=0.2, heldout_max=6, max_length=64)
    done = threading.Event()
    writer = write_slowly(path, ("\n".join(chat_lines(80)) + "\n").encode(), done)
    saved = tokenize_into_cache(cfg, tok, 3, str(tmp_path / "cache"), done.is_set)
    writer.join()
    hit = load_chat_dataset(cfg, tok, seed=3, cache_dir=str(tmp_path / "cache"))
    fresh = load_chat_dataset(cfg, tok, seed=3, cache_dir=None)
    assert hit.stats["cache"] == "hit" and hit.stats["cache_path"] == str(saved)
    assert fresh.stats["skipped"] == {"bad_json_line": 1, "no_assistant_turn": 1}  # the odd lines, as grown
    assert (hit.train, hit.heldout, hit.heldout_messages, hit.heldout_keys) == \
        (fresh.train, fresh.heldout, fresh.heldout_messages, fresh.heldout_keys)
    assert {k: v for k, v in hit.stats.items() if k not in ("cache", "cache_path")} == \
        {k: v for k, v in fresh.stats.items() if k != "cache"}


def test_the_child_process_fills_the_cache_while_the_file_is_written(tmp_path, tok):
    """TokenizeAhead: the child (a fresh interpreter) follows the file; after finish() the run's load is a hit."""
    path = tmp_path / "answers.jsonl"
    path.touch()
    cfg = DataConfig(source=str(path), heldout_fraction=0.2, heldout_max=6, max_length=64)
    child = TokenizeAhead(cfg, tok, 0, str(tmp_path / "cache"), tmp_path / "scratch", threads=1)
    with open(path, "a", encoding="utf-8") as f:
        for line in chat_lines(50):
            f.write(line + "\n")
            f.flush()
    assert child.finish()
    hit = load_chat_dataset(cfg, tok, seed=0, cache_dir=str(tmp_path / "cache"))
    fresh = load_chat_dataset(cfg, tok, seed=0, cache_dir=None)
    assert hit.stats["cache"] == "hit"
    assert (hit.train, hit.heldout) == (fresh.train, fresh.heldout)
    assert not (tmp_path / "scratch").exists()


def test_a_failing_child_is_a_warning_and_the_load_tokenizes(tmp_path, tok, caplog):
    path = tmp_path / "data.json"  # not .jsonl: the child cannot follow it and exits with an error
    path.write_text("[]")
    cfg = DataConfig(source=str(path))
    child = TokenizeAhead(cfg, tok, 0, str(tmp_path / "cache"), tmp_path / "scratch", threads=1)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        assert not child.finish()
    assert "the child exited with 1" in caplog.text and "only a .jsonl file can be read as it grows" in caplog.text
    assert not (tmp_path / "cache").exists()


def test_a_stalled_child_is_stopped(tmp_path, tok, caplog, monkeypatch):
    """A child that shows no progress for idle_s after the file is complete is killed: finish() never hangs."""
    monkeypatch.setattr(ahead_mod.TokenizeAhead, "complete", lambda self: None)  # the child never hears of it
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(chat_lines(20)) + "\n")
    child = TokenizeAhead(DataConfig(source=str(path)), tok, 0, str(tmp_path / "cache"), tmp_path / "scratch",
                          threads=1)
    if hasattr(os, "setpriority"):  # below the run's priority: the regeneration it works beside comes first
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0)
                                                                      + NICENESS)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        assert not child.finish(idle_s=1.0)
    assert "no progress for 1 s" in caplog.text and child.proc.poll() is not None


def test_tokenize_aheads_start_only_when_enabled_and_survive_a_bad_start(tmp_path, tok, caplog):
    path = tmp_path / "answers.jsonl"
    path.touch()
    off = TokenizeAheads(False, lambda p: DataConfig(source=str(p)), tok, 0, str(tmp_path / "c"), tmp_path / "s")
    off.start(path)
    assert off.children == {}

    unpicklable = threading.Lock()  # as the tokenizer: a job that cannot be written for the child
    with caplog.at_level(logging.WARNING, logger="dflash_train"), \
            TokenizeAheads(True, lambda p: DataConfig(source=str(p)), unpicklable, 0, str(tmp_path / "c"),
                           tmp_path / "s") as bad:
        bad.start(path)
        bad.finish()
    assert "could not start" in caplog.text and bad.children == {}


def test_auto_needs_a_gpu_and_cores(monkeypatch):
    monkeypatch.setattr(ahead_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert wants_tokenize_ahead(DataConfig(), on_gpu=True)
    assert not wants_tokenize_ahead(DataConfig(), on_gpu=False)       # on a CPU it takes the regeneration's cores
    assert wants_tokenize_ahead(DataConfig(tokenize_ahead=True), on_gpu=False)
    monkeypatch.setattr(ahead_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert not wants_tokenize_ahead(DataConfig(), on_gpu=True)        # 2 cores: none to spare
    assert not wants_tokenize_ahead(DataConfig(tokenize_ahead=False), on_gpu=True)
