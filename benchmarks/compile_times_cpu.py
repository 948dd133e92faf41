#!/usr/bin/env python3
"""CPU probe (issue #16, fast start): where torch.compile's time goes for the drafter's training step at the
Qwen3-8B graph, on a machine without a GPU.

  PYTHONPATH=src .venv/bin/python benchmarks/compile_times_cpu.py [WIDTH]   (default 256; minutes on 2 cores)

The graph is the Qwen3-8B run's: a 5-layer drafter tapping 5 of 36 target layers, 32/8 heads of dimension 128, the
151,936-token vocabulary, 512 anchors of 16 (7,680 label rows: two LM-head chunks), one compiled forward + backward
(train.compile=default, as the bench's `drafter` case). Only the hidden width is narrowed (WIDTH instead of 4,096)
and the row shortened, so that it fits a CPU: dynamo's tracing, AOT autograd's joint graph and partition, and
inductor's lowering, scheduling and code generation depend on the graph, not on the tensor sizes, so their seconds
stand for the GPU's (give or take the CPU's speed); the C++ build stands in for Triton's kernel compiles, which it
does not measure. The attention is sdpa: flex attention has no backward on the CPU.
Prints the first call's time (the compile, on a fresh cache, and one fp32 step, itself ~2 minutes on 2 cores) and
torch.compile's table (train.compile_times' figures, the main stages).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import compile_times
from transformers import Qwen3Config

from dflash_train.config import load_config
from dflash_train.devices import resolve_config
from dflash_train.models.build import build_drafter_config
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import TargetInfo, default_layer_ids
from dflash_train.pipeline.loader import dummy_batch
from dflash_train.training.step import DrafterStep

STAGES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "aot_trace_joint_graph",
          "min_cut_rematerialization_partition", "compile_fx.<locals>.fw_compiler_base",
          "compile_fx.<locals>.bw_compiler", "GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen",
          "compile_file", "async_compile.wait", "PyCodeCache.load_by_key_path")


def main(width: int = 256) -> None:
    cache = tempfile.mkdtemp(prefix="compile_times_cpu_")  # cold: inductor reads the variable at every lookup
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    target = Qwen3Config(hidden_size=width, intermediate_size=3 * width, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192)
    info = TargetInfo.from_config(target)
    drafter = DFlashDrafter(build_drafter_config(info, default_layer_ids(36, 5), info.vocab_size - 1, 16, 5)).float()
    T, A = 1024, 512
    cfg = resolve_config(load_config("tiny_cpu", [
        "model.target=x", "run.out_dir=/tmp/compile_times_cpu", f"train.token_budget={T}", f"train.num_anchors={A}",
        "train.compile=default", "train.attention=sdpa", "train.dtype=fp32"]))
    embed = torch.randn(info.vocab_size, width) * 0.02
    step = DrafterStep(drafter, embed, embed, cfg.train, torch.device("cpu"))
    t0 = time.perf_counter()
    step(dummy_batch(T, A), torch.zeros(T, step.feats_width))
    print(f"first call (compile + one fp32 step on the CPU): {time.perf_counter() - t0:.1f} s")
    headers, values = compile_times(repr="csv", aggregate=True)
    table = dict(zip(headers, values))
    for name in STAGES:
        if name in table:
            print(f"  {name:45s} {float(table[name]):8.1f} s")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
