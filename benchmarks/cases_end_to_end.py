"""End-to-end benchmark: the threaded pipeline against its stages alone, on the same data.

Split from cases.py (stage benchmarks); all register into the same harness registry (cases_startup.py, the time
from the command to the first step, reuses the pipeline's configuration from here; cases_generate.py measures
batched generation).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch
from harness import Context, Row, Skip, benchmark, layout_devices, sync, time_calls

from cases import DrafterRig, build_target, causal_pairs, measure_drafter, target_config
from dflash_train.data.packing import make_batch, pack_samples
from dflash_train.models.target import FeatureForward
from dflash_train.training.cudagraphs import configure_cudagraphs
from dflash_train.training.flops import drafter_step_flops, target_forward_flops, visible_pairs

# The target worker's forward, as the GPU demo runs it (demo.GPU_OVERRIDES): these keys of its overrides.
TARGET_STAGE_KEYS = ("model.target_attention", "model.target_graphs", "model.target_compile")


def pipeline_steps(ctx: Context) -> tuple[int, int]:
    """(steps, log_every) of a pipeline row. The first log window (the pipeline filling up) is left out of the
    figures: 30 / 5 keeps 5 measured windows on GPU, --pipeline-steps N (>= 4) keeps at least 3; the CPU smoke's
    6 / 2 keeps 2."""
    n = ctx.suite.pipeline_steps
    if n is None:
        return (30, 5) if ctx.device.type == "cuda" else (6, 2)
    return n, max(1, n // 6)


def sample_len(suite) -> int:
    """Every pipeline document has token_budget / num_docs tokens, as the stage benchmarks' rows."""
    return max(2, suite.token_budget // suite.num_docs)


def drafter_stage(device_type: str) -> tuple[str, str]:
    """(train.compile, train.attention) of the pipeline's drafter: reduce-overhead and flex on CUDA; eager and sdpa
    on CPU (inductor's C++ compile would dominate there, and flex has no CPU backward)."""
    return ("reduce-overhead", "flex") if device_type == "cuda" else ("eager", "sdpa")


def target_stage_overrides(device_type: str, eager: bool = False) -> list[str]:
    """The target worker's forward: on CUDA the GPU demo's (flex attention, compiled, captured as one CUDA graph: its
    GPU_OVERRIDES, so that the benchmark follows the product); on CPU, or with `eager`, the config's defaults (eager,
    sdpa: the path before the compiled one)."""
    if device_type != "cuda" or eager:
        return []
    from dflash_train.demo import GPU_OVERRIDES

    return [o for o in GPU_OVERRIDES if o.split("=", 1)[0] in TARGET_STAGE_KEYS]


def target_stage_label(model) -> str:
    """ModelConfig -> 'compile default + CUDA graph, flex' | 'eager, sdpa' (the target benchmark's wording)."""
    how = "eager" if model.target_compile == "eager" else f"compile {model.target_compile}"
    return f"{how}{' + CUDA graph' if model.target_graphs else ''}, {model.target_attention}"


def pipeline_overrides(ctx: Context, target_dir: str, out_dir: str, targets: list[str], drafters: list[str],
                       eager_target: bool = False) -> list[str]:
    """The pipeline benchmark's `section.key=value` overrides of the config's defaults (also what cases_startup.py
    passes to `dflash-train train`): the suite's shapes, the synthetic source with documents of sample_len tokens,
    the drafter stage of drafter_stage() and the target stage of target_stage_overrides()."""
    s = ctx.suite
    steps, log_every = pipeline_steps(ctx)
    dtype = "bf16" if s.dtype == torch.bfloat16 else "fp32"
    mode, attention = drafter_stage(ctx.device.type)
    n = sample_len(s)
    return [
        f"model.target={target_dir}", f"run.out_dir={out_dir}", "run.overwrite=true",
        f"model.block_size={s.block_size}", f"model.num_feature_layers={s.num_taps}",
        f"model.num_draft_layers={s.draft_layers}", "data.source=synthetic",
        f"data.synthetic_samples={256 if ctx.device.type == 'cuda' else 64}",   # epochs repeat: enough for 1+7
        f"data.synthetic_min_len={n}", f"data.synthetic_max_len={n}", f"data.max_length={n}",
        f"train.token_budget={s.token_budget}", f"train.num_anchors={s.num_anchors}", f"train.max_steps={steps}",
        f"train.log_every={log_every}", "train.checkpoint_every=0", f"train.compile={mode}",
        f"train.attention={attention}", f"train.dtype={dtype}", f"pipeline.target_devices=[{','.join(targets)}]",
        f"pipeline.drafter_devices=[{','.join(drafters)}]", "pipeline.stall_timeout_s=300",
        *target_stage_overrides(ctx.device.type, eager_target)]


def pipeline_config(ctx: Context, target_dir: str, out_dir: str, targets: list[str], drafters: list[str],
                    eager_target: bool = False):
    from dflash_train.config import load_config

    return load_config(None, pipeline_overrides(ctx, target_dir, out_dir, targets, drafters, eager_target))


def time_target_stage(ctx: Context, target, model, batches: list) -> dict:
    """The target worker's forward alone on `batches` (on the device): FeatureForward built from `model`
    (ModelConfig: target_attention, target_compile, target_graphs) as pipeline/target_worker.py builds it, under
    the training's compile policy. -> ms per row, tokens/s, model FLOPs per row, MFU, the seconds until the first
    rows were done (compile and capture included), and those rows' features (the drafter's inputs)."""
    s, dev = ctx.suite, ctx.device
    T = s.token_budget
    target.set_attention(model.target_attention)
    try:
        if model.target_compile != "eager":
            configure_cudagraphs()  # what train_pipeline applies before anything compiles
        t0 = time.perf_counter()
        forward = FeatureForward(target, T, model.target_compile, model.target_graphs)
        feats = [forward(b.input_ids, b.position_ids, b.doc_ids) for b in batches]   # [T, k*H] each
        sync(dev)
        ready_s = time.perf_counter() - t0
        _, ms = time_calls(lambda i: forward(batches[i % len(batches)].input_ids,
                                             batches[i % len(batches)].position_ids,
                                             batches[i % len(batches)].doc_ids), dev, s.warmup, s.iters)
    finally:
        target.set_attention("sdpa")   # the cached target's default, which the other benchmarks expect
    pairs = statistics.mean(causal_pairs(b.doc_ids.cpu()) for b in batches)
    flops = target_forward_flops(target.info, max(target.layer_ids) + 1, T, pairs)
    tflops, mfu = ctx.mfu(flops, ms)
    return dict(ms=ms, tokens_per_s=T / ms * 1e3, flops=flops, tflops=tflops, mfu=mfu, ready_s=ready_s,
                label=target_stage_label(model), feats=feats)


def layout_variant(layout: str, device_type: str) -> str:
    """The row's name: 'one GPU shared', '1+3: target cuda:0, drafters cuda:1-3', '1+2: target cpu, drafters cpu x2'."""
    if layout == "shared":
        return f"one {'GPU' if device_type == 'cuda' else 'CPU'} shared"
    targets, drafters = layout_devices(layout, device_type)

    def devs(role: str, d: list[str]) -> str:
        if len(d) == 1:
            return f"{role} {d[0]}"
        return f"{role}s {d[0]}-{d[-1].split(':')[1]}" if d[0].startswith("cuda") else f"{role}s {d[0]} x{len(d)}"
    return f"{layout}: {devs('target', targets)}, {devs('drafter', drafters)}"


def default_layouts(device_type: str, visible: int) -> list[str]:
    return ["shared", "1+1"] if device_type == "cuda" and visible >= 2 else ["shared"]


@benchmark("pipeline", "threaded pipeline end to end vs its stages alone on the same data, per GPU layout (--layouts: "
                       "shared, T+D); default one GPU shared, and 1+1 when two GPUs are visible; on CUDA the target "
                       "stage is the GPU demo's compiled one (flex, compile default, one CUDA graph), and one GPU "
                       "shared runs once more with the eager target it replaced")
def bench_pipeline(ctx: Context):
    """The pipeline trains on the synthetic source with documents of token_budget / num_docs tokens (the stage
    benchmarks' rows); its stages are timed alone on rows of that same data first: the target worker's forward as
    the pipeline configures it (target_stage_overrides: on CUDA compiled, flex, one CUDA graph; also the eager sdpa
    forward before it, seconds) and the drafter step. Each layout's pipeline gets the in-memory targets this run
    built, one per target device, equal weights (`load_training_target` is swapped for the duration; the swap applies
    the attention the pipeline asks for, and the target workers compile and capture these targets exactly as a loaded
    one, in TargetWorker.setup): at the Qwen3-8B shape a save + load would cost minutes and measure the disk, not the
    pipeline. On the GPU suites bench.py keeps inductor's cache in one directory for the whole process, so the
    pipeline's compiles of the graphs the stages-alone row compiled are cache hits (dynamo traces and CUDA graphs are
    captured again): the cold compile is the stages-alone row's."""
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
    from dflash_train.devices import choose

    mode, attention = drafter_stage(dev.type)
    visible = torch.cuda.device_count() if dev.type == "cuda" else 0
    work = Path(tempfile.mkdtemp(prefix="dflash_bench_pipeline_"))
    shape = f"T={s.token_budget} A={s.num_anchors}x{s.block_size} docs {sample_len(s)} tok"
    alone: dict = {}
    data: dict = {}
    home = "cuda:0" if dev.type == "cuda" else "cpu"

    def target_dir() -> str:
        path = work / "target_config"
        if not (path / "config.json").is_file():
            target_config(s).save_pretrained(path)   # sizes only: the weights come from build_target
        return str(path)

    def data_rows(cfg) -> list:
        from dflash_train.data.dataset import load_dataset

        return pack_samples(load_dataset(cfg.data, None, seed=cfg.train.seed).train, s.token_budget)

    def docs_per_row(cfg) -> float:   # the same data for every layout: counted once
        if "docs_per_row" not in data:
            data["docs_per_row"] = statistics.mean(len(set(r.doc_ids.tolist()) - {-1}) for r in data_rows(cfg))
        return data["docs_per_row"]

    def stages_alone():
        target = build_target(ctx)
        cfg = pipeline_config(ctx, target_dir(), str(work / "alone"), [home], [home])
        rows = data_rows(cfg)[:4]
        batches = [make_batch(r, s.num_anchors, seed=0, index=i).to(dev) for i, r in enumerate(rows)]
        t = time_target_stage(ctx, target, cfg.model, batches)
        feats = t.pop("feats")   # the drafter trains on the pipeline's own target stage's features
        before = None
        if dev.type == "cuda":   # the eager sdpa forward the compiled one replaced, on the same rows: seconds
            eager_cfg = pipeline_config(ctx, target_dir(), str(work / "alone"), [home], [home], eager_target=True)
            before = time_target_stage(ctx, target, eager_cfg.model, batches)
            del before["feats"]
        rig = DrafterRig(ctx, mode, attention, tag="bench_pipeline_alone")
        pairs = statistics.mean(visible_pairs(b.anchors, b.doc_ids, s.block_size) for b in batches)
        flops = drafter_step_flops(rig.cfg, s.token_budget, s.num_anchors, pairs)["train"]
        d = measure_drafter(ctx, _FeatsByBatch(rig, batches, feats), batches, None, flops)
        alone.update(target_tok_s=t["tokens_per_s"], target_ms=t["ms"], target_mfu=t["mfu"], target_flops=t["flops"],
                     target_stage=t["label"], target_ready_s=t["ready_s"], drafter_tok_s=d.tokens_per_s,
                     drafter_ms=d.ms, drafter_flops=flops)
        # One device runs both stages in turn: the sequential bound is their times alone added up.
        alone["sequential_tok_s"] = 1.0 / (1.0 / alone["target_tok_s"] + 1.0 / alone["drafter_tok_s"])
        was = ""
        if before:
            alone.update(target_eager_tok_s=before["tokens_per_s"], target_eager_ms=before["ms"],
                         target_eager_mfu=before["mfu"], target_eager_stage=before["label"])
            was = (f" ({before['label']}: {before['ms']:.1f} ms, MFU {_num(before['mfu'])}, "
                   f"{before['ms'] / t['ms']:.2f}x as long)")
        slow = min(alone["target_tok_s"], alone["drafter_tok_s"])
        return Row("", "", ms=max(t["ms"], d.ms), tokens_per_s=slow,
                   note=f"target {alone['target_tok_s']:,.0f} tok/s ({t['ms']:.1f} ms, MFU {_num(t['mfu'])}, first "
                        f"rows after {t['ready_s']:.0f}s){was}, drafter {mode} {alone['drafter_tok_s']:,.0f} tok/s "
                        f"({d.ms:.1f} ms); back to back {alone['sequential_tok_s']:,.0f} tok/s; tok/s = the slower",
                   extra=dict(alone, drafter=d.extra))

    def pipeline(layout: str, eager_target: bool = False, steps_per_row: int = 1):
        def run():
            targets, drafters = layout_devices(layout, dev.type, visible)
            run_dir = work / f"run_{layout.replace('+', '_')}{'_eager_target' if eager_target else ''}_{steps_per_row}"
            cfg = pipeline_config(ctx, target_dir(), str(run_dir), targets, drafters, eager_target)
            if steps_per_row > 1:   # train.steps_per_row: one target forward for that many drafter steps
                cfg.train.steps_per_row = steps_per_row
            per_row = docs_per_row(cfg)
            devices = sorted({torch.device(d) for d in targets + drafters}, key=str)
            cuda = [d for d in devices if d.type == "cuda"]
            built: list = []   # one target per target device; the first is the cached one on cuda:0 (or cpu)
            free: list = []    # handed out once each by the swapped load_training_target, to the device asked for
            original = coordinator.load_training_target

            def built_target(run_cfg, layer_ids, device):
                if list(layer_ids) != built[0].layer_ids:
                    raise Skip(f"pipeline drafter taps {list(layer_ids)} != the built target's {built[0].layer_ids}")
                if run_cfg.train.kd_weight > 0 or run_cfg.train.anchor_sampling == "decoding":
                    raise Skip("train.kd_weight > 0 and train.anchor_sampling=decoding need the target's last layers; "
                               "the built target is truncated after its deepest tap")
                attention = run_cfg.model.target_attention
                want = torch.device(device)
                for i, t in enumerate(free):
                    if t.device == want:
                        t = free.pop(i)
                        t.set_attention(choose("attention", attention, [want]))   # what the run would load
                        return t
                raise RuntimeError(f"the pipeline asked for a target on {want}; this layout built them on "
                                   f"{[str(t.device) for t in built]}")

            try:
                built.append(build_target(ctx))
                built += [build_target(ctx, d) for d in targets[1:]]
                free += built
                for d in cuda:   # after the targets: their weights are part of each device's peak, as in training
                    torch.cuda.reset_peak_memory_stats(d)
                coordinator.load_training_target = built_target
                t0 = time.perf_counter()
                res = coordinator.train_pipeline(cfg)
                wall = time.perf_counter() - t0
            finally:
                coordinator.load_training_target = original
                for t in built:
                    t.set_attention("sdpa")   # the cached target's default, which the other benchmarks expect
                built.clear()   # the replicas on other GPUs go with the pipeline; harness.free_memory empties caches
                free.clear()
                shutil.rmtree(run_dir, ignore_errors=True)   # its checkpoint and drafters: ~17 GB at Qwen3-8B's shape
            late = [h for h in res.history if h["step"] > cfg.train.log_every] or res.history

            def mean(k):
                vals = [h[k] for h in late if h.get(k) is not None]
                return statistics.mean(vals) if vals else None

            tok_s = mean("tokens_per_s")   # all replicas together: T tokens x drafter replicas per step
            samples_s = tok_s / s.token_budget * per_row / steps_per_row   # each sample once, however many steps
            peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in cuda}
            frac = {k: mean(k) for k in ("target_busy", "drafter_busy", "drafter_wait", "target_wait")}
            extra = dict(frac, layout=layout, target_devices=targets, drafter_devices=drafters,
                         target_stage=target_stage_label(cfg.model), eager_target=eager_target,
                         samples_per_s=samples_s, rows_per_s=tok_s / s.token_budget / steps_per_row,
                         sample_len=sample_len(s),
                         docs_per_row=per_row, measured_windows=len(late), peak_gib_per_device=peaks,
                         wall_s=wall, steps=res.steps, log_every=cfg.train.log_every,
                         busy_by_worker=res.stage_fractions.get("busy_by_worker", {}),
                         run_fractions=res.stage_fractions, loss_first=res.history[0]["loss"],
                         loss_last=res.history[-1]["loss"], steps_per_row=steps_per_row)
            versus, tflops, mfu = "", None, None
            target_tok_s = alone.get("target_eager_tok_s" if eager_target else "target_tok_s")
            if alone and target_tok_s:   # against the stages alone with this row's own target forward
                drafter_tok_s = alone["drafter_tok_s"]
                extra["vs_slowest_stage"] = tok_s / min(target_tok_s, drafter_tok_s)
                versus = f"{extra['vs_slowest_stage']:.2f} x slowest stage"
                if layout == "shared":   # one GPU runs both stages: their times alone add up (the sequential bound)
                    # (a step's share of the target's forward: 1 / steps_per_row of it)
                    extra["vs_sequential"] = tok_s * (1.0 / (steps_per_row * target_tok_s) + 1.0 / drafter_tok_s)
                    versus += f", {extra['vs_sequential']:.3f} x the stages back to back"
                else:   # T targets and D drafters each at their rate alone; the slower side caps
                    ideal = min(len(targets) * target_tok_s, len(drafters) * drafter_tok_s)
                    extra["vs_ideal"] = tok_s / ideal
                    versus = f"{extra['vs_ideal']:.2f} x min(T x target, D x drafter) alone"
                # model FLOPs: every step makes one drafter step and 1 / steps_per_row of a target forward
                step_flops = alone["target_flops"] / steps_per_row + alone["drafter_flops"]
                tflops = tok_s / s.token_budget * step_flops / 1e12
                mfu = tflops / (ctx.peak_tflops * len(devices)) if ctx.peak_tflops else None
            peak_txt = (f"; peak {min(peaks.values()):.1f}-{max(peaks.values()):.1f} GiB/device" if len(peaks) > 1
                        else "")
            note = (f"{samples_s:,.2f} samples/s of {sample_len(s)} tok ({per_row:g}/row); busy target "
                    f"{_pct(frac['target_busy'])} drafter {_pct(frac['drafter_busy'])}; wait drafter "
                    f"{_pct(frac['drafter_wait'])} target {_pct(frac['target_wait'])}; {versus or 'no baseline'}"
                    f"{peak_txt}")
            return Row("", "", ms=s.token_budget / tok_s * 1e3, tokens_per_s=tok_s, tflops=tflops, mfu=mfu,
                       peak_gib=max(peaks.values()) if peaks else None, note=note, extra=extra)
        return run

    # Costs for the time budget (seconds, a cold inductor cache on one H200): the stages alone compile the drafter
    # step (~200 s) and the target forward (~50 s); a pipeline then loads both from the cache, traces and captures
    # (~20 s per target, ~40 s per drafter replica, one at a time), trains and writes its checkpoint (~60 s).
    label = target_stage_label(pipeline_config(ctx, target_dir(), str(work / "alone"), [home], [home]).model)
    layouts = s.layouts or default_layouts(dev.type, visible)
    try:
        ctx.variant("pipeline", f"stages alone, same data (target {label}, drafter {mode})", shape, stages_alone,
                    cost_s=270 if dev.type == "cuda" else 90)
        for layout in layouts:
            targets, drafters = layout_devices(layout, dev.type)
            if dev.type == "cuda" and len(set(targets + drafters)) > visible:
                ctx.variant("pipeline", layout_variant(layout, dev.type), shape, pipeline(layout))  # a skipped row
                continue
            ctx.variant("pipeline", layout_variant(layout, dev.type), shape, pipeline(layout),
                        cost_s=60 + 40 * len(drafters) + 20 * len(targets))
        if "shared" in layouts:   # the target's forward spread over two drafter steps (train.steps_per_row=2)
            ctx.variant("pipeline", f"{layout_variant('shared', dev.type)}, train.steps_per_row=2", shape,
                        pipeline("shared", steps_per_row=2), cost_s=100 if dev.type == "cuda" else 30)
        if dev.type == "cuda" and "shared" in layouts:   # the path before, in the same run: last, if time is left
            eager = target_stage_label(pipeline_config(ctx, target_dir(), str(work / "alone"), [home], [home],
                                                       eager_target=True).model)
            ctx.variant("pipeline", f"{layout_variant('shared', dev.type)}, target {eager} (before)", shape,
                        pipeline("shared", eager_target=True), cost_s=100)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    annotate_scaling(ctx.rows)


def annotate_scaling(rows: list[Row]) -> None:
    """Scaling efficiency of 1 target + N drafters against 1+1 in the same run: tokens/s(1+N) / (N x tokens/s(1+1)),
    into the 1+N rows' extra and note."""
    ok = {r.extra["layout"]: r for r in rows if r.bench == "pipeline" and r.status == "ok" and "layout" in r.extra
          and not r.extra.get("eager_target") and r.extra.get("steps_per_row", 1) == 1}
    base = ok.get("1+1")
    if base is None:
        return
    for layout, r in ok.items():
        t, _, n = layout.partition("+")
        if t == "1" and n.isdigit() and int(n) > 1:
            r.extra["scaling_efficiency"] = r.tokens_per_s / (int(n) * base.tokens_per_s)
            r.note = f"scaling {r.extra['scaling_efficiency']:.2f} vs 1+1; {r.note}"


class _FeatsByBatch:
    """A DrafterRig view that trains each batch on its own target features (measure_drafter passes feats=None)."""

    def __init__(self, rig: DrafterRig, batches: list, feats: list):
        self.rig, self.feats = rig, {id(b): f for b, f in zip(batches, feats)}
        self.suite = rig.suite

    def fwd_bwd(self, batch, _feats):
        return self.rig.fwd_bwd(batch, self.feats[id(batch)])

    def optim(self):
        self.rig.optim()


def _pct(x) -> str:
    return "?" if x is None else f"{x:.0%}"


def _num(x) -> str:
    return "?" if x is None else f"{x:.3f}"
