#!/usr/bin/env python3
"""dflash-train benchmarks: one entry point; prints progress as it goes and a table last.

  PYTHONPATH=src python3 benchmarks/bench.py                          # GPU suite: one H200, ~7 min
  PYTHONPATH=src python3 benchmarks/bench.py --only drafter,target     # a subset (matmul always runs: MFU needs it)
  PYTHONPATH=src python3 benchmarks/bench.py --suite cpu-smoke         # every benchmark at tiny shapes, seconds
  PYTHONPATH=src python3 benchmarks/bench.py --only pipeline --layouts 1+1,1+3,2+2   # target / drafter GPU splits
  PYTHONPATH=src python3 benchmarks/bench.py --only dflash2           # DFlash v1 vs 2 drafter step, SmolLM2 shape
  PYTHONPATH=src python3 benchmarks/bench.py --only startup --budget-s 540   # command -> first step, cold and warm

Results also go to $OUT/bench_results.json (or ./bench_results.json), rewritten after every row. Benchmarks live
in cases.py, cases_end_to_end.py, cases_generate.py and cases_startup.py, registered with @benchmark; shapes per
suite in harness.py. docs/BENCHMARKS.md records the figures and what they mean.
Exit status 1 when a variant failed (the table still prints; the JSON keeps its traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ORDER = ["drafter", "optimizer", "target", "colocated", "pipeline", "generate", "dflash2"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="gpu", choices=["gpu", "gpu-smollm2", "cpu-smoke", "cpu-generate"],
                   help="gpu: Qwen3-8B shapes; gpu-smollm2: the SmolLM2-135M GPU recipe's shapes (rows of 8,192 tokens, "
                        "29 documents, 1,024 anchors); cpu-generate: the smoke shapes, but a generation shape large "
                        "enough to time on a CPU")
    p.add_argument("--only", default="", help="comma-separated benchmarks (default: all): "
                                              "matmul, drafter, target, colocated, pipeline, generate, "
                                              "dflash2; and startup (only when named: ~8 min on one H200)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip variants that would start past this many seconds (gpu default 450)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per variant")
    p.add_argument("--docs", type=int, default=None, help="documents per packed row (gpu default 1)")
    p.add_argument("--layouts", default=None,
                   help="pipeline: comma-separated GPU layouts, each 'shared' (one GPU runs target and drafter) or "
                        "T+D (targets on cuda:0..T-1, drafter replicas on cuda:T..T+D-1), e.g. 1+1,1+3,2+2; "
                        "default shared, plus 1+1 when two GPUs are visible")
    p.add_argument("--pipeline-steps", type=int, default=None,
                   help="pipeline: training steps per layout, logged every steps // 6 (default 30, every 5; the "
                        "first log window, the pipeline filling up, is left out)")
    p.add_argument("--json", default=None, help="results file (default $OUT/bench_results.json or ./)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.suite.startswith("gpu"):
        # Kept between calls on a warm device machine (.gpu/ is git-ignored): a rerun skips most compilation.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".gpu" / "inductor-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    import cases  # noqa: F401 - registers the stage benchmarks
    import cases_end_to_end  # noqa: F401 - registers the pipeline benchmark
    import cases_generate  # noqa: F401 - registers the generation benchmark
    import cases_startup  # noqa: F401 - registers the start-up benchmark
    from harness import BENCHMARKS, SUITES, Context, Row, first_line, parse_layouts

    suite = SUITES[args.suite]
    if args.layouts is not None:
        try:
            suite.layouts = parse_layouts(args.layouts)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.pipeline_steps is not None:
        if args.pipeline_steps < 4:
            print("error: --pipeline-steps must be at least 4 (3 log windows are measured after the first)",
                  file=sys.stderr)
            return 2
        suite.pipeline_steps = args.pipeline_steps
    if args.budget_s is not None:
        suite.budget_s = args.budget_s
    if args.iters is not None:
        suite.iters = args.iters
    if args.docs is not None:
        suite.num_docs = args.docs
    if suite.cpu_threads:
        torch.set_num_threads(suite.cpu_threads)
    if suite.device == "cuda" and not torch.cuda.is_available():
        print("error: the gpu suite needs CUDA; use --suite cpu-smoke on this machine", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.only.split(",") if n.strip()] or DEFAULT_ORDER
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"error: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    names = ["matmul"] + [n for n in names if n != "matmul"]

    ctx = Context(suite)
    meta = environment(torch, suite, argv if argv is not None else sys.argv[1:])
    out = Path(args.json) if args.json else Path(os.environ.get("OUT") or ".") / "bench_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> dict:   # after every row too: a run stopped by a time limit still leaves what it measured
        ratios = derive_ratios(ctx.rows)
        out.write_text(json.dumps({"meta": meta, "ratios": ratios, "rows": [asdict(r) for r in ctx.rows]}, indent=1,
                                  default=str))
        return ratios

    ctx.on_row = save
    ctx.log(f"suite {suite.name} on {meta['device_name']}; torch {meta['torch']}, transformers "
            f"{meta['transformers']}; benchmarks: {', '.join(names)}")
    for name in names:
        fn, _help = BENCHMARKS[name]
        try:
            fn(ctx)   # variants catch their own failures; this catches a benchmark's setup
        except Exception as e:  # noqa: BLE001 - the run goes on to the next benchmark
            traceback.print_exc()
            ctx.rows.append(Row(name, "setup", status="error", note=f"{type(e).__name__}: {first_line(e)}",
                                extra={"traceback": traceback.format_exc()[-8000:]}))
    ratios = save()
    ctx.log(f"results written to {out}")
    print_table(ctx.rows, ratios, suite, meta)
    return 1 if any(r.status == "error" for r in ctx.rows) else 0


def environment(torch, suite, argv) -> dict:
    import transformers

    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001 - triton is absent on CPU-only machines
        triton_v = None
    cuda = suite.device == "cuda"
    return {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "suite": suite.name,
            "command": "PYTHONPATH=src python3 benchmarks/bench.py " + " ".join(argv),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "triton": triton_v, "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "num_docs": suite.num_docs, "iters": suite.iters, "warmup": suite.warmup,
            "visible_gpus": torch.cuda.device_count() if cuda else 0, "layouts": suite.layouts}


def _row(rows, bench, variant_prefix, shape=None):
    for r in rows:
        if r.bench == bench and r.variant.startswith(variant_prefix) and r.status == "ok" and r.ms:
            if shape is None or r.shape == shape:
                return r
    return None


def derive_ratios(rows) -> dict:
    """The ratios the issue's goals are stated in (P1 target MFU, P2 drafter MFU, P4 reduce-overhead / eager)."""
    out: dict = {}
    eager, ref = _row(rows, "drafter", "eager"), _row(rows, "drafter", "reference")
    for key, prefix in (("default", "compile default"), ("reduce-overhead", "compile reduce-overhead")):
        r = _row(rows, "drafter", prefix)
        if r and eager:
            out[f"drafter {key} speedup vs eager"] = eager.ms / r.ms
    drafter_ok = [r for r in rows if r.bench == "drafter" and r.status == "ok" and r.mfu is not None
                  and not r.variant.startswith("reference")]
    if drafter_ok:
        best = max(drafter_ok, key=lambda r: r.mfu)
        out["drafter best MFU (goal P2 >= 0.55)"] = best.mfu
        if ref:
            out["drafter best speedup vs reference"] = ref.ms / best.ms
    target_ok = [r for r in rows if r.bench == "target" and r.status == "ok" and r.mfu is not None
                 and "ceiling" not in r.variant]
    if target_ok:
        out["target best MFU (goal P1 >= 0.70)"] = max(r.mfu for r in target_ok)
    for r in target_ok:
        if r.variant.startswith("torch.compile"):
            e = _row(rows, "target", "eager (document mask)", r.shape)
            if e:
                out[f"target compiled speedup vs eager at {r.shape}"] = e.ms / r.ms
    if ref and "loss_first" in ref.extra:
        diffs = [abs(r.extra["loss_first"] - ref.extra["loss_first"]) for r in drafter_ok if "loss_first" in r.extra]
        if diffs:   # every variant's first step: same weights, same batch; only numerics may differ
            out["drafter first-step loss max |diff| vs reference"] = max(diffs)
    v1, v2 = _row(rows, "dflash2", "dflash compile"), _row(rows, "dflash2", "dflash2 compile")
    if v1 and v2:
        out["dflash2 step time / dflash step time (same shape)"] = v2.ms / v1.ms
    colo = _row(rows, "colocated", "target")
    if colo:
        t = _row(rows, "target", "eager (document mask)", f"T={colo.shape.split()[0][2:]}")
        d = _row(rows, "drafter", "compile reduce-overhead")  # the drafter variant colocated runs
        if t and d:   # sequential: the ideal is 1 / (1/target + 1/drafter), each stage's time alone added up
            ideal = 1.0 / (1.0 / t.tokens_per_s + 1.0 / d.tokens_per_s)
            out["colocated tokens/s vs stages alone back to back"] = colo.tokens_per_s / ideal
    record = _row(rows, "generate", "continuous batching at regenerate's own batch")
    bound = next((r for r in rows if r.bench == "generate" and r.variant.endswith("(row of record)")
                  and r.variant.startswith("bound") and r.status == "ok"), None)  # a bound row has no ms
    if record and bound:  # issue #16: >= 100k generated tokens/s for SmolLM2 on one H200 at 256 new tokens
        out["generate: row of record, generated tokens/s"] = record.tokens_per_s
        out["generate: row of record vs its bytes-read bound"] = record.tokens_per_s / bound.tokens_per_s
    before = _row(rows, "generate", "arrival order, whole cache")
    now = _row(rows, "generate", "continuous batching (regenerate now)")
    if before and now:
        out["generate: regenerate now vs before (tokens/s)"] = now.tokens_per_s / before.tokens_per_s
    static, cont = (_row(rows, "generate", v) for v in ("sorted pools, windowed, packed GQA, varied replies",
                                                         "continuous batching, varied replies"))
    if static and cont:
        out["generate: continuous batching vs sorted pools, varied replies (tokens/s)"] = \
            cont.tokens_per_s / static.tokens_per_s
    out.update(pipeline_ratios([r for r in rows if r.bench == "pipeline" and r.status == "ok" and r.tokens_per_s],
                               colo))
    for r in rows:   # issue #16's fast start, seconds from the command to the first step
        if r.bench == "startup" and r.status == "ok" and r.extra.get("first_step_s") is not None:
            out[f"startup {r.variant}: seconds to the first step (goal <= {r.extra['goal_s']:.0f})"] = \
                r.extra["first_step_s"]
    return out


def pipeline_ratios(rows, colo) -> dict:
    """P3 (one GPU shared and 1+1 against the slowest stage alone), each multi-GPU layout against its ideal,
    scaling efficiency of 1+N against 1+1 (annotate_scaling in cases_end_to_end.py), the best layout per GPU count."""
    out: dict = {}
    by_gpus: dict[int, list] = {}
    for r in rows:
        layout = r.extra.get("layout", "")
        name = layout or r.variant
        if r.extra.get("target_mfu") is not None:   # the stages-alone row: the pipeline's own target forward
            out[f"pipeline's target stage ({r.extra['target_stage']}) MFU (goal P1 >= 0.70)"] = r.extra["target_mfu"]
        if r.extra.get("eager_target"):   # the path before: only for the comparison below
            continue
        if r.extra.get("steps_per_row", 1) > 1:   # the same layout, the target's forward over K steps
            out[f"pipeline ({r.variant}) vs its stages back to back (1 / K of the target a step)"] = \
                r.extra.get("vs_sequential")
            shared = next((x for x in rows if x.extra.get("layout") == layout and x.status == "ok"
                           and x.extra.get("steps_per_row", 1) == 1 and not x.extra.get("eager_target")), None)
            if shared is not None:
                key = f"pipeline ({r.variant}) vs train.steps_per_row=1 (steps/s)"
                out[key] = r.tokens_per_s / shared.tokens_per_s
            continue
        if "vs_slowest_stage" in r.extra and layout in ("shared", "1+1"):
            out[f"pipeline ({r.variant}) vs slowest stage alone (goal P3 >= 0.95)"] = r.extra["vs_slowest_stage"]
        if "vs_sequential" in r.extra:
            out[f"pipeline ({r.variant}) vs its stages back to back (goal >= 0.98)"] = r.extra["vs_sequential"]
        if "vs_ideal" in r.extra and layout != "1+1":
            out[f"pipeline {name} vs min(T x target, D x drafter) alone"] = r.extra["vs_ideal"]
        if "scaling_efficiency" in r.extra:
            n = int(layout.split("+")[1])
            out[f"pipeline {name} scaling efficiency: tokens/s / ({n} x tokens/s of 1+1)"] = r.extra["scaling_efficiency"]
        if colo and layout:   # pipeline rows only, not the stages-alone row
            out[f"pipeline ({r.variant}) vs colocated"] = r.tokens_per_s / colo.tokens_per_s
        if layout:
            gpus = 1 if layout == "shared" else sum(int(x) for x in layout.split("+"))
            by_gpus.setdefault(gpus, []).append(r)
    before = next((r for r in rows if r.extra.get("eager_target") and r.extra.get("layout") == "shared"), None)
    now = next((r for r in by_gpus.get(1, []) if r.extra.get("layout") == "shared"), None)
    if before and now:
        out[f"pipeline one GPU shared, target {now.extra['target_stage']} vs {before.extra['target_stage']} "
            "(tokens/s)"] = now.tokens_per_s / before.tokens_per_s
    for gpus, group in sorted(by_gpus.items()):
        if len(group) > 1 or gpus > 2:
            best = max(group, key=lambda r: r.tokens_per_s)
            key = f"pipeline best layout on {gpus} GPU{'s' if gpus > 1 else ''} by tokens/s: {best.extra['layout']}"
            out[key] = best.tokens_per_s
            sps = best.extra.get("samples_per_s")
            if sps is not None:
                out[f"{key}, samples/s of {best.extra['sample_len']} tokens"] = sps
    return out


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def print_table(rows, ratios, suite, meta) -> None:
    head = ("bench", "variant", "shape", "ms", "tok/s", "TFLOP/s", "MFU", "peak GiB", "notes")
    body = [(r.bench, r.variant if r.status == "ok" else f"{r.variant} [{r.status.upper()}]", r.shape,
             _fmt(r.ms, ".2f"), _fmt(r.tokens_per_s, ",.0f"), _fmt(r.tflops, ".0f"), _fmt(r.mfu, ".3f"),
             _fmt(r.peak_gib, ".1f"), r.note[:160]) for r in rows]
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head) - 1)]
    print(f"\n== dflash-train bench | suite {suite.name} | {meta['device_name']} | torch {meta['torch']} | "
          f"{meta['date_utc']} | docs/row {suite.num_docs}")
    for line in [head] + body:
        cells = [str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells) + "  " + line[-1])
    for k, v in ratios.items():
        print(f"  {k}: {v:,.0f}" if abs(v) >= 1000 else f"  {k}: {v:.3f}")


if __name__ == "__main__":
    sys.exit(main())
