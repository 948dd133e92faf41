"""GPU check for the speculative evaluator (issue 4): plain vs DFlash speculative decoding on the same harness.

Run on the H200 machine (no network; the GGUF travels in two halves as benchmarks/gpu_demo.sh describes):
  PYTHONPATH=src python3 benchmarks/gpu_eval_check.py --target .gpu/SmolLM2-135M-Instruct.Q4_1.gguf --drafter DIR
Without --drafter a random drafter is built (tau ~ 1: checks the plumbing, losslessness and graph speed only).

Stages (each isolated: a failure prints its traceback and the next stage still runs):
  1. eager (no CUDA graphs) plain + speculative on 2 prompts: the reference tokens;
  2. CUDA graphs on every prompt: tokens/s both ways, speedup, tau, lossless; graphed tokens == eager tokens;
  3. sampling (T=1) with graphs: tau and tokens/s (no lossless verdict: a distribution, not a sequence);
  4. HF `generate` on one prompt (the ~28 tokens/s reference) and `generate_batch` throughput (dataset regeneration).
Prints one table last.
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from dflash_train.config import ModelConfig
from dflash_train.inference.baseline import generate_batch
from dflash_train.inference.benchmark import evaluate, stop_token_ids
from dflash_train.inference.prompts import FALLBACK_PROMPTS, Prompt, tokenize_prompts
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.target import load_target, load_tokenizer, target_config_info

ROWS: list[tuple] = []


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stage(name):
    def wrap(fn):
        def run(*a, **kw):
            print(f"--- {name}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - report and go on with the next stage
                traceback.print_exc()
                ROWS.append((name, "FAILED", "", "", "", "", f"{time.perf_counter() - t0:.0f}s"))
        return run
    return wrap


def add_row(name, report, wall):
    s = report.summary()
    lossless = "n/a" if s["lossless"] is None else ("yes" if s["lossless"] else
                                                   f"NO {s['identical_prompts']}/{s['num_prompts']}")
    ROWS.append((name, f"{s['baseline_tokens_per_s']:.1f}", f"{s['speculative_tokens_per_s']:.1f}",
                 f"{s['speedup']:.2f}x", f"{s['mean_tau']:.2f}" if s["mean_tau"] else "-", lossless,
                 f"{wall:.0f}s"))
    for i, p in enumerate(report.prompts):
        if p.first_mismatch is not None:
            print(f"  prompt {i}: first mismatch at token {p.first_mismatch}, target top-2 margin "
                  f"{p.mismatch_margin} (bf16 near-ties can flip argmax between q=1 and q=B passes)")
    print(f"  accept histogram {s['accept_histogram']}")
    print(f"  acceptance by position {[round(x, 3) for x in s['acceptance_by_position'] if x is not None]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", default=None, help="drafter directory (default: a random drafter)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--device", default="cuda:0", help="cpu = smoke-test this script without graphs")
    args = ap.parse_args()

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if on_gpu else 'cpu'}", flush=True)
    tok = load_tokenizer(args.target)
    if args.drafter:
        drafter = load_drafter(args.drafter, device)
    else:
        torch.manual_seed(0)
        drafter = build_drafter(ModelConfig(), target_config_info(args.target), tok).to(device)
    target = load_target(args.target, drafter.config.target_layer_ids, device=device, truncate=False)
    stop = stop_token_ids(target.hf, tok)
    msgs = (FALLBACK_PROMPTS * 4)[: args.num_prompts]
    prompts = tokenize_prompts([Prompt("messages", [{"role": "user", "content": m}]) for m in msgs], tok)
    B = args.block_size or drafter.config.block_size
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}..{max(map(len, prompts))} tokens), B={B}, "
          f"max_new_tokens={args.max_new_tokens}, stop ids {stop}", flush=True)
    common = dict(block_size=B, stop_ids=stop)
    eager_out = {}

    @stage("eager, greedy, 2 prompts")
    def eager():
        t0 = time.perf_counter()
        rep = evaluate(target, drafter, prompts[:2], args.max_new_tokens, 0.0, graphs=False, **common)
        add_row("eager greedy", rep, time.perf_counter() - t0)
        eager_out["tokens"] = [p.speculative for p in rep.prompts]

    @stage("cuda graphs, greedy")
    def graphs():
        t0 = time.perf_counter()
        rep = evaluate(target, drafter, prompts, args.max_new_tokens, 0.0, graphs=on_gpu, **common)
        add_row("graphs greedy", rep, time.perf_counter() - t0)
        if "tokens" in eager_out:
            same = [p.speculative for p in rep.prompts[:2]] == eager_out["tokens"]
            print(f"  graphed speculative tokens == eager speculative tokens: {same}")

    @stage("cuda graphs, sampling T=1")
    def sampling():
        t0 = time.perf_counter()
        rep = evaluate(target, drafter, prompts, args.max_new_tokens, 1.0, graphs=on_gpu, **common)
        add_row("graphs T=1", rep, time.perf_counter() - t0)

    @stage("HF generate (reference) and generate_batch")
    def hf_and_batch():
        ids = torch.tensor([prompts[0]], device=device)
        target.hf.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = target.hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        sync()
        hf_tps = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
        ROWS.append(("HF generate, 1 prompt", f"{hf_tps:.1f}", "", "", "", "", ""))
        batch = (prompts * 8)[:32]
        generate_batch(target.hf, batch[:2], 4, stop)  # warm-up (a fresh capture per call)
        sync()
        t0 = time.perf_counter()
        outs = generate_batch(target.hf, batch, args.max_new_tokens, stop)
        sync()
        dt = time.perf_counter() - t0
        ROWS.append((f"generate_batch x{len(batch)}", f"{sum(map(len, outs)) / dt:.1f}", "", "", "", "",
                     f"{dt:.0f}s"))

    for fn in (eager, graphs, sampling, hf_and_batch):
        fn()
    head = ("stage", "plain tok/s", "spec tok/s", "speedup", "tau", "lossless", "wall")
    print("\n" + "  ".join(f"{h:>22}" if i == 0 else f"{h:>11}" for i, h in enumerate(head)))
    for r in ROWS:
        print("  ".join(f"{c:>22}" if i == 0 else f"{c:>11}" for i, c in enumerate(r)))


if __name__ == "__main__":
    main()
