#!/usr/bin/env python3
"""What model.target_compile_layers saves in compile time: the target's feature forward compiled whole against each
decoder layer compiled on its own (models/target.py, FeatureForward and TargetModel.compile_layers), with inductor
and empty caches, each in a process of its own. A small Qwen3 of many layers on the CPU: compile time grows with the
layers dynamo traces and inductor lowers, which is what the option cuts; on a GPU, Triton kernels repeated across
layers are compiled once either way, so the GPU saving is the tracing and lowering part (the `target` benchmark's row
"compile default each layer + CUDA graph, flex" and the startup benchmark measure it there).

  PYTHONPATH=src python3 benchmarks/target_compile_layers_cpu.py [LAYERS]   # default 34 (Qwen3-8B's taps reach 34)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

T = 512


def child(scope: str, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.models.target import FeatureForward, TargetModel
    from dflash_train.training.cudagraphs import configure_cudagraphs

    configure_cudagraphs()
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    target = TargetModel(Qwen3ForCausalLM(cfg), [1, layers // 2, layers - 1])
    ids, pos = torch.randint(0, 256, (T,)), torch.arange(T)
    docs = (pos >= T // 3).long() + (pos >= 2 * T // 3).long()
    eager = target.features(ids, pos, docs)
    t0 = time.perf_counter()
    forward = FeatureForward(target, T, compile="default", layers=scope == "layers")
    out = forward(ids, pos, docs)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        forward(ids, pos, docs)
    call_ms = (time.perf_counter() - t0) / 5 * 1e3
    same = torch.allclose(out, eager, atol=1e-5, rtol=1e-5)
    print(f"{scope}: {layers} layers, first call (compiling) {first_s:.1f} s, then {call_ms:.1f} ms a row of {T}; "
          f"equals eager: {same}", flush=True)


def main(layers: int) -> None:
    for scope in ("forward", "layers"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            subprocess.run([sys.executable, __file__, "--child", scope, str(layers)], env=env, check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 34)
