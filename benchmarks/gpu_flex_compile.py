#!/usr/bin/env python3
"""Why the drafter's flex step compiles for minutes at the Qwen3-8B shape (issue #16, fast start).

At that shape a cold start spent 237 s compiling the training step with flex attention and 36 s with a dense mask
(`train.attention=sdpa`, docs/gpu-runs/2026-12-04-startup-n), 212 s of the first in `async_compile.wait`: waiting on
Triton. This probe compiles the DFlash flex attention alone (training/objective.py's mask, built inside the graph as
the step builds it), forward and backward, at that shape (512 blocks of 16 queries on a 4,096-token row, 32 query /
8 K/V heads of 128), once per kernel-option set, each in its own process with empty inductor and Triton caches.
Triton compiles in that process (compile_threads=1) so each kernel's compile is timed by name, printed as it ends.
Prints, per set, the first call's wall time (fwd + bwd, compiling included), the slowest kernel compiles, and the
call's time after; a set still compiling after COMPILE_SET_S seconds (default 240) is stopped.

  PYTHONPATH=src python3 benchmarks/gpu_flex_compile.py [SET ...]
  # sets: default, tiles64, stages1 (kernel options; run when no SET is named), step, step_sdpa (the whole step)

Measured 2026-12-06 on an H100 (docs/gpu-runs/2026-12-06-h100-checks/): flex attention alone compiles cold in
22.7 s (17 kernels, 17.3 s of Triton; tiles64 18.1 s, but 8.05 ms a call against 4.86), so flex's own kernels are
not the ~200 s. The sets `step` and `step_sdpa` therefore compile the whole training step at that shape
(benchmarks/cases.py's DrafterRig of the `gpu` suite: 5 layers, 4,096 tokens, 512 anchors, reduce-overhead, fwd +
bwd + the optimizer step), with flex and with the dense mask, each kernel timed the same way: the difference
between the two names the kernels that take the time. They did (the same day, H100): the flex step was still
compiling at 200 s, its two slowest kernels (20.6 s, 27.0 s) the mask's tile orderings, argsorts fused into one
persistent reduction; with the orderings from prefix sums and the mask built once a step (models/flex.py), its first
call takes 86.3 s, then 158.27 ms a step (the dense-mask step: 77.9 s, 225.53 ms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from dflash_train.training.objective import SMALL_HEAD_TILES

# Kernel options flex_attention accepts (forward BLOCK_M/N, backward BLOCK_M1/N1/M2/N2): smaller tiles and fewer
# pipeline stages make smaller kernels, which compile faster and may run slower. The mask's tile stays 128.
# "tiles64" is the drafter's tiles for heads of at most 64 (training/objective.py, whose backward also runs 4 warps).
SETS = {
    "default": {},
    "tiles64": SMALL_HEAD_TILES,
    "stages1": {"num_stages": 1},
}
STEP_SETS = {"step": "flex", "step_sdpa": "sdpa"}  # the whole training step instead, by its train.attention
A, B, T, H, HKV, D = 512, 16, 4096, 32, 8, 128
KERNEL_LINE = "  Triton compiled "  # the child's line for each kernel it compiles, streamed by main()


def child(name: str) -> None:
    import torch
    import torch._inductor.config as inductor_config
    try:
        import triton
    except ImportError:  # a CPU dry run of the step sets (COMPILE_SUITE=cpu-smoke): nothing for Triton to compile
        triton = None

    from dflash_train.training.cudagraphs import configure_cudagraphs
    from dflash_train.training.objective import FlexMask, flex_block_mask

    inductor_config.compile_threads = 1  # compile in this process, so each kernel's compile is timed below
    configure_cudagraphs()
    compiles: list[tuple[float, str]] = []
    real_compile = triton.compile if triton else None

    def timed_compile(src, *args, **kwargs):
        t0 = time.perf_counter()
        out = real_compile(src, *args, **kwargs)
        fn = getattr(src, "fn", None)
        compiles.append((time.perf_counter() - t0, getattr(fn, "__name__", None) or getattr(src, "name", "?")))
        print(f"{KERNEL_LINE}{name}: {compiles[-1][1]} in {compiles[-1][0]:.1f} s", flush=True)
        return out

    if triton:
        triton.compile = timed_compile
    if name in STEP_SETS:
        return whole_step(STEP_SETS[name], compiles)
    options = SETS[name]

    def attention(q, k, v, anchors, first, partial, full):
        from torch.nn.attention.flex_attention import flex_attention

        mask = FlexMask(anchors, first, partial, full, T, B)
        out = flex_attention(q, k, v, block_mask=mask.block_mask(), enable_gqa=True, kernel_options=options or None)
        return out.float().square().mean()

    dev = torch.device("cuda")
    torch.manual_seed(0)
    N = A * B
    q = torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, HKV, T + N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, HKV, T + N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    doc_ids = torch.zeros(T, dtype=torch.long, device=dev)                  # one document a row, as the bench's
    anchors = torch.randperm(T - B, device=dev)[:A].sort().values + 1
    m = flex_block_mask(anchors, doc_ids, B)
    inputs = (q, k, v, anchors, m.first, m.partial, m.full)
    fn = torch.compile(attention, dynamic=False, fullgraph=True)

    def call():
        q.grad = k.grad = v.grad = None
        fn(*inputs).backward()

    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        call()
    end.record()
    torch.cuda.synchronize()
    compiles.sort(reverse=True)
    print(json.dumps(dict(set=name, options=options, first_call_s=round(first_s, 1),
                          call_ms=round(start.elapsed_time(end) / 10, 2), kernels=len(compiles),
                          compile_s=round(sum(s for s, _ in compiles), 1),
                          slowest=[(round(s, 1), n) for s, n in compiles[:5]])))


def whole_step(attention: str, compiles: list[tuple[float, str]]) -> None:
    """The training step as the startup benchmark compiles it (DrafterRig, suite `gpu`), its first call timed.
    COMPILE_SUITE=cpu-smoke runs it at the tiny CPU suite's shapes: a dry run of this code on a machine without a GPU
    (`step_sdpa` only: torch has no flex backward on the CPU)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
    import torch
    from cases import DrafterRig, train_batches

    suite = harness.SUITES[os.environ.get("COMPILE_SUITE", "gpu")]
    ctx = harness.Context(suite)
    batches, _ = train_batches(ctx, suite=suite)
    with torch.enable_grad():
        rig = DrafterRig(ctx, "reduce-overhead", attention, tag=f"compile-probe-{attention}", suite=suite)
        feats = torch.randn(suite.token_budget, rig.cfg.num_feature_layers * rig.cfg.hidden_size, device=ctx.device,
                            dtype=suite.dtype)

        def step(i: int) -> None:
            rig.fwd_bwd(batches[i % len(batches)], feats)
            rig.optim()

        # the first call compiles; the warm-up call records reduce-overhead's CUDA graph
        first_s, call_ms = harness.time_calls(step, ctx.device, warmup=1, iters=5)
    compiles.sort(reverse=True)
    print(json.dumps(dict(set=f"step_{attention}", options={"train.attention": attention},
                          first_call_s=round(first_s, 1), call_ms=round(call_ms, 2),
                          kernels=len(compiles), compile_s=round(sum(s for s, _ in compiles), 1),
                          slowest=[(round(s, 1), n) for s, n in compiles[:8]])))


def main(names: list[str]) -> None:
    """Each set in a child of its own, its kernel compiles printed as they finish (a set stopped at SET_S seconds,
    COMPILE_SET_S in the environment, still shows what compiled by then)."""
    set_s = float(os.environ.get("COMPILE_SET_S", 240))
    for name in names or list(SETS):
        if name not in SETS and name not in STEP_SETS:
            sys.exit(f"unknown set {name!r}; sets: {', '.join([*SETS, *STEP_SETS])}")
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, __file__, "--child", name], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            timer = threading.Timer(set_s, proc.kill)
            timer.start()
            lines = []
            seen: list[tuple[float, str]] = []  # (seconds, kernel) of each compile streamed so far
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith(KERNEL_LINE):
                    kernel, _, secs = line[len(KERNEL_LINE):].rstrip(" s\n").rpartition(" in ")
                    seen.append((float(secs), kernel.split(": ", 1)[-1]))
                    if seen[-1][0] >= 1.0:  # a whole step compiles hundreds of kernels: the slow ones only
                        print(line, end="", flush=True)
            proc.wait()
            timer.cancel()
            results = [ln for ln in lines if ln.startswith("{")]
            if proc.returncode or not results:
                why = f"stopped at {set_s:.0f} s" if proc.returncode == -9 else f"exit {proc.returncode}"
                seen.sort(reverse=True)
                print(f"{name}: failed ({why}) after {time.perf_counter() - t0:.0f} s, {len(seen)} Triton compiles "
                      f"in {sum(s for s, _ in seen):.1f} s by then, the slowest {seen[:8]}:\n"
                      + "\n".join(ln for ln in lines if not ln.startswith(KERNEL_LINE))[-2000:], flush=True)
                continue
            r = json.loads(results[-1])
            print(f"{name} {r['options']}: first call (fwd + bwd, compiling included) {r['first_call_s']} s, "
                  f"{r['kernels']} Triton compiles in {r['compile_s']} s, the slowest {r['slowest']}; after: "
                  f"{r['call_ms']} ms a call", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main(sys.argv[1:])
