#!/usr/bin/env python3
"""Where the time goes, by kernel: torch.profiler over the SmolLM2-shaped stages that bench.py only times.

  PYTHONPATH=src python3 benchmarks/gpu_profile.py generate   # batched decoding (regeneration): prefill and steps
  PYTHONPATH=src python3 benchmarks/gpu_profile.py target     # the training target stage: one 8,192-token row
  PYTHONPATH=src python3 benchmarks/gpu_profile.py drafter    # the drafter training step (v1 and DFlash 2): the
                                                              # demo's bottleneck, at the demo's 8,192 x 1,024 x 16

Random-init weights of SmolLM2-135M's shape (speed does not depend on the values), bf16, one GPU. Prints, per
case, the time per call (CUDA events, median of 5 after warm-up) and the top kernels of one profiled call, eager:
the breakdown that says what to speed up. A probe, not a benchmark: its figures go to docs/BENCHMARKS.md only with
this command next to them.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, n: int = 5) -> float:
    """Median ms of n calls after 2 warm-up calls (harness.time_calls: CUDA events, one sync at the end)."""
    from harness import time_calls

    return time_calls(lambda i: fn(), torch.device("cuda"), warmup=1, iters=n)[1]


def top_kernels(fn, title: str, rows: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {title}: top kernels (one call, eager)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def smollm2_llama():
    from harness import SMOLLM2_135M
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        cfg = LlamaConfig(**SMOLLM2_135M, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def profile_generate() -> None:
    from dflash_train.inference.baseline import BatchGenerator

    hf = smollm2_llama()
    print("case | batch | prompt | ms | per row-token")
    for batch, P in [(256, 128), (512, 128), (512, 512), (512, 1024), (1024, 128)]:
        gen = BatchGenerator(hf, batch, P + 256)
        run = gen.runner
        ids = torch.randint(0, 49152, (batch, P))
        pre = timed(lambda: run.prefill(ids, [0] * batch), 3)
        tok = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        step = timed(lambda: run.step(tok, P + 100), 20)
        print(f"prefill | {batch} | {P} | {pre:.2f} | {pre / batch / P * 1e3:.3f} us")
        print(f"graphed decode step (window at slot {P + 100}) | {batch} | {P} | {step:.3f} | "
              f"{batch / step * 1e3:,.0f} tokens/s")
        prompts = [torch.randint(0, 49152, (P,)).tolist() for _ in range(batch)]
        whole = timed(lambda: gen.generate(prompts, 256), 1)
        print(f"generate(256 new, no stop) | {batch} | {P} | {whole:.1f} | {batch * 256 / whole * 1e3:,.0f} tokens/s")
        gen = run = None  # frees the cache before the next size
        torch.cuda.empty_cache()
    eager = BatchGenerator(hf, 512, 512 + 256, graphs=False)
    ids = torch.randint(0, 49152, (512, 512))
    top_kernels(lambda: eager.runner.prefill(ids, [0] * 512), "prefill 512 x 512")
    tok = torch.zeros(512, 1, dtype=torch.long, device="cuda")
    top_kernels(lambda: eager.runner.step(tok, 600), "decode step 512 rows at slot 600")


def profile_target() -> None:
    import harness
    from cases import build_target, packed_row

    suite = harness.SUITES["gpu-smollm2"]
    ctx = harness.Context(suite)
    target = build_target(ctx)
    row = packed_row(suite.token_budget, suite.num_docs, suite.target["vocab_size"])
    ids, pos, doc = (t.to("cuda") for t in (row.input_ids, row.position_ids, row.doc_ids))
    for attn in ("sdpa", "flex"):
        target.set_attention(attn)
        fn = (lambda: target.features(ids, pos, doc))
        ms = timed(fn)
        print(f"target features, {attn}: {ms:.2f} ms per {suite.token_budget}-token row = "
              f"{suite.token_budget / ms * 1e3:,.0f} tokens/s")
        top_kernels(fn, f"target features ({attn})")
    target.set_attention("sdpa")


def profile_drafter() -> None:
    """The drafter step the demo trains (fwd + bwd + clip + AdamW): compiled (reduce-overhead, as trained) for the
    time, eager for the kernel breakdown (a CUDA graph replays as one opaque launch)."""
    import harness
    from cases import DrafterRig, train_batches

    suite = harness.SUITES["gpu-smollm2"]
    ctx = harness.Context(suite)
    batches, _ = train_batches(ctx, suite=suite)
    with torch.enable_grad():
        for arch in ("dflash", "dflash2"):
            for mode in ("reduce-overhead", "eager"):
                rig = DrafterRig(ctx, mode, "flex", tag=f"profile-{arch}-{mode}", suite=suite, architecture=arch)
                feats = torch.randn(suite.token_budget, rig.cfg.num_feature_layers * rig.cfg.hidden_size,
                                    device=ctx.device, dtype=suite.dtype)
                calls = itertools.count()

                def step():
                    rig.fwd_bwd(batches[next(calls) % len(batches)], feats)
                    rig.optim()

                ms = timed(step, 10)
                print(f"drafter step {arch}, {mode}: {ms:.2f} ms = {1e3 / ms:.1f} steps/s of {suite.token_budget} "
                      f"tokens x {suite.num_anchors} anchors")
                if mode == "eager":
                    top_kernels(step, f"drafter step {arch} (eager)", rows=25)
                rig = None
                torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1:] or ["generate", "target", "drafter"]
    with torch.no_grad():
        for w in what:
            {"generate": profile_generate, "target": profile_target, "drafter": profile_drafter}[w]()
