"""Evaluation prompts: a JSONL file, or held-out ShareGPT conversations by default -> token ids.

One record per line (or one JSON list of them, as a .json file holds), any of:
  {"messages": [{"role": ..., "content": ...}, ...]}   OpenAI-style chat
  {"conversations": [{"from": ..., "value": ...}, ...]}  ShareGPT-style chat
  {"turns": ["question", ...]}                           MT-Bench-style questions: the first turn, as a chat
  {"instruction": "...", "input": "..."}                  Alpaca-style ("context" for Dolly's): one user turn
  {"question": "text"}                                    one user turn
  {"prompt": "text"}  or  "text"                          one user turn (raw text where the tokenizer has no chat
                                                          template), as the DFlash authors' benchmark renders its
                                                          prompts
  {"text": "text"}                                        raw text, tokenized as is (with the tokenizer's BOS): a
                                                          continuation, not a chat
  {"input_ids": [1, 2, 3]}                                already tokenized (needs no tokenizer)
A record may also carry "id" (or "question_id"; a string or an integer) and "category" (a string); the eval report
averages tau per category when prompts have one. `yardstick` (the bundled set, YARDSTICK_PATH) names 80 first-turn
prompts written for this project, ten each in writing, roleplay, reasoning, math, coding, extraction, STEM and
humanities: a source other than the training data.
A chat prompt is every turn before the first assistant answer, rendered with the target's chat template and
add_generation_prompt=True, so the model answers the first user turn (later turns are dropped).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

log = logging.getLogger("dflash_train")

FORMAT_HINT = ('write one JSON record per line: {"messages": [...]}, {"conversations": [...]}, {"turns": ["..."]}, '
               '{"instruction": "..."}, {"question": "..."}, {"prompt": "..."}, "plain text", {"text": "..."} (raw) '
               'or {"input_ids": [...]}')

# Used only when the held-out ShareGPT split cannot be loaded (package missing, data module unavailable).
FALLBACK_PROMPTS = [
    "Explain how a hash table works and when you would not use one.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "What are the main causes of inflation? Answer in three bullet points.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give me a step-by-step recipe for a simple tomato pasta sauce.",
    "What is the difference between TCP and UDP?",
    "Translate to French: 'The weather is lovely today, let us go for a walk.'",
    "List five tips for writing clear technical documentation.",
]


BUNDLED_PROMPTS = {"yardstick": Path(__file__).resolve().parent.parent / "prompts" / "yardstick.jsonl"}
YARDSTICK_PATH = BUNDLED_PROMPTS["yardstick"]


class PromptError(UserError):
    """The prompts the user gave cannot be used; the message names the file, the line and the fix."""


@dataclass
class Prompt:
    kind: str        # "messages" | "request" (a user turn's text) | "text" (raw) | "ids"
    value: object    # list[dict] | str | list[int]
    category: str | None = None   # e.g. "math": the report's per-category tau
    id: str | None = None


def yardstick_prompts() -> list[Prompt]:
    """The bundled yardstick set (module docstring), in file order: every prompt has an id and a category."""
    return read_prompt_file("yardstick")


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """A JSONL prompt file, or the name of a bundled set (BUNDLED_PROMPTS, e.g. "yardstick") -> prompts."""
    p = BUNDLED_PROMPTS.get(str(path), Path(path).expanduser())
    if not p.is_file():
        bundled = ", ".join(sorted(BUNDLED_PROMPTS))
        raise PromptError(f"Prompt file {str(p)!r} does not exist; {FORMAT_HINT}, or name a bundled set ({bundled}).")
    from ..data.sources import open_text

    prompts = []
    with open_text(p, "Prompt file", PromptError) as f:  # UTF-8, a byte-order mark allowed
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not prompts and line.lstrip().startswith("["):  # a JSON list of records (.json), not JSON lines
                prompts = json_list_prompts(line + f.read(), p)
                break
            where = f"{p}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{where} is not valid JSON ({e.msg}); {FORMAT_HINT}.") from None
            prompts.append(parse_record(record, where))
    if not prompts:
        raise PromptError(f"Prompt file {str(p)!r} has no prompts; {FORMAT_HINT}.")
    return prompts


def json_list_prompts(text: str, path: Path) -> list[Prompt]:
    """A whole file holding one JSON list of prompt records -> prompts (errors name the record's index)."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}); {FORMAT_HINT}, or one JSON list "
                          "of such records.") from None
    if not isinstance(records, list):
        raise PromptError(f"{path} holds JSON that is not a list of records; {FORMAT_HINT}.")
    return [parse_record(record, f"{path} record {i}") for i, record in enumerate(records)]


def parse_record(record, where: str) -> Prompt:
    if isinstance(record, str):
        return Prompt("request", record)
    if isinstance(record, dict):
        category = record.get("category")
        if category is not None and not isinstance(category, str):
            raise PromptError(f"{where}: \"category\" must be a string, not {type(category).__name__}.")
        key = "id" if "id" in record else "question_id"
        id_ = record.get(key)
        if id_ is not None and (isinstance(id_, bool) or not isinstance(id_, (str, int))):
            raise PromptError(f"{where}: \"{key}\" must be a string or an integer, not {type(id_).__name__}.")
        tags = {"category": category, "id": None if id_ is None else str(id_)}
        turns = record.get("messages", record.get("conversations"))
        if isinstance(turns, list):
            return Prompt("messages", chat_prompt(turns, where), **tags)
        if question := user_question(record, where):
            return Prompt("messages", [{"role": "user", "content": question}], **tags)
        if isinstance(record.get("prompt"), str):
            return Prompt("request", record["prompt"], **tags)
        if isinstance(record.get("text"), str):
            return Prompt("text", record["text"], **tags)
        ids = record.get("input_ids")
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return Prompt("ids", ids, **tags)
    raise PromptError(f"{where} is not a prompt record; {FORMAT_HINT}.")


def user_question(record: dict, where: str) -> str | None:
    """The one user turn of a question record (module docstring: "turns", "instruction", "question"), else None."""
    turns = record.get("turns")
    if isinstance(turns, list):  # MT-Bench: the later turns need the model's answers to the earlier ones
        if not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise PromptError(f"{where}: \"turns\" must start with the question's text (a non-empty string).")
        return turns[0]
    if isinstance(record.get("instruction"), str) and record["instruction"].strip():
        extra = record.get("input") or record.get("context")
        return record["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    if isinstance(record.get("question"), str) and record["question"].strip():
        return record["question"]
    return None


def chat_prompt(turns: list, where: str) -> list[dict]:
    """Chat turns (either naming style, content a string or OpenAI text parts: data/sources.read_turn, the reader
    training uses) -> the messages before the first assistant answer; empty turns dropped as training drops them."""
    from ..data.sources import read_turn

    messages: list[dict] = []
    for i, turn in enumerate(turns):
        message = read_turn(turn)
        if isinstance(message, str):
            raise PromptError(f"{where}: turn {i} cannot be read ({message}); a turn needs a role (system/user/"
                              "assistant) and text content (a string or a list of {\"type\": \"text\"} parts).")
        if not message["content"]:
            continue
        if message["role"] == "assistant" and any(m["role"] == "user" for m in messages):
            break
        messages.append(message)
    if not any(m["role"] == "user" for m in messages):
        raise PromptError(f"{where} has no user turn before the first assistant answer; nothing to answer.")
    return messages


def heldout_prompts(data, tokenizer, n: int, seed: int = 0) -> list[Prompt]:
    """Up to n prompts from the held-out conversations of `data` (a DataConfig: data.source, or every source of a
    data.mix; the same split training holds out with the same seed, data/conversations.is_heldout): each
    conversation up to its first assistant turn, in file order. Reads the conversations only (no tokenizing):
    the tokenizer is the caller's, for tokenize_prompts. Raises what reading the source raises."""
    from collections import Counter

    from ..data.conversations import is_heldout
    from ..data.sources import iter_conversations, open_source

    sources = [s for s, _ in data.mix_weights()] if data.mix else [data.source]
    prompts: list[Prompt] = []
    for source in sources:
        with open_source(source) as path:
            for conv in iter_conversations(path, Counter()):
                if len(prompts) >= n:
                    return prompts
                if not is_heldout(conv.key, seed, data.heldout_fraction):
                    continue
                try:
                    prompts.append(Prompt("messages", chat_prompt(conv.messages, f"held-out conversation {conv.key}"),
                                          id=conv.key))
                except PromptError:  # no user turn before the first answer: nothing to prompt with
                    continue
    return prompts


def default_prompts(tokenizer, n: int, seed: int = 0) -> list[Prompt]:
    """The held-out split of the bundled ShareGPT data (the same split training holds out with the same seed);
    a few built-in chat prompts if that split cannot be loaded."""
    try:
        from ..config import DataConfig

        prompts = heldout_prompts(DataConfig(source="sharegpt"), tokenizer, n, seed)
        if prompts:
            return prompts
        reason = "the held-out split is empty"
    except (ImportError, UserError, ValueError) as e:  # DataError is a ValueError
        reason = f"{type(e).__name__}: {e}"
    log.warning("held-out ShareGPT prompts unavailable (%s); using %d built-in prompts", reason,
                min(n, len(FALLBACK_PROMPTS)))
    return [Prompt("messages", [{"role": "user", "content": t}]) for t in FALLBACK_PROMPTS[:n]]


def needs_tokenizer(prompts: list[Prompt] | None) -> bool:
    return prompts is None or any(p.kind != "ids" for p in prompts)


def tokenize_prompts(prompts: list[Prompt], tokenizer) -> list[list[int]]:
    out = []
    templated = bool(getattr(tokenizer, "chat_template", None))
    for p in prompts:
        if p.kind == "ids":
            out.append(list(p.value))
        elif p.kind == "text" or (p.kind == "request" and not templated):
            out.append(list(tokenizer(p.value)["input_ids"]))
        else:
            if not templated:
                raise PromptError("The target's tokenizer has no chat template, so chat prompts cannot be rendered; "
                                  'use {"prompt": "..."} or {"text": "..."} records instead.')
            messages = [{"role": "user", "content": p.value}] if p.kind == "request" else p.value
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def check_prompt_lengths(prompt_ids: list[list[int]], max_new_tokens: int, context: int, vocab_size: int) -> None:
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise PromptError(f"Prompt {i} is empty after tokenization; remove it from the prompt file.")
        if len(ids) + max_new_tokens > context:
            raise PromptError(f"Prompt {i} has {len(ids)} tokens, and with --max-new-tokens {max_new_tokens} it "
                              f"exceeds the target's context of {context} tokens; shorten it or lower "
                              "--max-new-tokens.")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"Prompt {i} has token id {bad[0]} outside the target vocabulary 0..{vocab_size - 1}.")
