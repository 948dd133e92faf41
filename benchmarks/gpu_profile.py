#!/usr/bin/env python3
"""Where the time goes, by kernel: torch.profiler over the SmolLM2-shaped stages that bench.py only times.

  PYTHONPATH=src python3 benchmarks/gpu_profile.py generate   # batched decoding (regeneration): prefill and steps
  PYTHONPATH=src python3 benchmarks/gpu_profile.py engine     # the regeneration engine on chat-like lengths: where
                                                              # its wall time goes (host vs device), variants
  PYTHONPATH=src python3 benchmarks/gpu_profile.py target     # the training target stage: one 8,192-token row
  PYTHONPATH=src python3 benchmarks/gpu_profile.py drafter    # the drafter training step (v1 and DFlash 2): the
                                                              # demo's bottleneck, at the demo's 8,192 x 1,024 x 16
                                                              # with 8 layers (PROFILE_ARCHS=dflash: v1 only)

Random-init weights of SmolLM2-135M's shape (speed does not depend on the values), bf16, one GPU. Prints, per
case, the time per call (CUDA events, median of 5 after warm-up) and the top kernels of one profiled call: the
breakdown that says what to speed up. A probe, not a benchmark: its figures go to docs/BENCHMARKS.md only with
this command next to them.
"""

from __future__ import annotations

import itertools
import math
import os
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
    print(f"--- {title}: top kernels (one call)")
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


def chat_like_requests(n: int, seed: int, median_prompt: float, sigma: float, max_prompt: int, pool: int):
    """Requests shaped like the demo's regeneration: log-normal prompt lengths, sorted by length in pools of `pool`
    (as generation/regenerate.py hands them out), replies that end at 32..256 tokens (a random model never emits a
    stop token: the reply length is its max_new_tokens), 35% at the 256 cap."""
    import random

    from dflash_train.generation.engine import Request

    rng = random.Random(seed)
    out = []
    for i in range(n):
        P = int(min(max_prompt, max(8, rng.lognormvariate(math.log(median_prompt), sigma))))
        new = 256 if rng.random() < 0.35 else rng.randint(32, 255)
        out.append(Request(i, [rng.randrange(1, 49152) for _ in range(P)], new))
    return [r for k in range(0, n, pool) for r in sorted(out[k: k + pool], key=lambda r: len(r.prompt_ids))]


def timed_engine(engine_cls):
    """engine_cls with the host time of its refills (prefill forwards), launches and checks (the wait for the
    device) added up in .spent, and its prefill forwards counted."""
    import time as _time

    class Timed(engine_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.spent = dict(refill=0.0, launch=0.0, collect=0.0, prefills=0)

        def _timed(self, name, *a):
            t = _time.perf_counter()
            try:
                return getattr(super(), "_" + name)(*a)
            finally:
                self.spent[name] += _time.perf_counter() - t

        def _refill(self, *a):
            return self._timed("refill", *a)

        def _launch(self, *a):
            return self._timed("launch", *a)

        def _collect(self, *a):
            return self._timed("collect", *a)

        def _prefill(self, *a):
            self.spent["prefills"] += 1
            return super()._prefill(*a)

    return Timed


def profile_engine() -> None:
    """generation/engine.py as regeneration runs it (2,048 slots, greedy) on chat-like lengths: tokens/s, and
    where the wall time goes on the host: refills (prefill forwards), step launches, the wait at each check (the
    device still busy), the rest (on_done, prefetch). Variants side by side in one run, the engine of an earlier
    commit too when benchmarks/_engine_before.py holds it (`git show REF:src/dflash_train/generation/engine.py`)."""
    import gc
    import importlib.util
    import random
    import time as _time

    from dflash_train.generation.engine import Engine, EngineStats, Request

    engines = {"now": Engine}
    before = Path(__file__).with_name("_engine_before.py")
    if before.is_file():
        spec = importlib.util.spec_from_file_location("dflash_train.generation._engine_before", before)
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(mod)
        engines["before"] = mod.Engine
    hf = smollm2_llama()
    workloads = {"sharegpt-like": dict(median_prompt=110, sigma=1.0, max_prompt=1790),
                 "self-prompt-like": dict(median_prompt=60, sigma=0.4, max_prompt=400)}
    mask = dict(decode_attention="mask")  # on CUDA the default is flex
    variants = [("before", dict(batch_size=768)),
                ("now", dict(batch_size=768, overlap_prefill=False, prefill_graphs=False, **mask)),
                ("now", dict(batch_size=768, prefill_graphs=False, **mask)),
                ("now", dict(batch_size=768, **mask)),     # overlap_prefill, graphed prefill, masked decode
                ("now", dict(batch_size=768)),             # the defaults: and each row reading its own slots (flex)
                ("now", dict(batch_size=1536, **mask)),
                ("now", dict(batch_size=1536))]
    quick = os.environ.get("ENGINE_QUICK") == "1"  # the defaults vs flex decode only, no kernel tables
    if quick:
        variants = variants[3:]
    if os.environ.get("FLEX_DEFAULT_CONFIG") == "1":  # flex kernels without autotuning (profile_flexstep)
        import dflash_train.inference.attention as attention
        from torch.nn.attention.flex_attention import flex_attention

        attention._compiled_flex = torch.compile(flex_attention, dynamic=False)
    print("workload | engine | requests | generated | s | tokens/s | row use | kv read/needed | prefill padded/real "
          "| refill s | launch s | wait s | rest s | prefill fwds | same tokens as the first row")
    for wname, shape in workloads.items():
        first = None
        for which, kw in variants:
            if which not in engines:
                continue
            eng = timed_engine(engines[which])(hf, max_len=2048, **kw)
            pool = 8 * kw["batch_size"]
            eng.run(chat_like_requests(512, 1, pool=pool, **shape), lambda r, t: None)  # captures most graphs
            eng.spent = dict.fromkeys(eng.spent, 0)
            got = {}
            st = eng.run(chat_like_requests(3 * 1536, 2, pool=pool, **shape), lambda r, t: got.__setitem__(r.key, t))
            first = first or got
            same = sum(got[k] == first[k] for k in got) / len(got)
            sp = eng.spent
            rest = st.seconds - sp["refill"] - sp["launch"] - sp["collect"]
            print(f"{wname} | {which} {kw} | {st.requests} | {st.generated_tokens:,} | {st.seconds:.1f} | "
                  f"{st.generated_tokens / st.seconds:,.0f} | {st.generated_tokens / max(st.row_steps, 1):.0%} | "
                  f"{st.kv_slots_read / max(st.kv_slots_needed, 1):.2f} | "
                  f"{st.prefill_padded / max(st.prefill_tokens, 1):.2f} | {sp['refill']:.1f} | {sp['launch']:.1f} | "
                  f"{sp['collect']:.1f} | {rest:.1f} | {sp['prefills']} | {same:.1%}", flush=True)
            eng = None
            gc.collect()  # the graphs' closures hold the engine and its cache
            torch.cuda.empty_cache()
    # One graphed step alone (masked: every row reads `visible` slots; flex: every row `slots` slots of its own), by
    # CUDA events; then (not in quick mode) the eager kernel tables.
    eng = Engine(hf, 768, 2048, decode_attention="mask")
    flex = Engine(hf, 768, 2048, decode_attention="flex")
    eng.finished.fill_(False)
    flex.finished.fill_(False)
    flex.limit.fill_(1 << 30)  # live rows all along: an ended row reads nothing under flex
    for vis in (256, 512, 1024, 2048):
        kv = 768 * vis * 2 * 30 * 3 * 64 * 2
        for name, e in (("masked", eng), ("flex", flex)):
            if e is flex:
                flex.pos.fill_(vis - 32)  # 20 timed steps and the warm-up advance it: it stays inside vis
                step = flex._graphed(768, 2048, False)
            else:
                step = eng._graphed(768, vis, False)
            ms = timed(step, 20)
            print(f"graphed decode step ({name}), 768 rows, {vis} slots each: {ms:.3f} ms = {768 / ms * 1e3:,.0f} "
                  f"tokens/s; KV read {kv / 1e9:.1f} GB = {kv / ms / 1e9:.2f} TB/s", flush=True)
    flex.finished.fill_(True)
    flex = None
    if quick:
        return
    eng.finished.fill_(True)
    eager = Engine(hf, 768, 2048, graphs=False, decode_attention="mask")
    eager.finished.fill_(False)
    top_kernels(lambda: eager._decode(768, 512, False), "decode step, 768 rows, 512 visible (eager)", rows=12)
    eager = None
    eng = None
    gc.collect()
    rng = random.Random(0)
    for which, cls in engines.items():
        eng = cls(hf, 128, 2048)
        for n, P in ((32, 128), (32, 512), (128, 256)):
            reqs = [Request(i, [rng.randrange(49152) for _ in range(P)], 8) for i in range(n)]
            prefill = (lambda: eng._prefill(list(range(n)), reqs, EngineStats()))
            ms = timed(prefill, 5)
            torch.cuda.synchronize()
            t = _time.perf_counter()
            prefill()
            host = (_time.perf_counter() - t) * 1e3
            torch.cuda.synchronize()
            print(f"{which}: eager prefill forward, {n} prompts x {P}: {ms:.2f} ms between CUDA events; host "
                  f"returns after {host:.2f} ms (launch-bound where the two agree)")
            if (n, P) == (32, 512):
                top_kernels(prefill, f"{which}: prefill {n} x {P}", rows=8)
        eng = None
        gc.collect()


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
    """The drafter step the demo trains (fwd + bwd + clip + AdamW), timed in each mode of PROFILE_MODES (default:
    reduce-overhead, as trained, then default): the kernel breakdown comes from `default`, the same compiled kernels
    without CUDA graphs (a graph replays as one opaque launch), and from `eager` where named."""
    import harness
    from cases import DrafterRig, train_batches
    from dflash_train.training import objective

    suite = harness.SUITES["gpu-smollm2"]
    ctx = harness.Context(suite)
    batches, _ = train_batches(ctx, suite=suite)

    # PROFILE_TILES: the flex kernels' tile sizes, "product" (objective.flex_kernel_options, as trained) and/or
    # "default" (flex's own), each compiled afresh, so that one run gives the ratio on one card. PROFILE_LOSS_CHUNKS:
    # train.loss_chunk values ("default": the config's; e.g. "default 512": 512-row chunks, whose logits
    # (50 MB) may stay in an H100's L2 between the LM head's matmul and the loss's reduction).
    # "sparse64": the product's kernel options on a mask of 64-wide tiles (objective.DRAFTER_MASK_TILE).
    # "tiles64": the 64-wide tiles with inductor's own backward launch settings (the product before 2026-12-07).
    tile_choices = {"product": (objective.flex_kernel_options, objective.DRAFTER_MASK_TILE),
                    "default": (lambda q: None, objective.DRAFTER_MASK_TILE),
                    "sparse64": (objective.flex_kernel_options, 64),
                    "tiles64": (lambda q: objective.SMALL_HEAD_TILES, objective.DRAFTER_MASK_TILE)}
    with torch.enable_grad():
        for arch, mode, tiles, chunk in itertools.product(
                os.environ.get("PROFILE_ARCHS", "dflash dflash2").split(),
                os.environ.get("PROFILE_MODES", "reduce-overhead default").split(),
                os.environ.get("PROFILE_TILES", "product").split(),
                os.environ.get("PROFILE_LOSS_CHUNKS", "default").split()):
            objective.flex_kernel_options, objective.DRAFTER_MASK_TILE = tile_choices[tiles]
            torch._dynamo.reset()
            rig = DrafterRig(ctx, mode, "flex", tag=f"profile-{arch}-{mode}-{tiles}-{chunk}", suite=suite,
                             architecture=arch, loss_chunk=None if chunk == "default" else int(chunk))
            feats = torch.randn(suite.token_budget, rig.cfg.num_feature_layers * rig.cfg.hidden_size,
                                device=ctx.device, dtype=suite.dtype)
            calls = itertools.count()

            def step():
                rig.fwd_bwd(batches[next(calls) % len(batches)], feats)
                rig.optim()

            ms = timed(step, 10)
            print(f"drafter step {arch}, {mode}, {tiles} tiles, loss chunk {chunk}: {ms:.2f} ms = "
                  f"{1e3 / ms:.1f} steps/s of {suite.token_budget} tokens x {suite.num_anchors} anchors")
            if mode != "reduce-overhead":
                top_kernels(step, f"drafter step {arch} ({mode})", rows=25)
            rig = None
            torch.cuda.empty_cache()


def profile_flexstep() -> None:
    """The flex decoding step (768 rows of `slots` live slots each) with the default compile and with autotuned
    kernel configs, against the masked step."""
    import gc

    import dflash_train.inference.attention as attention
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.generation.engine import Engine

    hf = smollm2_llama()
    for mode in (None, "max-autotune-no-cudagraphs"):
        attention._compiled_flex = torch.compile(flex_attention, dynamic=False, mode=mode)
        flex = Engine(hf, 768, 2048, decode_attention="flex")
        flex.finished.fill_(False)
        flex.limit.fill_(1 << 30)
        for slots in (128, 256, 512, 1024, 2048):
            flex.pos.fill_(slots - 32)
            ms = timed(flex._graphed(768, 2048, False), 20)
            kv = 768 * slots * 2 * 30 * 3 * 64 * 2
            print(f"flex step (compile mode {mode}), 768 rows x {slots} slots: {ms:.3f} ms = "
                  f"{768 / ms * 1e3:,.0f} tokens/s; KV {kv / 1e9:.1f} GB = {kv / ms / 1e9:.2f} TB/s", flush=True)
        flex.finished.fill_(True)
        flex = None
        gc.collect()


if __name__ == "__main__":
    what = sys.argv[1:] or ["generate", "target", "drafter"]
    with torch.no_grad():
        for w in what:
            {"generate": profile_generate, "engine": profile_engine, "flexstep": profile_flexstep,
             "target": profile_target, "drafter": profile_drafter}[w]()
