#!/usr/bin/env python3
"""Benchmark: `evaluate` with its untimed prompts decoded one at a time (batch_rows=1) and together
(inference/batched.py), a random 2-layer drafter or a trained one, the bundled yardstick prompts.

  PYTHONPATH=src .venv/bin/python benchmarks/eval_batched.py [PROMPTS] [NEW_TOKENS] [ROWS] [--device D]
      [--target embedded | DIR | GGUF | random:DIR] [--drafter DIR] [--dtype bf16|fp32] [--repeats N] [--timed N]

PROMPTS yardstick prompts (default 8), NEW_TOKENS each (default 48), one of them timed (plain decoding and one-prompt
speculative decoding; --timed sets how many, the demo times 16 a set); the rest decoded ROWS at a time (default 8)
against one at a time, alternating --repeats times (default 2). Prints seconds per evaluation and whether both gave
the same tokens and acceptance lengths. A random drafter accepts almost nothing (tau ~1): every prompt takes
~NEW_TOKENS steps, the most steps a prompt can, and the batched target cache runs through all its slots; --drafter
(a trained drafter's directory, e.g. the GPU demo's: benchmarks/gpu_demo.sh eval_rows) accepts in part, rows then
keeping different numbers of tokens a step.

--target: the embedded SmolLM2 (default, CPU: its GGUF converted), a model directory, or random:DIR, a model of DIR's
config.json with random weights and DIR's tokenizer (benchmarks/gpu_demo.sh eval_batched: SmolLM2's shape on a GPU
machine without the GGUF staged; fp32 there, so that near-ties of a random model's flat logits cannot round apart).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash_train.config import ModelConfig
from dflash_train.demo import local_embedded_target
from dflash_train.inference.benchmark import evaluate, stop_token_ids
from dflash_train.inference.prompts import read_prompt_file, tokenize_prompts
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.target import load_target, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def random_model_dir(src: Path, out: Path) -> Path:
    """A model of src/config.json with random weights (seed 0), saved with src's tokenizer files into out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def model_dir(spec: str, tmp: Path) -> str:
    if spec == "embedded":
        return str(local_embedded_target(tmp, None))
    if spec.startswith("random:"):
        return str(random_model_dir(Path(spec.removeprefix("random:")), tmp / "random"))
    return spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="?", type=int, default=8)
    p.add_argument("new_tokens", nargs="?", type=int, default=48)
    p.add_argument("rows", nargs="?", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", default="embedded")
    p.add_argument("--drafter", default=None, help="a drafter directory (default: a random 2-layer drafter)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timed", type=int, default=1)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = model_dir(args.target, Path(tmp))
        drafter = load_drafter(args.drafter) if args.drafter else None
        target = load_target(hf_dir, drafter.config.target_layer_ids if drafter else None, device=args.device,
                             dtype=dtype, truncate=False)
        tok = load_tokenizer(hf_dir)
        if drafter is None:
            torch.manual_seed(0)
            drafter = build_drafter(ModelConfig(target_layer_ids=target.layer_ids, num_draft_layers=2,
                                                mask_token_id=target.info.vocab_size - 1), target.info)
        prompts = tokenize_prompts(read_prompt_file("yardstick")[:args.prompts], tok)
        stops = stop_token_ids(target.hf, tok)
        reports, seconds = {}, {1: [], args.rows: []}
        for _ in range(args.repeats):
            for r in (1, args.rows):
                t0 = time.perf_counter()
                reports[r] = evaluate(target, drafter, prompts, args.new_tokens, stop_ids=stops, timed=args.timed,
                                      batch_rows=r)
                seconds[r].append(time.perf_counter() - t0)
    pairs = list(zip(reports[1].prompts, reports[args.rows].prompts))
    same = sum((a.speculative, a.accept_lengths) == (b.speculative, b.accept_lengths) for a, b in pairs)
    steps = sum(len(a.accept_lengths) for a, _ in pairs)
    print(f"{args.prompts} yardstick prompts x {args.new_tokens} new tokens, {args.timed} timed, target "
          f"{args.target} ({args.dtype}), drafter {args.drafter or 'random'}, on {args.device}, torch "
          f"{torch.__version__}; tau {reports[args.rows].summary()['mean_tau']:.2f}, {steps} verification steps "
          "one at a time")
    for r, s in seconds.items():
        print(f"  untimed prompts {'one at a time' if r == 1 else f'{r} at a time'}: "
              f"{', '.join(f'{x:.1f}' for x in s)} s")
    print(f"  the same tokens and acceptance lengths: {same} of {len(pairs)} prompts")


if __name__ == "__main__":
    main()
