"""End-to-end benchmarks: the threaded pipeline against its stages alone, and batched generation (regeneration).

Split from cases.py (stage benchmarks); both register into the same harness registry.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
from harness import Context, Row, Skip, benchmark, sync, time_calls

from cases import DrafterRig, build_target, measure_drafter, target_config
from dflash_train.data.packing import make_batch, pack_samples
from dflash_train.training.flops import drafter_step_flops, visible_pairs


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
