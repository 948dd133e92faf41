#!/usr/bin/env bash
# The GPU session in one script (H200, torch 2.11, no network). Run from the repo root after staging SmolLM2:
#   GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/gpu_suite.sh smollm2|trees|bench
# TARGET_ATTN=flex trains with the target's document mask as a flex BlockMask (model.target_attention; default: the recipe's).
# Inputs under the git-ignored .gpu/data, written by `PYTHONPATH=src python3 benchmarks/gpu_data.py` (carry the .gz
# files): train_chats.jsonl(.gz), every ShareGPT record but the 32 held out, replies to regenerate, and
# eval_prompts.jsonl(.gz). Each stage has its own time limit; logs and results go to $OUT.
#   smollm2    one GPU end to end: regenerate first turns (130 s), train, evaluate
#   regen4     regenerate every reply, one shard per visible GPU in parallel (REGEN_S seconds: then SIGTERM, which
#              finishes the batch in flight and prints each shard's summary; resumable)
#   train      train on /tmp/regen.jsonl (CONFIG: a recipe, default smollm2_gpu (one GPU shared); smollm2_gpu2 = target
#              cuda:0 + drafter cuda:1; STEPS, TRAIN_MIN; resumes the run in $RUN if it exists)
#   evaluate   eval of $RUN's drafter on the held-out prompts: bf16 (tau, speedup) and fp32 (lossless verdict)
set -u
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"  # bench.py writes its JSON there
GGUF=${GGUF:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-/tmp/smollm2_run}
stage() { echo; echo "=== $1 ($(date +%T))"; }

smollm2() {
  stage "regenerate ShareGPT first turns with SmolLM2 (greedy, batched)"
  [ -f .gpu/data/train_chats.jsonl ] || gunzip -kf .gpu/data/train_chats.jsonl.gz
  timeout -k 60 130 python3 -m dflash_train.cli regenerate --target "$GGUF" --data .gpu/data/train_chats.jsonl \
      --single-turn --out /tmp/regen.jsonl --max-samples "${REGEN_SAMPLES:-12000}" --max-new-tokens 256 \
      --batch-size 512 --device cuda 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -5
  wc -l /tmp/regen.jsonl
  train
  evaluate
}

regen4() {
  stage "regenerate every reply of .gpu/data/train_chats.jsonl: one shard per GPU, greedy, batched"
  [ -f .gpu/data/train_chats.jsonl ] || gunzip -kf .gpu/data/train_chats.jsonl.gz
  local n; n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for i in $(seq 0 $((n - 1))); do
    awk -v n="$n" -v i="$i" 'NR % n == i' .gpu/data/train_chats.jsonl > /tmp/shard$i.jsonl
    CUDA_VISIBLE_DEVICES=$i timeout -k 60 "${REGEN_S:-240}" python3 -m dflash_train.cli regenerate --target "$GGUF" \
        --data /tmp/shard$i.jsonl --out /tmp/regen$i.jsonl --max-new-tokens "${REGEN_NEW:-256}" \
        --max-length 2048 --batch-size "${REGEN_BATCH:-768}" --device cuda > /tmp/regen$i.log 2>&1 &
  done
  wait
  for i in $(seq 0 $((n - 1))); do grep -E "regenerated|rror" /tmp/regen$i.log | tail -3; done
  cat $(seq -f "/tmp/regen%g.jsonl" 0 $((n - 1))) > /tmp/regen.jsonl  # this run's shards only
  python3 -c '
import json
recs = [json.loads(line) for line in open("/tmp/regen.jsonl") if line.endswith("\n")]
replies = [m["content"] for r in recs for m in r["messages"] if m["role"] == "assistant"]
print(f"/tmp/regen.jsonl: {len(recs)} conversations, {len(replies)} replies, "
      f"{sum(map(len, replies)) / 2**20:.1f} MiB of reply text")'
}

train() {
  local config=${CONFIG:-smollm2_gpu}
  stage "train on /tmp/regen.jsonl: recipe $config, pipeline, reduce-overhead steps in worker threads"
  local resume=never overwrite=true
  if [ -f $RUN/run_config.yaml ]; then resume=auto overwrite=false; fi
  # STEPS, TARGET_ATTN override the recipe only when set; TRAIN_MIN always (each call's own time limit).
  timeout "${TRAIN_S:-560}" python3 -m dflash_train.cli train --config "$config" model.target="$GGUF" \
      data.source=/tmp/regen.jsonl run.out_dir=$RUN run.resume=$resume run.overwrite=$overwrite \
      ${STEPS:+train.max_steps=$STEPS} train.max_minutes="${TRAIN_MIN:-3.0}" \
      ${TARGET_ATTN:+model.target_attention=$TARGET_ATTN} ${TRAIN_ARGS:-} \
      2>&1 | grep -v -E "it/s\]|s/it\]" | tail -45
  cp $RUN/metrics.jsonl "$OUT/" 2>/dev/null; cp $RUN/*.png "$OUT/" 2>/dev/null
}

evaluate() {
  local d=$RUN/drafter
  [ -f "$d/config.json" ] || d=$(ls -d $RUN/checkpoints/step_* 2>/dev/null | tail -1)
  [ -f .gpu/data/eval_prompts.jsonl ] || gunzip -kf .gpu/data/eval_prompts.jsonl.gz
  stage "evaluate $d on the held-out prompts: greedy speculative decoding vs target alone (bf16)"
  timeout 200 python3 -m dflash_train.cli eval --drafter "$d" --target "$GGUF" \
      --prompts .gpu/data/eval_prompts.jsonl --max-new-tokens 256 --device cuda --out "$OUT/eval" 2>&1 | tail -40
  stage "lossless verdict in fp32 on 8 held-out prompts"
  timeout 100 python3 -m dflash_train.cli eval --drafter "$d" --target "$GGUF" --dtype fp32 \
      --prompts .gpu/data/eval_prompts.jsonl --num-prompts 8 --max-new-tokens 128 --device cuda \
      --out "$OUT/eval_fp32" 2>&1 | tail -12
}

trees() {
  stage "pipeline in worker threads: trees off trains, trees on fails"
  timeout 200 python3 benchmarks/gpu_pipeline_check.py 2>&1 | tail -30
}

bench() {
  stage "benchmark suite"
  local limit=${BENCH_S:-540}  # the suite skips what would start past its budget; the table needs the rest
  timeout "$limit" python3 benchmarks/bench.py --suite gpu --budget-s $((limit - 90)) 2>&1 | tail -60
}

for s in "${@:-smollm2}"; do "$s"; done 2>&1 | tee -a "$OUT/suite.log"
