"""Inference: lossless DFlash speculative decoding and its evaluation.

  target_runner.py   the target on a static KV cache (prefill, fixed-shape steps, batch rows), CUDA-graphed on GPU
  drafter_runner.py  the drafter with its own static context K/V cache, one graphed pass per block
  speculative.py     the draft -> verify -> accept loop and the acceptance rules (greedy, speculative sampling)
  baseline.py        plain target decoding on the same harness; generate_batch for dataset regeneration
  benchmark.py       evaluate() and `dflash-train eval` (tau, speedup, lossless verdict); report.py writes it
  prompts.py         evaluation prompts from JSONL or the held-out ShareGPT split
"""
