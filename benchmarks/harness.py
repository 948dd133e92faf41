"""Benchmark harness: suites (shapes per machine), the registry, per-variant isolation, timing and memory helpers.

A benchmark is a function `fn(ctx: Context) -> None` registered with `@benchmark(name, help)`; it measures one or
more variants through `ctx.variant(...)`, which times-boxes, catches and records failures, so one broken variant
never stops the run. Rows land in `ctx.rows`; bench.py prints them as the final table.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Suite:
    """Shapes and timing knobs of one benchmark suite."""
    name: str
    device: str
    dtype: torch.dtype
    matmul_n: int
    target: dict               # transformers Qwen3Config kwargs
    num_taps: int              # k tapped target layers (default_layer_ids(L, k))
    draft_layers: int
    block_size: int
    token_budget: int          # T: context tokens per packed row (drafter step and colocated)
    num_anchors: int           # A
    target_seqs: list[int]     # target stage, eager
    target_compile_seqs: list[int]
    num_docs: int = 1          # documents per packed row (1 = the attention-heaviest case, as the reference run)
    warmup: int = 3
    iters: int = 10
    compile_backend: str | None = None   # None = inductor; 'aot_eager' traces without code generation (CPU smoke)
    budget_s: float = math.inf           # skip variants that would start past this many seconds into the run
    cpu_threads: int | None = None       # torch intra-op threads (tiny CPU shapes: 1, robust on a busy machine)
    generate: dict | None = None         # batched generation: target (LlamaConfig kwargs), batch, prompts,
                                         # new_tokens, max_length, median_prompt (tokens; log-normal lengths);
                                         # the row of record: record_waves x the batch, record_new_tokens each
    layouts: list[str] | None = None     # pipeline: 'shared' | 'T+D' (parse_layouts); None = shared (+ 1+1 on 2 GPUs)
    pipeline_steps: int | None = None    # pipeline: training steps per layout; None = 30 on GPU, 6 on CPU
    dflash2_shapes: str | None = None    # dflash2 benchmark: the suite whose shapes it measures (None = this one)


QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)

SUITES = {
    "gpu": Suite("gpu", "cuda", torch.bfloat16, matmul_n=8192, target=QWEN3_8B, num_taps=5, draft_layers=5,
                 block_size=16, token_budget=4096, num_anchors=512, target_seqs=[2048, 4096],
                 target_compile_seqs=[4096, 2048], warmup=3, iters=10, budget_s=450.0,
                 generate=dict(target=SMOLLM2_135M, batch=256, prompts=512, new_tokens=128, max_length=2048,
                               median_prompt=80, record_waves=4, record_new_tokens=256),
                 dflash2_shapes="gpu-smollm2"),
    "cpu-smoke": Suite("cpu-smoke", "cpu", torch.float32, matmul_n=256, target=TINY, num_taps=3, draft_layers=2,
                       block_size=4, token_budget=64, num_anchors=8, target_seqs=[32, 64], target_compile_seqs=[64],
                       num_docs=2, warmup=1, iters=2, compile_backend="aot_eager", cpu_threads=1,
                       generate=dict(target=dict(TINY, vocab_size=256), batch=4, prompts=16, new_tokens=8,
                                     max_length=256, median_prompt=12, record_waves=2, record_new_tokens=16)),
}
# `--suite gpu-smollm2`: the demo's GPU recipe (smollm2_gpu.yaml) at SmolLM2-135M's shape, random init (a Qwen3 config
# of SmolLM2's sizes: same matmuls and attention; real weights do not change the speed): rows of 8,192 tokens
# holding 29 documents of ~282 tokens (the regenerated ShareGPT data's average), 1,024 anchors x 16, and the demo's
# 8 drafter layers (5 before 2026-12-04).
SUITES["gpu-smollm2"] = dataclasses.replace(
    SUITES["gpu"], name="gpu-smollm2", target=SMOLLM2_135M, token_budget=8192, num_anchors=1024, num_docs=29,
    draft_layers=8, target_seqs=[8192], target_compile_seqs=[8192])
# `--suite cpu-generate --only generate`: batched generation at a shape where the KV cache, not Python, dominates.
SUITES["cpu-generate"] = dataclasses.replace(
    SUITES["cpu-smoke"], name="cpu-generate", cpu_threads=1,
    generate=dict(target=dict(TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64,
                              vocab_size=2048, max_position_embeddings=2048),
                  batch=16, prompts=128, new_tokens=32, max_length=1024, median_prompt=60, record_waves=2,
                  record_new_tokens=32))


@dataclass
class Row:
    bench: str
    variant: str
    shape: str = ""
    status: str = "ok"                   # ok | error | skipped
    ms: float | None = None              # median time of one unit (step, forward, matmul)
    tokens_per_s: float | None = None
    tflops: float | None = None          # achieved model TFLOP/s
    mfu: float | None = None             # tflops / matmul peak measured in this run
    peak_gib: float | None = None        # torch.cuda.max_memory_allocated over the variant
    note: str = ""
    extra: dict = field(default_factory=dict)


class Skip(Exception):
    """A benchmark or variant that cannot run here; the message says why and what it needs."""


# ---------------------------------------------------------------------------------------- pipeline layouts

LAYOUT_HELP = "'shared' (one GPU runs target and drafter) or T+D (T target GPUs, then D drafter GPUs, e.g. 1+3)"


def parse_layouts(text: str) -> list[str]:
    """'shared,1+3, 2+2' -> ['shared', '1+3', '2+2'] (repeats dropped); ValueError naming the bad item."""
    out: list[str] = []
    for item in (x.strip().lower() for x in text.split(",")):
        if not item:
            continue
        t, plus, d = item.partition("+")
        if item != "shared" and not (plus and t.isdigit() and d.isdigit() and int(t) >= 1 and int(d) >= 1):
            raise ValueError(f"--layouts item {item!r} is not {LAYOUT_HELP}")
        name = item if item == "shared" else f"{int(t)}+{int(d)}"
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"--layouts is empty; give a comma-separated list of {LAYOUT_HELP}")
    return out


def layout_devices(layout: str, device_type: str, visible: int | None = None) -> tuple[list[str], list[str]]:
    """A layout -> (target devices, drafter devices), disjoint on CUDA: T+D = targets cuda:0..T-1, drafters
    cuda:T..T+D-1. On CPU every worker gets 'cpu' (the pipeline allows repeats there). Skip when the layout needs
    more GPUs than `visible` (None: not checked)."""
    if layout == "shared":
        d = "cuda:0" if device_type == "cuda" else "cpu"
        return [d], [d]
    t, d = (int(x) for x in layout.split("+"))
    if device_type != "cuda":
        return ["cpu"] * t, ["cpu"] * d
    if visible is not None and t + d > visible:
        raise Skip(f"layout {layout} needs {t + d} GPUs, {visible} visible")
    return [f"cuda:{i}" for i in range(t)], [f"cuda:{i}" for i in range(t, t + d)]


BENCHMARKS: dict[str, tuple[Callable, str]] = {}


def benchmark(name: str, help: str):
    def register(fn):
        BENCHMARKS[name] = (fn, help)
        return fn
    return register


class Context:
    def __init__(self, suite: Suite):
        self.suite = suite
        self.device = torch.device(suite.device)
        self.rows: list[Row] = []
        self.peak_tflops: float | None = None   # set by the matmul benchmark; the MFU denominator
        self.cache: dict = {}                   # objects shared between benchmarks (e.g. the built target)
        self.on_row: Callable[[], None] | None = None   # called after each row lands (bench.py saves the JSON)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    def mfu(self, flops: float, ms: float) -> tuple[float, float | None]:
        tflops = flops / (ms * 1e-3) / 1e12
        return tflops, (tflops / self.peak_tflops if self.peak_tflops else None)

    def variant(self, bench: str, variant: str, shape: str, fn: Callable[[], Row | None], cost_s: float = 0.0):
        """Run one measured variant: skip it if it would start past the budget, record any exception as an
        'error' row (the run goes on), free device memory afterwards."""
        left = self.suite.budget_s - self.elapsed()
        if cost_s > left:
            self.rows.append(Row(bench, variant, shape, "skipped",
                                 note=f"time budget: ~{cost_s:.0f}s needed, {max(0.0, left):.0f}s left; "
                                      f"rerun with --only {bench}"))
            self.log(f"{bench}/{variant}: skipped (budget)")
            return None
        self.log(f"{bench}/{variant} [{shape}] ...")
        reset_memory(self.device)
        try:
            row = fn()
        except Skip as e:
            row = Row(bench, variant, shape, "skipped", note=str(e))
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
            tb = traceback.format_exc()
            print(tb[-4000:], file=sys.stdout, flush=True)
            row = Row(bench, variant, shape, "error", note=f"{type(e).__name__}: {first_line(e)}",
                      extra={"traceback": tb[-8000:]})
        if row is not None:
            row.bench, row.variant, row.shape = bench, variant, shape
            if row.status == "ok" and row.peak_gib is None:
                row.peak_gib = peak_gib(self.device)
            self.rows.append(row)
            self.log(f"{bench}/{variant}: {summary(row)}")
        free_memory(self.device)
        if row is not None and self.on_row is not None:
            self.on_row()
        return row


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:240]


def summary(r: Row) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.note}"
    parts = [f"{r.ms:.2f} ms" if r.ms is not None else ""]
    if r.tokens_per_s:
        parts.append(f"{r.tokens_per_s:,.0f} tok/s")
    if r.mfu is not None:
        parts.append(f"MFU {r.mfu:.3f}")
    if r.peak_gib is not None:
        parts.append(f"peak {r.peak_gib:.1f} GiB")
    return ", ".join(p for p in parts if p) if r.ms is not None or r.tokens_per_s else r.note[:200]


# ---------------------------------------------------------------------------------------- device helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def free_memory(device: torch.device) -> None:
    """Drop compiled code (its CUDA graphs hold static copies of inputs and activation pools) and cached blocks,
    so each variant's peak memory is its own. The on-disk inductor cache stays: later compiles of the same graph
    are quick."""
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        # Every GPU a variant used (a pipeline layout spans several); a GPU nothing touched holds no cache.
        for i in range(torch.cuda.device_count()):
            if torch.cuda.memory_reserved(i):
                torch.cuda.synchronize(i)
                with torch.cuda.device(i):
                    torch.cuda.empty_cache()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class Timer:
    """Times regions on the device stream: CUDA events on GPU (no sync inside the loop), wall clock on CPU.

    t = Timer(device); t.mark() ... t.mark() ...; t.intervals_ms() -> [ms between consecutive marks]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        sync(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_calls(fn: Callable[[int], object], device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """-> (first call seconds incl. any compilation, median ms of `iters` calls after `warmup` more)."""
    t0 = time.perf_counter()
    fn(0)
    sync(device)
    first_s = time.perf_counter() - t0
    for i in range(warmup):
        fn(1 + i)
    timer = Timer(device)
    timer.mark()
    for i in range(iters):
        fn(1 + warmup + i)
        timer.mark()
    return first_s, statistics.median(timer.intervals_ms())


def count_host_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """Host-device synchronisations inside fn (CUDA sync debug mode); None where it cannot be observed."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def compile_counters() -> dict:
    """Snapshot of dynamo / inductor counters (graphs, graph breaks, CUDA-graph skips), to diff around a variant."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "break_reasons": list(counters["graph_break"].keys()),
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def counters_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    out = {k: after[k] - before[k] for k in ("graphs", "graph_breaks", "cudagraph_skips")}
    out["break_reasons"] = [r[:200] for r in after["break_reasons"] if r not in before["break_reasons"]][:5]
    return out


class CudagraphSkipLog:
    """Collects inductor's 'skipping cudagraphs due to ...' warnings during a variant (their artifact loggers do
    not propagate unless TORCH_LOGS asks, so a handler is attached to them directly)."""

    NAMES = ("torch._inductor.cudagraph_utils.__cudagraphs", "torch._inductor.compile_fx.__perf_hints",
             "torch._inductor.cudagraph_utils", "torch._inductor.compile_fx")

    def __enter__(self):
        import logging

        self.messages: list[str] = []
        outer = self

        class _Handler(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "cudagraph" in msg.lower() and len(outer.messages) < 20:
                    outer.messages.append(msg[:300])

        self._handler = _Handler(level=logging.WARNING)
        self._loggers = [logging.getLogger(n) for n in self.NAMES]
        for lg in self._loggers:
            lg.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        for lg in self._loggers:
            lg.removeHandler(self._handler)
        return False
