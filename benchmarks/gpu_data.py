"""Write the GPU recipe's data files from the bundled ShareGPT (runs here, on the CPU; the GPU machine has no PyPI).

  PYTHONPATH=src python3 benchmarks/gpu_data.py [--eval M] [--out .gpu/data]

-> train_chats.jsonl: every usable ShareGPT record except the held-out ones, as OpenAI-style messages, with each
   assistant turn's text replaced by "." (`dflash-train regenerate` replaces every reply with the target's own; the
   original only marks where a reply is due, and dropping it makes the file small enough to carry);
   eval_prompts.jsonl: the first user turn of the last M conversations (by ShareGPT key, so no part of a held-out
   chat is trained on).
Each file is written gzipped alone (the GPU machine takes at most 64 MiB per call, the tree, the GGUF half and
the whole carried .gpu/data folder together).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

from dflash_train.data.sources import iter_conversations, open_source

PLACEHOLDER = "."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval", type=int, default=32, help="held-out conversations (their first user turn)")
    p.add_argument("--out", default=".gpu/data")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    with open_source("sharegpt") as path:
        convs = list(iter_conversations(path, counts))
    keys = list(dict.fromkeys(c.key for c in convs))
    held_keys = set(keys[len(keys) - args.eval:])  # (keys[-0:] would be all of them)
    train, held = [], {}
    for c in convs:
        if c.key in held_keys:
            user = next((m for m in c.messages if m["role"] == "user"), None)
            if user is not None and c.key not in held:
                held[c.key] = {"id": c.key, "messages": [user]}
            continue
        msgs = [dict(m, content=PLACEHOLDER) if m["role"] == "assistant" else m for m in c.messages]
        train.append({"id": c.key, "messages": msgs})
    replies = sum(m["role"] == "assistant" for r in train for m in r["messages"])
    for name, rows in (("train_chats.jsonl", train), ("eval_prompts.jsonl", list(held.values()))):
        target = out / name
        target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        with open(target, "rb") as src, gzip.open(f"{target}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        size = target.stat().st_size
        target.unlink()  # only the .gz: `carry .gpu/data` takes the whole folder, and 27 MB more breaks stage's 64 MiB
        print(f"{target}.gz: {len(rows)} records, {size / 2**20:.1f} MiB "
              f"({Path(f'{target}.gz').stat().st_size / 2**20:.1f} MiB gzipped)")
    print(f"{replies} replies due in train_chats.jsonl; reader counts: {dict(counts)}")


if __name__ == "__main__":
    main()
