"""Stage benchmarks: matmul peak, target stage, drafter step, colocated baseline (end to end: cases_end_to_end.py).

FLOP counts come from dflash_train.training.flops (its docstring is the formula); MFU divides achieved model
FLOP/s by the bf16 matmul rate measured first in the same run.
"""

from __future__ import annotations

import dataclasses

import statistics
import time

import torch
import torch.nn.functional as F
from harness import (SUITES, Context, CudagraphSkipLog, Row, Skip, Timer, benchmark, compile_counters,
                     count_host_syncs, counters_delta, sync, time_calls)

from dflash_train.config import ModelConfig, TrainConfig
from dflash_train.data.packing import Sample, make_batch, pack_samples
from dflash_train.models.build import dflash2_config
from dflash_train.models.drafter import DFlashDrafter, build_drafter_config
from dflash_train.models.drafter2 import DFlash2Drafter
from dflash_train.models.target import FeatureForward, TargetInfo, TargetModel, default_layer_ids
from dflash_train.training.cudagraphs import configure_cudagraphs
from dflash_train.training.flops import drafter_step_flops, target_forward_flops, visible_pairs
from dflash_train.training.objective import block_layout, default_gamma, dense_block_mask, position_weights, sdpa_attend
from dflash_train.training.optim import Updater, build_optimizer, build_scheduler
from dflash_train.training.step import DrafterStep

MATMUL_SPIN_UP_S = 1.0   # seconds of matmuls on the GPU before the peak is timed (bench_matmul)

# ------------------------------------------------------------------------------------------- shared pieces


def target_config(suite):
    from transformers import Qwen3Config

    return Qwen3Config(**suite.target, attn_implementation="sdpa")


def target_info(suite) -> TargetInfo:
    return TargetInfo.from_config(target_config(suite))


def drafter_config(suite, architecture: str = "dflash"):
    """The suite's drafter; dflash2 with the config's default DFlash 2 sizes (model.conv_kernel_size, ...)."""
    info = target_info(suite)
    ids = default_layer_ids(info.num_layers, suite.num_taps)
    cfg = build_drafter_config(info, ids, mask_token_id=info.vocab_size - 1, block_size=suite.block_size,
                               num_draft_layers=suite.draft_layers)
    if architecture == "dflash2":
        return dflash2_config(ModelConfig(architecture="dflash2", block_size=suite.block_size), cfg)
    return cfg


def packed_row(T: int, num_docs: int, vocab: int, seed: int = 0):
    """One packed row of `num_docs` equal documents of random tokens; the first 1/8 of each is an unsupervised
    prompt (anchors are drawn from the rest)."""
    g = torch.Generator().manual_seed(seed)
    lens = [T // num_docs] * num_docs
    lens[-1] += T - sum(lens)
    samples = [Sample(torch.randint(0, vocab, (n,), generator=g).tolist(), [i >= max(1, n // 8) for i in range(n)])
               for n in lens]
    (row,) = pack_samples(samples, T)
    return row


def causal_pairs(doc_ids: torch.Tensor) -> float:
    """Attended (query, key) pairs of a document-causal forward: sum of n^2 / 2 over documents."""
    return float(sum(int(n) ** 2 / 2 for n in torch.unique_consecutive(doc_ids, return_counts=True)[1]))


def build_target(ctx: Context, device: str | torch.device | None = None) -> TargetModel:
    """Random-init Qwen3 of the suite's shape, built on the device in the compute dtype (the init runs there:
    seconds for 8B parameters), wrapped as the feature tap. Without `device`: on ctx.device, cached for later
    benchmarks. With `device`: a fresh replica there (same seed, so the same weights as the cached one), not cached:
    the caller frees it (a pipeline layout with several target GPUs)."""
    if device is None and "target" in ctx.cache:
        return ctx.cache["target"]
    from transformers import Qwen3ForCausalLM

    s, cfg = ctx.suite, target_config(ctx.suite)
    dev = ctx.device if device is None else torch.device(device)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)
    try:
        torch.manual_seed(0)   # seeds every CUDA device's generator too: each replica draws the same weights
        with torch.device(dev):
            hf = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    info = TargetInfo.from_config(cfg)
    target = TargetModel(hf.eval(), default_layer_ids(info.num_layers, s.num_taps), truncate=True)
    sync(dev)
    if device is None:
        ctx.cache["target"] = target
        ctx.cache["target_build_s"] = time.perf_counter() - t0
    return target


def train_batches(ctx: Context, n: int = 4, suite=None):
    """n TrainBatches of one packed row with different anchors (on the device), and their mean visible pairs.
    suite: whose shapes (default ctx.suite)."""
    s = suite or ctx.suite
    row = packed_row(s.token_budget, s.num_docs, s.target["vocab_size"])
    batches = [make_batch(row, s.num_anchors, seed=0, index=i) for i in range(n)]
    pairs = statistics.mean(visible_pairs(b.anchors, b.doc_ids, s.block_size) for b in batches)
    return [b.to(ctx.device) for b in batches], pairs


class DrafterRig:
    """A fresh drafter (fp32 master weights), its optimizer and a step function, as the trainer drives them.
    suite: whose shapes and timing knobs (default ctx.suite); architecture: dflash | dflash2 (model.architecture);
    loss_chunk: train.loss_chunk (None: its default)."""

    def __init__(self, ctx: Context, compile_mode: str, attention: str, tag: str, reference: bool = False,
                 suite=None, architecture: str = "dflash", loss_chunk: int | None = None):
        s, dev = suite or ctx.suite, ctx.device
        self.suite = s
        self.cfg = drafter_config(s, architecture)
        H, V = self.cfg.hidden_size, self.cfg.vocab_size
        torch.manual_seed(0)
        with torch.device(dev):
            self.drafter = (DFlash2Drafter if architecture == "dflash2" else DFlashDrafter)(self.cfg).train()
            self.embed_w = (torch.randn(V, H) * 0.02).to(s.dtype)
            self.head_w = (torch.randn(V, H) * 0.02).to(s.dtype)
        self.tcfg = TrainConfig(token_budget=s.token_budget, num_anchors=s.num_anchors, compile=compile_mode,
                                attention=attention, dtype="bf16" if s.dtype == torch.bfloat16 else "fp32",
                                **({} if loss_chunk is None else {"loss_chunk": loss_chunk}))
        backend = s.compile_backend if compile_mode != "eager" else None
        self.step = DrafterStep(self.drafter, self.embed_w, self.head_w, self.tcfg, dev, tag=tag, backend=backend)
        self.reference = reference
        self.params = list(self.drafter.parameters())
        self.opt = build_optimizer(self.params, self.tcfg, dev)
        # The trainer's update (clip, AdamW with the non-finite skip, schedule, zero grads), so its host syncs count.
        flat_lr = build_scheduler(self.opt, dataclasses.replace(self.tcfg, warmup_ratio=0.0), 10**6)
        self.update = Updater(self.params, self.opt, flat_lr, 1.0, "skip", announce=False)
        self.steps = 0

    def fwd_bwd(self, batch, feats):
        if self.reference:
            return reference_step(self, batch, feats)
        return self.step(batch, feats)

    def optim(self):
        self.steps += 1
        self.update(self.steps)


def reference_step(rig: DrafterRig, b, feats):
    """The straightforward step the issue measured as its starting point: dense [A*B, T+A*B] boolean mask
    + SDPA, all A*(B-1) x V logits in fp32 at once, plain autograd cross-entropy, eager."""
    cfg, st = rig.cfg, rig.step
    B, A = cfg.block_size, b.anchors.shape[0]
    with torch.autocast(feats.device.type, dtype=st.dtype, enabled=st.dtype != torch.float32):
        lay = block_layout(b.input_ids, b.position_ids, b.doc_ids, b.loss_mask, b.anchors, b.anchor_valid, B,
                           cfg.mask_token_id)
        x = F.embedding(lay.block_ids.flatten(), st.embed_w)
        h = rig.drafter(x, lay.block_pos, feats.to(st.dtype), b.position_ids,
                        sdpa_attend(dense_block_mask(b.anchors, b.doc_ids, B)))
        logits = (h.view(A, B, -1)[:, 1:] @ st.head_w.t()).float()             # [A, B-1, V]
        ce = F.cross_entropy(logits.flatten(0, 1), lay.labels.flatten(), reduction="none").view(A, B - 1)
        w = position_weights(B, default_gamma(B), device=ce.device)[None, :] * lay.valid.float()
        loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    loss.backward()
    return {"loss": loss.detach()}


def measure_drafter(ctx: Context, rig: DrafterRig, batches, feats, flops: float) -> Row:
    """Time full training steps (fwd+bwd, clip, AdamW) with device events; count host syncs; collect compile
    diagnostics. ms = median step; MFU over the step's model FLOPs."""
    s, dev = rig.suite, ctx.device
    before = compile_counters()
    with CudagraphSkipLog() as cg:
        t0 = time.perf_counter()
        first = rig.fwd_bwd(batches[0], feats)   # same weights, same batch in every variant: compare the losses
        rig.optim()
        sync(dev)
        first_s = time.perf_counter() - t0
        for i in range(s.warmup):
            rig.fwd_bwd(batches[(1 + i) % len(batches)], feats)
            rig.optim()
        timer = Timer(dev)
        timer.mark()
        for i in range(s.iters):
            out = rig.fwd_bwd(batches[i % len(batches)], feats)
            timer.mark()
            rig.optim()
            timer.mark()
        iv = timer.intervals_ms()
        fb, op = iv[0::2], iv[1::2]
        step_ms = statistics.median(a + b for a, b in zip(fb, op))
        syncs_step = count_host_syncs(lambda: rig.fwd_bwd(batches[0], feats), dev)
        syncs_optim = count_host_syncs(rig.optim, dev)
    loss, loss_first = float(out["loss"]), float(first["loss"])
    tflops, mfu = ctx.mfu(flops, step_ms)
    diag = counters_delta(before, compile_counters())
    extra = {"fwd_bwd_ms": statistics.median(fb), "optim_ms": statistics.median(op), "first_call_s": first_s,
             "host_syncs_step": syncs_step, "host_syncs_optim": syncs_optim, "loss_first": loss_first,
             "loss": loss, "train_flops": flops,
             "compile": diag, "cudagraph_messages": cg.messages}
    note = (f"fwd+bwd {extra['fwd_bwd_ms']:.1f} ms, optim {extra['optim_ms']:.1f} ms, 1st call {first_s:.0f}s, "
            f"loss {loss_first:.4f}->{loss:.4f}")
    if syncs_step is not None:
        note += f", syncs step {syncs_step} + update {syncs_optim}"
    if diag.get("graph_breaks"):
        note += f", {diag['graph_breaks']} graph breaks"
    if diag.get("cudagraph_skips"):
        note += f", {diag['cudagraph_skips']} cudagraph skips"
    return Row("", "", ms=step_ms, tokens_per_s=s.token_budget / step_ms * 1e3, tflops=tflops, mfu=mfu, note=note,
               extra=extra)


# ---------------------------------------------------------------------------------------------- benchmarks


@benchmark("matmul", "bf16 matmul n^3 (the MFU denominator, measured in this run) and device copy bandwidth")
def bench_matmul(ctx: Context):
    s, dev = ctx.suite, ctx.device
    n = s.matmul_n
    warm, iters = (10, 100) if dev.type == "cuda" else (1, 3)

    def matmul():
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=s.dtype, generator=g)   # random, never zeros (METHOD.md)
        b = torch.randn(n, n, device=dev, dtype=s.dtype, generator=g)
        c = torch.empty(n, n, device=dev, dtype=s.dtype)
        # After 10 warm-up calls (15 ms) an H200 read 724 TFLOP/s, and 796 four minutes later (2026-12-03): a low
        # denominator inflates every MFU of the run. Whatever the cause (clocks ramping up after idle is the likely
        # one, not verified), a second of matmuls before timing keeps warm-up out of the peak.
        end = time.perf_counter() + (MATMUL_SPIN_UP_S if dev.type == "cuda" else 0.0)
        while time.perf_counter() < end:
            for _ in range(20):
                torch.matmul(a, b, out=c)
            sync(dev)
        _, ms = time_calls(lambda i: torch.matmul(a, b, out=c), dev, warm, iters)
        tflops = 2 * n ** 3 / (ms * 1e-3) / 1e12
        ctx.peak_tflops = tflops
        return Row("", "", ms=ms, tflops=tflops, mfu=1.0, note=f"peak = {tflops:.0f} TFLOP/s (MFU denominator)")

    def copy():
        numel = (2 << 30 if dev.type == "cuda" else 8 << 20) // 2     # 2 GiB of bf16 on the GPU
        src = torch.randn(numel, device=dev, dtype=torch.float32).to(torch.bfloat16)
        dst = torch.empty_like(src)
        _, ms = time_calls(lambda i: dst.copy_(src), dev, warm, iters)
        gbs = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
        return Row("", "", ms=ms, note=f"{gbs:,.0f} GB/s (read + write)", extra={"gb_per_s": gbs})

    ctx.variant("matmul", f"{s.dtype}".replace("torch.", ""), f"{n}^3", matmul)
    ctx.variant("matmul", "device copy", "2 GiB" if dev.type == "cuda" else "8 MiB", copy)


def drafter_step_row(ctx: Context, mode: str, attention: str, tag: str, reference: bool = False, suite=None,
                     architecture: str = "dflash") -> Row:
    """One drafter-step variant measured on random features: a fresh rig, its model FLOPs, measure_drafter."""
    s, dev = suite or ctx.suite, ctx.device
    batches, pairs = train_batches(ctx, suite=s)
    rig = DrafterRig(ctx, mode, attention, tag=tag, reference=reference, suite=s, architecture=architecture)
    flops = drafter_step_flops(rig.cfg, s.token_budget, s.num_anchors, pairs)
    feats = torch.randn(s.token_budget, rig.cfg.num_feature_layers * rig.cfg.hidden_size, device=dev, dtype=s.dtype)
    row = measure_drafter(ctx, rig, batches, feats, flops["train"])
    row.extra.update(flops=flops, visible_pairs=pairs, architecture=architecture,
                     params=sum(p.numel() for p in rig.params))
    return row


@benchmark("drafter", "drafter training step alone (fwd+bwd+clip+AdamW): eager, compile default / reduce-overhead, "
                      "and the straightforward reference")
def bench_drafter(ctx: Context):
    s, dev = ctx.suite, ctx.device
    flex = "flex" if dev.type == "cuda" else "sdpa"   # flex attention has no CPU backward
    shape = f"T={s.token_budget} A={s.num_anchors}x{s.block_size}"
    # name, compile mode, attention, reference?, rough cost in seconds (compile + timing) for the budget check
    variants = [("eager", "eager", flex, False, 60),
                ("reference: dense mask+SDPA, fp32 logits, eager", "eager", "sdpa", True, 30),
                ("compile default", "default", flex, False, 150),
                ("compile reduce-overhead", "reduce-overhead", flex, False, 90)]
    if flex == "flex":  # train.attention=sdpa on CUDA: no flex kernels to compile (the cold start's largest part)
        variants.append(("compile reduce-overhead, dense mask (train.attention=sdpa)", "reduce-overhead", "sdpa",
                         False, 90))
    for name, mode, attention, reference, cost in variants:
        def run(mode=mode, attention=attention, reference=reference):
            return drafter_step_row(ctx, mode, attention, f"bench_{mode.replace('-', '_')}_{int(reference)}",
                                    reference)
        ctx.variant("drafter", name, shape, run, cost_s=cost)


@benchmark("optimizer", "the update alone (clip + optimizer + schedule + zero grads) on the suite's drafter: fused "
                        "AdamW vs train.optimizer=muon (Muon for the matrices, Newton-Schulz in bf16 on CUDA)")
def bench_optimizer(ctx: Context):
    s, dev = ctx.suite, ctx.device
    cfg = drafter_config(s)
    warm, iters = (5, 50) if dev.type == "cuda" else (1, 3)
    for name in ("adamw", "muon"):
        def run(name=name):
            torch.manual_seed(0)
            with torch.device(dev):
                params = list(DFlashDrafter(cfg).parameters())
            tcfg = TrainConfig(optimizer=name, warmup_ratio=0.0)
            opt = build_optimizer(params, tcfg, dev)
            update = Updater(params, opt, build_scheduler(opt, tcfg, 10**6), 1.0, "skip", announce=False)
            grads = [torch.randn_like(p) for p in params]

            def one(i):
                for p, g in zip(params, grads):
                    p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
                update(i + 1)
            _, ms = time_calls(one, dev, warm, iters)
            matrices = sum(p.numel() for p in params if p.dim() == 2)
            return Row("", "", ms=ms, note=f"{sum(p.numel() for p in params) / 1e6:.1f} M params "
                                           f"({matrices / 1e6:.1f} M in matrices); grads copied in each call",
                       extra={"params": sum(p.numel() for p in params)})
        ctx.variant("optimizer", name, f"{cfg.num_hidden_layers} layers x {cfg.hidden_size}", run, cost_s=20)


@benchmark("dflash2", "drafter training step, DFlash v1 and DFlash 2 side by side (model.architecture), compile "
                      "reduce-overhead, at the SmolLM2-135M demo's shape on GPU (the smoke suite: its tiny shape)")
def bench_dflash2(ctx: Context):
    # Shapes from the suite the running one names (the GPU suites: gpu-smollm2's rows of 8,192 tokens, 29
    # documents, 1,024 anchors x 16); timing knobs (warmup, iters) from the running suite.
    s = ctx.suite
    if s.dflash2_shapes:
        s = dataclasses.replace(SUITES[s.dflash2_shapes], warmup=s.warmup, iters=s.iters)
    mode, flex = "reduce-overhead", "flex" if ctx.device.type == "cuda" else "sdpa"
    info = target_info(s)
    shape = (f"H={info.hidden_size} V={info.vocab_size} L={s.draft_layers} T={s.token_budget} "
             f"A={s.num_anchors}x{s.block_size}")
    for arch in ("dflash", "dflash2"):
        def run(arch=arch):
            return drafter_step_row(ctx, mode, flex, f"bench_{arch}_{mode.replace('-', '_')}", suite=s,
                                    architecture=arch)
        ctx.variant("dflash2", f"{arch} compile {mode}", shape, run, cost_s=90)


@benchmark("target", "target stage alone: feature-tap forward (TargetModel.features), eager, CUDA graph and "
                    "torch.compile, the last two as the pipeline's target worker runs them (FeatureForward)")
def bench_target(ctx: Context):
    s, dev = ctx.suite, ctx.device
    info = target_info(s)
    layers_run = max(default_layer_ids(info.num_layers, s.num_taps)) + 1

    def build():
        target = build_target(ctx)
        n = sum(p.numel() for p in target.hf.parameters())
        return Row("", "", note=f"random init in {ctx.cache['target_build_s']:.1f}s, {n / 1e9:.2f}B params, "
                                f"{layers_run} of {info.num_layers} layers run",
                   extra={"build_s": ctx.cache["target_build_s"], "params": n})

    ctx.variant("target", "build", s.target.get("name", f"L={info.num_layers} H={info.hidden_size}"), build,
                cost_s=30)

    def inputs(T):
        if "target" not in ctx.cache:
            raise Skip("the target did not build (see the build row)")
        row = packed_row(T, s.num_docs, info.vocab_size, seed=T)
        return ctx.cache["target"], row.input_ids.to(dev), row.position_ids.to(dev), row.doc_ids.to(dev), row

    def measure(fn, T, pairs, extra=None):
        first_s, ms = time_calls(fn, dev, s.warmup, s.iters)
        flops = target_forward_flops(info, layers_run, T, pairs)
        tflops, mfu = ctx.mfu(flops, ms)
        return Row("", "", ms=ms, tokens_per_s=T / ms * 1e3, tflops=tflops, mfu=mfu,
                   note=f"1st call {first_s:.1f}s", extra=dict(extra or {}, flops=flops, first_call_s=first_s))

    for T in s.target_seqs:
        def eager(T=T):
            target, ids, pos, doc, row = inputs(T)
            return measure(lambda i: target.features(ids, pos, doc), T, causal_pairs(row.doc_ids))
        ctx.variant("target", "eager (document mask)", f"T={T}", eager, cost_s=15)

    T_max = max(s.target_seqs)

    def flex():
        """model.target_attention=flex: the same document mask as a BlockMask (empty tiles skipped)."""
        target, ids, pos, doc, row = inputs(T_max)
        target.set_attention("flex")
        try:
            return measure(lambda i: target.features(ids, pos, doc), T_max, causal_pairs(row.doc_ids))
        finally:
            target.set_attention("sdpa")
    ctx.variant("target", "eager, flex BlockMask (document mask)", f"T={T_max}", flex, cost_s=40)

    def causal_only():
        """Ceiling: the same layers with HF's own causal mask (no document mask: SDPA can take its flash path)."""
        target, ids, pos, _, _ = inputs(T_max)

        @torch.no_grad()
        def fwd(i):
            target.hf.model(input_ids=ids[None], position_ids=pos[None], use_cache=False)
        return measure(fwd, T_max, T_max * T_max / 2)
    ctx.variant("target", "eager, causal only (ceiling: ignores documents)", f"T={T_max}", causal_only, cost_s=15)

    def pipeline_forward(T: int, attention: str, compile: str, graphs: bool, layers: bool = False) -> Row:
        """The target worker's own forward: FeatureForward as pipeline/target_worker.py builds it from
        model.target_attention, model.target_compile (layers: model.target_compile_layers) and model.target_graphs
        (compiled on its first call, or while it is captured, build_s; timed with the row's copies in and, under a
        graph, the features' copy out)."""
        if graphs and dev.type != "cuda":
            raise Skip("CUDA graphs need a CUDA device")
        target, ids, pos, doc, row = inputs(T)
        target.set_attention(attention)
        try:
            if compile != "eager":
                configure_cudagraphs()  # the training's compile policy (training/cudagraphs.py)
            before = compile_counters()
            t0 = time.perf_counter()
            fn = FeatureForward(target, T, compile, graphs, backend=s.compile_backend if compile != "eager" else None,
                                layers=layers)
            sync(dev)
            build_s = time.perf_counter() - t0
            r = measure(lambda i: fn(ids, pos, doc), T, causal_pairs(row.doc_ids), extra={"build_s": build_s})
        finally:
            target.set_attention("sdpa")
        if graphs:
            r.note += f", captured in {build_s:.1f}s"
        if compile != "eager":
            r.extra["compile"] = counters_delta(before, compile_counters())
            if r.extra["compile"].get("graph_breaks"):
                r.note += f", {r.extra['compile']['graph_breaks']} graph breaks"
            flex_graph = next((x for x in ctx.rows if x.bench == "target" and x.status == "ok"
                               and x.variant == flex_graph_variant and x.shape == f"T={T}"), None)
            if flex_graph is not None:  # what the compiled pipeline forward must beat to become the GPU default
                r.extra["speedup_vs_flex_graph"] = flex_graph.ms / r.ms
                r.note += f", {flex_graph.ms / r.ms:.3f}x the speed of flex + CUDA graph"
        return r

    flex_graph_variant = "CUDA graph, flex (model.target_graphs)"  # the product's fastest path before compiling
    for attention in ("sdpa", "flex"):
        ctx.variant("target", f"CUDA graph, {attention} (model.target_graphs)", f"T={T_max}",
                    lambda a=attention: pipeline_forward(T_max, a, "eager", graphs=True), cost_s=40)

    # The compiled pipeline forward (model.target_compile): the P1 candidate (flex, one CUDA graph) first.
    for label, attention, mode, graphs, cost in (
            ("compile default + CUDA graph, flex (model.target_compile)", "flex", "default", True, 120),
            ("compile default, flex (model.target_compile)", "flex", "default", False, 40),
            ("compile default + CUDA graph, sdpa (model.target_compile)", "sdpa", "default", True, 120),
            ("compile max-autotune-no-cudagraphs + CUDA graph, flex (model.target_compile)", "flex",
             "max-autotune-no-cudagraphs", True, 300)):
        ctx.variant("target", label, f"T={T_max}",
                    lambda a=attention, m=mode, g=graphs: pipeline_forward(T_max, a, m, g), cost_s=cost)
    for T in s.target_compile_seqs:  # the dense document mask compiled (model.target_attention=sdpa)
        ctx.variant("target", "torch.compile (default)", f"T={T}",
                    lambda T=T: pipeline_forward(T, "sdpa", "default", graphs=False), cost_s=100)
    # Each decoder layer compiled on its own (model.target_compile_layers): a faster cold compile (build_s), at what
    # cost in speed (no fusion across layers)? Last: it compiles the shared target's layers in place, for good.
    ctx.variant("target", "compile default each layer + CUDA graph, flex (model.target_compile_layers)", f"T={T_max}",
                lambda: pipeline_forward(T_max, "flex", "default", True, layers=True), cost_s=60)


@benchmark("colocated", "colocated baseline: one device runs the target forward then the drafter step, "
                        "sequentially (what the public trainers do)")
def bench_colocated(ctx: Context):
    s, dev = ctx.suite, ctx.device
    mode = "reduce-overhead"
    flex = "flex" if dev.type == "cuda" else "sdpa"
    info = target_info(s)
    layers_run = max(default_layer_ids(info.num_layers, s.num_taps)) + 1

    def run():
        target = build_target(ctx)
        batches, pairs = train_batches(ctx)
        rig = DrafterRig(ctx, mode, flex, tag="bench_colocated")
        d_flops = drafter_step_flops(rig.cfg, s.token_budget, s.num_anchors, pairs)["train"]
        t_flops = target_forward_flops(info, layers_run, s.token_budget, causal_pairs(batches[0].doc_ids.cpu()))

        def it(i, timer=None):
            b = batches[i % len(batches)]
            feats = target.features(b.input_ids, b.position_ids, b.doc_ids)
            if timer:
                timer.mark()
            rig.fwd_bwd(b, feats)
            rig.optim()
            if timer:
                timer.mark()

        t0 = time.perf_counter()
        it(0)
        sync(dev)
        first_s = time.perf_counter() - t0
        for i in range(s.warmup):
            it(1 + i)
        timer = Timer(dev)
        timer.mark()
        for i in range(s.iters):
            it(i, timer)
        iv = timer.intervals_ms()
        t_ms, d_ms = statistics.median(iv[0::2]), statistics.median(iv[1::2])
        ms = statistics.median(a + b for a, b in zip(iv[0::2], iv[1::2]))
        tflops, mfu = ctx.mfu(t_flops + d_flops, ms)
        return Row("", "", ms=ms, tokens_per_s=s.token_budget / ms * 1e3, tflops=tflops, mfu=mfu,
                   note=f"target {t_ms:.1f} ms + drafter {d_ms:.1f} ms ({mode}); 1st call {first_s:.0f}s",
                   extra={"target_ms": t_ms, "drafter_ms": d_ms, "first_call_s": first_s, "drafter_mode": mode,
                          "target_flops": t_flops, "drafter_flops": d_flops})

    ctx.variant("colocated", f"target eager + drafter {mode}", f"T={s.token_budget} A={s.num_anchors}x{s.block_size}",
                run, cost_s=90)
