#!/usr/bin/env bash
# The GPU session in one script (H200, torch 2.11, no network). Run from the repo root after staging SmolLM2:
#   GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/gpu_suite.sh smollm2|trees|bench
# TARGET_ATTN=flex trains with the target's document mask as a flex BlockMask (model.target_attention; default sdpa).
# Inputs under the git-ignored .gpu/data: train_prompts.jsonl (first user turns of ShareGPT, file order) and
# eval_prompts.jsonl (32 later, disjoint ones). Each stage has its own time limit; logs and results go to $OUT.
set -u
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GGUF=${GGUF:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=/tmp/smollm2_run
stage() { echo; echo "=== $1 ($(date +%T))"; }

smollm2() {
  stage "regenerate ShareGPT first turns with SmolLM2 (greedy, batched)"
  timeout 130 python3 -m dflash_train.cli regenerate --target "$GGUF" --data .gpu/data/train_prompts.jsonl \
      --out /tmp/regen.jsonl --max-samples "${REGEN_SAMPLES:-12000}" --max-new-tokens 256 --batch-size 512 \
      --device cuda 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -5
  wc -l /tmp/regen.jsonl
  stage "train the drafter: threaded pipeline, reduce-overhead steps in worker threads, one H200 shared"
  timeout 260 python3 -m dflash_train.cli train --config smollm2_gpu model.target="$GGUF" \
      data.source=/tmp/regen.jsonl run.out_dir=$RUN run.overwrite=true train.max_minutes="${TRAIN_MIN:-3.0}" \
      model.target_attention="${TARGET_ATTN:-sdpa}" \
      2>&1 | grep -v -E "it/s\]|s/it\]" | tail -40
  cp $RUN/metrics.jsonl "$OUT/" 2>/dev/null; cp $RUN/*.png "$OUT/" 2>/dev/null
  stage "evaluate on 32 held-out prompts: lossless greedy speculative decoding vs target alone"
  # A run stopped by the time limit has no drafter/ yet; its last checkpoint is a servable drafter too.
  D=$RUN/drafter; [ -f "$D/config.json" ] || D=$(ls -d $RUN/checkpoints/step_* 2>/dev/null | tail -1)
  timeout 150 python3 -m dflash_train.cli eval --drafter "$D" --target "$GGUF" \
      --prompts .gpu/data/eval_prompts.jsonl --max-new-tokens 256 --device cuda --out "$OUT/eval" 2>&1 | tail -40
  stage "lossless verdict in fp32 on 8 held-out prompts (in bf16 near-ties may round differently)"
  timeout 90 python3 -m dflash_train.cli eval --drafter "$D" --target "$GGUF" --dtype fp32 \
      --prompts .gpu/data/eval_prompts.jsonl --num-prompts 8 --max-new-tokens 128 --device cuda \
      --out "$OUT/eval_fp32" 2>&1 | tail -12
}

trees() {
  stage "pipeline in worker threads: trees off trains, trees on fails"
  timeout 200 python3 benchmarks/gpu_pipeline_check.py 2>&1 | tail -30
}

bench() {
  stage "benchmark suite"
  timeout "${BENCH_S:-300}" python3 benchmarks/bench.py --suite gpu 2>&1 | tail -60
}

for s in "${@:-smollm2}"; do "$s"; done 2>&1 | tee -a "$OUT/suite.log"
