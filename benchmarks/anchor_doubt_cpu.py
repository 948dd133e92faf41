#!/usr/bin/env python3
"""Where decoding's walk starts its blocks, against the target's confidence in its own tokens (CPU, fp32).

Reads a demo run's `validation_replies.json` (each held-out reply's tokens and the walk's accepted lengths at the
best step), takes the ShareGPT ones whose prompts are in the staged chats file, runs the target on prompt + reply,
and compares p (the target's probability of each reply token given the ones before it) at the walk's anchors with
p elsewhere. The basis of train.anchor_sampling=decoding (docs/DESIGN.md, "Anchors").

  PYTHONPATH=src python3 benchmarks/anchor_doubt_cpu.py docs/gpu-runs/2026-12-04-demo-m/validation_replies.json.gz \\
      .gpu/data/train_chats.jsonl.gz TARGET_DIR      # a converted SmolLM2 directory (runs/.cache/...-hf2)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from records import open_record


def main(replies_path: str, chats_path: str, target: str) -> None:
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with open_record(replies_path) as f:
        replies = json.load(f)["replies"]
    with open_record(chats_path) as f:
        prompts = {c["id"]: next(m["content"] for m in c["messages"] if m["role"] == "user")
                   for c in map(json.loads, f)}
    at, elsewhere, seen, pairs = [], [], set(), []
    for r in replies:
        if r["source"] != "regenerated" or r["key"] in seen or r["key"] not in prompts:
            continue
        seen.add(r["key"])
        prompt = tok.apply_chat_template([{"role": "user", "content": prompts[r["key"]]}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        ids = prompt + r["tokens"]
        if len(ids) > 2048:
            continue
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].softmax(-1)
        anchors, a = set(), 0
        for s in r["steps"]:  # the walk: a block at the reply's first token, the next where it stopped
            a += s
            anchors.add(a)
        for i in range(1, len(r["tokens"])):
            p = probs[len(prompt) + i - 1, r["tokens"][i]].item()
            (at if i in anchors else elsewhere).append(p)
            pairs.append((p, i in anchors))
    n = len(at) + len(elsewhere)
    print(f"{len(seen)} replies, {n} tokens after each reply's first, {len(at)} of them where the walk started a block")
    print(f"the target's p of its token: median {statistics.median(at):.2f} at those anchors, "
          f"{statistics.median(elsewhere):.2f} elsewhere")
    for th in (0.3, 0.5, 0.7, 0.9):
        low = sum(p < th for p in at + elsewhere)
        low_at = sum(p < th for p in at)
        print(f"  p < {th}: {low / n:.0%} of the tokens hold {low_at / len(at):.0%} of the anchors (a block starts at "
              f"{low_at / max(low, 1):.2f} of them, at {(len(at) - low_at) / max(n - low, 1):.2f} of the others)")
    print("where a block starts, by p, against train.anchor_sampling=decoding's weight 0.1 + (1 - p):")
    edges = [0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.97, 1.0001]
    for lo, hi in zip(edges, edges[1:]):
        starts = [a for p, a in pairs if lo <= p < hi]
        if starts:
            print(f"  p in [{lo:.2f}, {min(hi, 1):.2f}): {len(starts):5d} tokens, a block starts at "
                  f"{sum(starts) / len(starts):.2f} of them; the weight at the middle {1.1 - (lo + min(hi, 1)) / 2:.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
