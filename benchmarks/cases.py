"""The benchmarks: matmul peak, target stage, drafter step, colocated baseline, pipeline (once pipeline/ exists).

FLOP counts come from dflash_train.training.flops (its docstring is the formula); MFU divides achieved model
FLOP/s by the bf16 matmul rate measured first in the same run.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import (Context, CudagraphSkipLog, Row, Skip, Timer, benchmark, compile_counters, count_host_syncs,
                     counters_delta, sync, time_calls)

from dflash_train.config import TrainConfig
from dflash_train.data.packing import Sample, make_batch, pack_samples
from dflash_train.models.drafter import DFlashDrafter, build_drafter_config
from dflash_train.models.target import TargetInfo, TargetModel, default_layer_ids
from dflash_train.training.flops import drafter_step_flops, target_forward_flops, visible_pairs
from dflash_train.training.objective import block_layout, default_gamma, dense_block_mask, position_weights, sdpa_attend
from dflash_train.training.optim import build_optimizer
from dflash_train.training.step import DrafterStep

# ------------------------------------------------------------------------------------------- shared pieces


def target_config(suite):
    from transformers import Qwen3Config

    return Qwen3Config(**suite.target, attn_implementation="sdpa")


def target_info(suite) -> TargetInfo:
    return TargetInfo.from_config(target_config(suite))


def drafter_config(suite):
    info = target_info(suite)
    ids = default_layer_ids(info.num_layers, suite.num_taps)
    return build_drafter_config(info, ids, mask_token_id=info.vocab_size - 1, block_size=suite.block_size,
                                num_draft_layers=suite.draft_layers)


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


def build_target(ctx: Context) -> TargetModel:
    """Random-init Qwen3 of the suite's shape, built on the device in the compute dtype (the init runs there:
    seconds for 8B parameters), wrapped as the feature tap; cached for later benchmarks."""
    if "target" in ctx.cache:
        return ctx.cache["target"]
    from transformers import Qwen3ForCausalLM

    s, cfg = ctx.suite, target_config(ctx.suite)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)
    try:
        torch.manual_seed(0)
        with torch.device(ctx.device):
            hf = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    info = TargetInfo.from_config(cfg)
    target = TargetModel(hf.eval(), default_layer_ids(info.num_layers, s.num_taps), truncate=True)
    sync(ctx.device)
    ctx.cache["target"] = target
    ctx.cache["target_build_s"] = time.perf_counter() - t0
    return target


def train_batches(ctx: Context, n: int = 4):
    """n TrainBatches of one packed row with different anchors (on the device), and their mean visible pairs."""
    s = ctx.suite
    row = packed_row(s.token_budget, s.num_docs, s.target["vocab_size"])
    batches = [make_batch(row, s.num_anchors, seed=0, index=i) for i in range(n)]
    pairs = statistics.mean(visible_pairs(b.anchors, b.doc_ids, s.block_size) for b in batches)
    return [b.to(ctx.device) for b in batches], pairs


class DrafterRig:
    """A fresh drafter (fp32 master weights), its optimizer and a step function, as the trainer drives them."""

    def __init__(self, ctx: Context, compile_mode: str, attention: str, tag: str, reference: bool = False):
        s, dev = ctx.suite, ctx.device
        self.cfg = drafter_config(s)
        H, V = self.cfg.hidden_size, self.cfg.vocab_size
        torch.manual_seed(0)
        with torch.device(dev):
            self.drafter = DFlashDrafter(self.cfg).train()
            self.embed_w = (torch.randn(V, H) * 0.02).to(s.dtype)
            self.head_w = (torch.randn(V, H) * 0.02).to(s.dtype)
        self.tcfg = TrainConfig(token_budget=s.token_budget, num_anchors=s.num_anchors, compile=compile_mode,
                                attention=attention, dtype="bf16" if s.dtype == torch.bfloat16 else "fp32")
        backend = s.compile_backend if compile_mode != "eager" else None
        self.step = DrafterStep(self.drafter, self.embed_w, self.head_w, self.tcfg, dev, tag=tag, backend=backend)
        self.reference = reference
        self.params = list(self.drafter.parameters())
        self.opt = build_optimizer(self.params, self.tcfg, dev)

    def fwd_bwd(self, batch, feats):
        if self.reference:
            return reference_step(self, batch, feats)
        return self.step(batch, feats)

    def optim(self):
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)   # persistent .grad buffers (see DrafterStep)


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
    s, dev = ctx.suite, ctx.device
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
        note += f", syncs {syncs_step}"
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
    warm, iters = (10, 50) if dev.type == "cuda" else (1, 3)

    def matmul():
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=s.dtype, generator=g)   # random, never zeros (METHOD.md)
        b = torch.randn(n, n, device=dev, dtype=s.dtype, generator=g)
        c = torch.empty(n, n, device=dev, dtype=s.dtype)
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
    for name, mode, attention, reference, cost in variants:
        def run(mode=mode, attention=attention, reference=reference, name=name):
            batches, pairs = train_batches(ctx)
            rig = DrafterRig(ctx, mode, attention, tag=f"bench_{mode.replace('-', '_')}_{int(reference)}",
                             reference=reference)
            flops = drafter_step_flops(rig.cfg, s.token_budget, s.num_anchors, pairs)
            feats = torch.randn(s.token_budget, rig.cfg.num_feature_layers * rig.cfg.hidden_size, device=dev,
                                dtype=s.dtype)
            row = measure_drafter(ctx, rig, batches, feats, flops["train"])
            row.extra["flops"] = flops
            row.extra["visible_pairs"] = pairs
            return row
        ctx.variant("drafter", name, shape, run, cost_s=cost)


@benchmark("target", "target stage alone: feature-tap forward (TargetModel.features), eager and torch.compile")
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

    for T in s.target_compile_seqs:
        def compiled(T=T):
            target, ids, pos, doc, row = inputs(T)
            if "target_compiled" not in ctx.cache:
                kw = {"backend": s.compile_backend} if s.compile_backend else {}
                ctx.cache["target_compiled"] = torch.compile(target.features, dynamic=False, **kw)
            fn = ctx.cache["target_compiled"]
            before = compile_counters()
            r = measure(lambda i: fn(ids, pos, doc), T, causal_pairs(row.doc_ids))
            r.extra["compile"] = counters_delta(before, compile_counters())
            if r.extra["compile"].get("graph_breaks"):
                r.note += f", {r.extra['compile']['graph_breaks']} graph breaks"
            return r
        ctx.variant("target", "torch.compile (default)", f"T={T}", compiled, cost_s=100)


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


def pipeline_config(ctx: Context, target_dir: str, out_dir: str, drafters: list[str], mode: str, attention: str):
    from dflash_train.config import load_config

    s = ctx.suite
    steps, log_every = (30, 5) if ctx.device.type == "cuda" else (6, 2)
    dtype = "bf16" if s.dtype == torch.bfloat16 else "fp32"
    target_dev = "cuda:0" if ctx.device.type == "cuda" else "cpu"
    return load_config(None, [
        f"model.target={target_dir}", f"run.out_dir={out_dir}", "run.overwrite=true",
        f"model.block_size={s.block_size}", f"model.num_feature_layers={s.num_taps}",
        f"model.num_draft_layers={s.draft_layers}", "data.source=synthetic",
        f"data.synthetic_samples={2000 if ctx.device.type == 'cuda' else 64}",
        f"train.token_budget={s.token_budget}", f"train.num_anchors={s.num_anchors}", f"train.max_steps={steps}",
        f"train.log_every={log_every}", "train.checkpoint_every=0", f"train.compile={mode}",
        f"train.attention={attention}", f"train.dtype={dtype}", f"pipeline.target_devices=[{target_dev}]",
        f"pipeline.drafter_devices=[{','.join(drafters)}]", "pipeline.stall_timeout_s=300"])


@benchmark("pipeline", "threaded pipeline end to end vs its slowest stage alone on the same data: one GPU shared, "
                       "and target cuda:0 / drafter cuda:1 when two GPUs are visible")
def bench_pipeline(ctx: Context):
    """The pipeline trains on the synthetic source (short documents); its stages are timed alone on rows of that
    same data first. The pipeline gets the in-memory target this run built (`load_target` is swapped for the
    duration): at the Qwen3-8B shape a save + load would cost minutes and measure the disk, not the pipeline."""
    import tempfile

    s, dev = ctx.suite, ctx.device
    try:
        import dflash_train.pipeline.coordinator as coordinator
    except ImportError as e:
        reason = f"needs pipeline/: dflash_train.pipeline.coordinator is not importable ({e})"

        def missing():
            raise Skip(reason)
        ctx.variant("pipeline", "loader -> target -> drafter threads", "", missing)
        return
    mode = "reduce-overhead" if dev.type == "cuda" else "eager"   # CPU: inductor's C++ compile would dominate
    attention = "flex" if dev.type == "cuda" else "sdpa"
    work = Path(tempfile.mkdtemp(prefix="dflash_bench_pipeline_"))
    shape = f"T={s.token_budget} A={s.num_anchors}x{s.block_size}"
    alone: dict = {}

    def target_dir() -> str:
        path = work / "target_config"
        if not (path / "config.json").is_file():
            target_config(s).save_pretrained(path)   # sizes only: the weights come from build_target
        return str(path)

    def stages_alone():
        from dflash_train.data.dataset import load_dataset

        target = build_target(ctx)
        cfg = pipeline_config(ctx, target_dir(), str(work / "alone"), [str(dev)], mode, attention)
        rows = pack_samples(load_dataset(cfg.data, None, seed=cfg.train.seed).train, s.token_budget)[:4]
        batches = [make_batch(r, s.num_anchors, seed=0, index=i).to(dev) for i, r in enumerate(rows)]
        feats = [target.features(b.input_ids, b.position_ids, b.doc_ids) for b in batches]
        _, t_ms = time_calls(lambda i: target.features(batches[i % len(batches)].input_ids,
                                                       batches[i % len(batches)].position_ids,
                                                       batches[i % len(batches)].doc_ids), dev, s.warmup, s.iters)
        rig = DrafterRig(ctx, mode, attention, tag="bench_pipeline_alone")
        pairs = statistics.mean(visible_pairs(b.anchors, b.doc_ids, s.block_size) for b in batches)
        flops = drafter_step_flops(rig.cfg, s.token_budget, s.num_anchors, pairs)["train"]
        d = measure_drafter(ctx, _FeatsByBatch(rig, batches, feats), batches, None, flops)
        alone.update(target_tok_s=s.token_budget / t_ms * 1e3, drafter_tok_s=d.tokens_per_s, target_ms=t_ms,
                     drafter_ms=d.ms)
        slow = min(alone["target_tok_s"], alone["drafter_tok_s"])
        return Row("", "", ms=max(t_ms, d.ms), tokens_per_s=slow,
                   note=f"target {alone['target_tok_s']:,.0f} tok/s ({t_ms:.1f} ms), drafter {mode} "
                        f"{alone['drafter_tok_s']:,.0f} tok/s ({d.ms:.1f} ms); tok/s = the slower",
                   extra=dict(alone, drafter=d.extra))

    def pipeline(drafters: list[str]):
        def run():
            if not alone:
                raise Skip("the stages-alone row failed; no baseline to compare with")
            target = build_target(ctx)
            cfg = pipeline_config(ctx, target_dir(), str(work / ("run_" + "_".join(drafters).replace(":", ""))),
                                  drafters, mode, attention)
            devices = sorted({dev} | {torch.device(d) for d in drafters}, key=str)
            for d in devices:
                if d.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(d)

            def same_target(_path, layer_ids=None, device="cpu", **_kw):
                if layer_ids is not None and list(layer_ids) != target.layer_ids:
                    raise Skip(f"pipeline drafter taps {list(layer_ids)} != the built target's {target.layer_ids}")
                if torch.device(device) != target.device:
                    raise Skip(f"the built target lives on {target.device}, the pipeline asks for {device}")
                return target

            original = coordinator.load_target
            coordinator.load_target = same_target
            try:
                t0 = time.perf_counter()
                res = coordinator.train_pipeline(cfg)
                wall = time.perf_counter() - t0
            finally:
                coordinator.load_target = original
            late = [h for h in res.history if h["step"] > cfg.train.log_every] or res.history

            def mean(k):
                vals = [h[k] for h in late if k in h]
                return statistics.mean(vals) if vals else None

            tok_s = mean("tokens_per_s")
            slow = min(alone["target_tok_s"], alone["drafter_tok_s"])
            peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in devices if d.type == "cuda"}
            frac = {k: mean(k) for k in ("drafter_wait", "target_wait", "drafter_busy", "target_busy")}
            note = (f"{tok_s / slow:.3f} x slowest stage alone; waits: drafter {_pct(frac['drafter_wait'])}, "
                    f"target {_pct(frac['target_wait'])}; peak GiB " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                                 peaks.items()))
            return Row("", "", ms=s.token_budget / tok_s * 1e3, tokens_per_s=tok_s,
                       peak_gib=max(peaks.values()) if peaks else None, note=note,
                       extra=dict(frac, vs_slowest_stage=tok_s / slow, peak_gib_per_device=peaks, wall_s=wall,
                                  steps=res.steps, run_fractions=getattr(res, "stage_fractions", {}),
                                  loss_first=res.history[0]["loss"], loss_last=res.history[-1]["loss"]))
        return run

    ctx.variant("pipeline", f"stages alone, same data (target eager, drafter {mode})", shape, stages_alone, cost_s=90)
    ctx.variant("pipeline", "one GPU shared" if dev.type == "cuda" else "one CPU shared", shape,
                pipeline([str(dev)]), cost_s=150)
    if dev.type == "cuda" and torch.cuda.device_count() >= 2:
        ctx.variant("pipeline", "target cuda:0, drafter cuda:1", shape, pipeline(["cuda:1"]), cost_s=150)


@benchmark("generate", "batched greedy generation (dataset regeneration): batches in arrival order over whole caches "
                       "(before) vs windowed attention vs length-sorted pools + windowed attention (regenerate now)")
def bench_generate(ctx: Context):
    """`dflash-train regenerate`'s decoding on random-init weights of the suite's generation shape (SmolLM2-135M on
    the GPU) and log-normal prompt lengths (a long tail, like chat prompts). Every variant generates new_tokens for
    every prompt (no stop tokens: random weights rarely stop) and pays its own cache allocations and graph
    captures, as a regeneration run does. ms = one batch on average; tok/s = generated tokens per second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.data.regenerate import LOOKAHEAD_BATCHES, cache_slots
    from dflash_train.inference.baseline import BatchGenerator

    s, dev, g = ctx.suite, ctx.device, ctx.suite.generate
    if not g:
        raise Skip("this suite has no generation shape")
    b, n, new, max_len = g["batch"], g["prompts"], g["new_tokens"], g["max_length"]
    rng = torch.Generator().manual_seed(0)
    lens = (torch.randn(n, generator=rng) + math.log(g["median_prompt"])).exp().round().long()
    lens = lens.clamp(2, max_len - new).tolist()
    prompts = [torch.randint(1, g["target"]["vocab_size"], (k,), generator=rng).tolist() for k in lens]

    def model():
        if "generate_hf" not in ctx.cache:
            default = torch.get_default_dtype()
            torch.set_default_dtype(s.dtype)
            try:
                torch.manual_seed(0)
                with torch.device(dev):
                    ctx.cache["generate_hf"] = LlamaForCausalLM(LlamaConfig(**g["target"], attn_implementation="sdpa"))
            finally:
                torch.set_default_dtype(default)
        return ctx.cache["generate_hf"].eval()

    def slots_for(need: int) -> int:
        return cache_slots(need, max_len)

    def arrival() -> list[list[int]]:
        return [list(range(i, min(i + b, n))) for i in range(0, n, b)]

    def sorted_pools() -> list[list[int]]:  # regenerate's pools: LOOKAHEAD_BATCHES batches sorted by length, cut
        out, pool = [], b * LOOKAHEAD_BATCHES
        for i in range(0, n, pool):
            idx = sorted(range(i, min(i + pool, n)), key=lambda j: lens[j])
            out += [idx[k:k + b] for k in range(0, len(idx), b)]
        return out

    def measure(batches: list[list[int]], windowed: bool):
        def run():
            hf, gens, outs, slots = model(), {}, {}, 0
            sync(dev)
            t0 = time.perf_counter()
            for idx in batches:
                batch = [prompts[j] for j in idx]
                need = max(map(len, batch)) + new
                if windowed:  # one cache, replaced by a larger one only when a batch does not fit (regenerate now)
                    if "one" not in gens or gens["one"].runner.max_len < need:
                        gens.clear()
                        gens["one"] = BatchGenerator(hf, b, slots_for(need))
                    gen = gens["one"]
                else:  # one cache per size, attention over all of it every step (before)
                    key = slots_for(need)
                    if key not in gens:
                        gens[key] = BatchGenerator(hf, b, key, kv_window=None)
                    gen = gens[key]
                slots += b * max(map(len, batch))
                outs.update(zip(idx, gen.generate(batch, new)))
            sync(dev)
            wall = time.perf_counter() - t0
            ref = ctx.cache.setdefault("generate_ref", outs)
            same = sum(outs[j] == ref[j] for j in range(n)) / n
            return Row("", "", ms=wall / len(batches) * 1e3, tokens_per_s=n * new / wall,
                       note=f"{n / wall:,.1f} prompts/s; prefill padding {1 - sum(lens) / slots:.0%}; "
                            f"{same:.0%} outputs equal the first variant's",
                       extra={"wall_s": wall, "prompts_per_s": n / wall, "batches": len(batches),
                              "prefill_padding": 1 - sum(lens) / slots, "same_as_first": same})
        return run

    shape = f"{n} prompts b={b} +{new}"
    ctx.variant("generate", "arrival order, whole cache (before)", shape, measure(arrival(), False), cost_s=120)
    ctx.variant("generate", "arrival order, windowed attention", shape, measure(arrival(), True), cost_s=60)
    ctx.variant("generate", "length-sorted pools, windowed attention (regenerate now)", shape,
                measure(sorted_pools(), True), cost_s=60)


class _FeatsByBatch:
    """A DrafterRig view that trains each batch on its own target features (measure_drafter passes feats=None)."""

    def __init__(self, rig: DrafterRig, batches: list, feats: list):
        self.rig, self.feats = rig, {id(b): f for b, f in zip(batches, feats)}

    def fwd_bwd(self, batch, _feats):
        return self.rig.fwd_bwd(batch, self.feats[id(batch)])

    def optim(self):
        self.rig.optim()


def _pct(x) -> str:
    return "?" if x is None else f"{x:.0%}"
