#!/usr/bin/env python3
"""Do the regenerated replies, as training tokenizes them, hold the target's own greedy tokens? (CPU, fp32)

The drafter should learn exactly what the target emits. Between the two stand the regeneration engine
(generation/engine.py, continuous batching), the reply's round trip through text (the record stores text) and the
training tokenization (data/conversations.ChatEncoder: the chat template rendered and tokenized whole). This probe
regenerates N first user turns with `dflash-train regenerate` on the CPU in fp32 (no bf16 ties), decodes the same
prompts with the target alone (transformers' greedy generate), and compares the greedy ids with the assistant tokens
training would read, classifying every place they part:

  truncated   the reply hit max_new_tokens and training adds the end-of-turn token after it (a label the target
              did not emit there)
  whitespace  the reply ended in whitespace that the template's rendering dropped
  token       the same text, tokenized differently (until session 28, "\\n\\n" before a digit: SmolLM2's GGUF
              tokenizer had lost its digit pre-tokenizer, models/gguf_header.GGUF_PRE_TOKENIZERS)
  text        a different text: the engine did not reproduce plain greedy decoding (a bug, in fp32)

  PYTHONPATH=src python3 benchmarks/regen_drift_cpu.py CHATS.jsonl[.gz] [N=24] [NEW_TOKENS=96]

CHATS: chat records (e.g. .gpu/data/train_chats.jsonl.gz, written by benchmarks/gpu_data.py); the first N whose
first user turn is 20-400 characters are used. The embedded SmolLM2 is the target. A probe: its figures go to
docs/BENCHMARKS.md with this command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from records import open_record


def first_turns(path: str, n: int) -> list[dict]:
    out = []
    with open_record(path) as f:
        for line in f:
            rec = json.loads(line)
            user = rec.get("messages", [{}])[0]
            if user.get("role") == "user" and 20 < len(user.get("content", "")) < 400:
                out.append({"id": rec["id"], "messages": [user, {"role": "assistant", "content": "."}]})
            if len(out) == n:
                break
    return out


def classify(greedy: list[int], trained: list[int], new_tokens: int, tok) -> tuple[str, int] | None:
    """Where the target's greedy ids and training's assistant ids first part, and why (module docstring); None when
    training holds the greedy ids and then the end-of-turn token the target emitted itself."""
    k = next((i for i, (a, b) in enumerate(zip(greedy, trained)) if a != b), None)
    if k is None:
        return ("truncated", len(greedy)) if len(greedy) == new_tokens and len(trained) > len(greedy) else None
    rest = tok.decode(greedy[k:])
    if not rest.strip():
        return "whitespace", k
    if tok.decode(trained, skip_special_tokens=True).startswith(tok.decode(greedy).rstrip()):
        return "token", k
    return "text", k


def main(chats: str, n: int = 24, new_tokens: int = 96) -> None:
    from dflash_train.data.conversations import ChatEncoder
    from dflash_train.models.target import load_causal_lm, load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="regen_drift_"))
    src, regen = work / "chats.jsonl", work / "regen.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in first_turns(chats, n)))
    subprocess.run([sys.executable, "-m", "dflash_train.cli", "regenerate", "--data", str(src), "--out", str(regen),
                    "--max-new-tokens", str(new_tokens), "--device", "cpu", "--single-turn"], check=True,
                   stdout=subprocess.DEVNULL)
    tok = load_tokenizer(None)
    hf = load_causal_lm(None, "cpu", torch.float32)
    encoder = ChatEncoder(tok, 4096)
    kinds, tokens = Counter(), 0
    for rec in (json.loads(line) for line in regen.read_text().splitlines()):
        prompt = tok(tok.apply_chat_template(rec["messages"][:1], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        sample = encoder.encode([rec["messages"]])[0]
        trained = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
        tokens += len(greedy)
        part = classify(greedy, trained, new_tokens, tok)
        kinds[part[0] if part else "same"] += 1
        if part:
            k = part[1]
            print(f"{rec['id']}: {part[0]} at token {k}: target {tok.decode(greedy[max(0, k - 3):k + 2])!r} "
                  f"{greedy[k:k + 2]}, training {tok.decode(trained[max(0, k - 3):k + 2])!r} {trained[k:k + 2]}")
    print(f"{sum(kinds.values())} replies, {tokens} greedy tokens: " + ", ".join(f"{v} {k}" for k, v in kinds.items()))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:4]))
