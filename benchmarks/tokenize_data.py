#!/usr/bin/env python3
"""Write the tokenizing benchmarks' inputs (benchmarks/tokenize_cpu.py, tokenize_ahead_cpu.py): small enough to
carry to a GPU host, whose CPUs are the ones that matter.

  PYTHONPATH=src python3 benchmarks/tokenize_data.py HF_DIR [--out .gpu/tok]

HF_DIR: a Hugging Face directory of the target (e.g. the SmolLM2 the demo converts into runs/.cache/
SmolLM2-135M-Instruct-hf2); its tokenizer and chat template files are copied to OUT, without the weights. OUT/
chats.jsonl.gz: every conversation of the bundled ShareGPT that opens with a question and its answer, cut after that
answer (17,350 of them), as OpenAI-style records.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

from dflash_train.data.sources import iter_conversations, open_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "special_tokens_map.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir")
    p.add_argument("--out", default=".gpu/tok")
    args = p.parse_args()
    if not (Path(args.hf_dir) / "tokenizer.json").is_file():
        raise SystemExit(f"{args.hf_dir} has no tokenizer.json; pass the target's Hugging Face directory.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(args.hf_dir) / name).is_file():
            shutil.copy(Path(args.hf_dir) / name, out / name)
    n = 0
    with open_source("sharegpt") as path, gzip.open(out / "chats.jsonl.gz", "wt", encoding="utf-8") as f:
        for conv in iter_conversations(path, Counter()):
            m = conv.messages
            if len(m) >= 2 and m[0]["role"] == "user" and m[1]["role"] == "assistant":
                f.write(json.dumps({"messages": m[:2]}) + "\n")
                n += 1
    print(f"{out}: tokenizer files and {n:,} conversations")


if __name__ == "__main__":
    main()
