#!/usr/bin/env bash
# Recipe variants at the same data and budget on one H200, for the drafter-quality table in docs/BENCHMARKS.md.
#   regen       the demo's data step alone (first ShareGPT turns + self-written prompts, data.regenerate_minutes;
#               REGEN_ARGS="k=v ..." overrides it, e.g. fewer self-written prompts for a short A/B) into
#               $S/runs/demo-data/, converting the GGUF once (needs benchmarks/gpu_demo.sh stage + the GGUF joined at
#               $S/SmolLM2-135M-Instruct.Q4_1.gguf)
#   <variant>   train from scratch on that data with the demo's own training settings (demo.GPU_OVERRIDES without
#               its data step and its clock) for TRAIN_MIN minutes (schedule sized to it), plus the variant's
#               overrides, then speculative decoding on the bundled yardstick prompts (another source: 80 x 256 tokens)
# EXTRA="k=v ..." adds overrides to every variant. PARALLEL=1 trains the variants side by side on the one GPU (each
# gets a share of it: compare them with each other, not with a run that had the GPU alone). One line per variant
# (measured tau, speedup, verdict, validation's best estimate, steps) goes to $OUT/variants.txt. Start it from a
# device call with `bash benchmarks/gpu_demo.sh variants` (it detaches the job; device calls are <= 10 minutes).
# Variants: ce (the demo's recipe as configured, DFlash v1), v2 (the same as a DFlash 2 drafter:
# model.architecture=dflash2 with its default conv / selector sizes), kd50 (train.kd_weight=0.5), kd100
# (kd_weight=1), deep (8 draft layers), anchors2k (2,048 anchors per row), lr1e3 (lr 1e-3), rinit (the drafter's
# layers initialised at random: model.drafter_layer_init=random; the demo copies them from the target since
# 2026-12-03, before which `ce` meant random and `tinit` the copy), decay (the paper's fixed position weights,
# train.position_weights=decay: the demo's until 2026-12-03, when the acceptance-aware `dynamic` weights, after
# D-PACE, became the default), gamma4 (decay, sharper: train.gamma=4 instead of 7 at B=16), dynamic0 (dynamic without
# its floor: train.dynamic_alpha=0), alpha25 (dynamic_alpha=0.25), lr3e3 / lr4e3 / lr8e3 (lr 3e-3, 4e-3, 8e-3), muon (train.optimizer=muon: Muon
# for the matrices, AdamW for the rest, same lr), muon1e3 (muon at lr 1e-3), anchors512 (512 anchors per row: half
# the drafter's work a step, so more, smaller steps in the same minutes), reuse2 (train.steps_per_row=2: two drafter
# steps on each target forward, each with its own anchors), reuse2a512 (the same with 512 anchors), cache (rows fixed
# across epochs and their target features kept on the GPU: train.feature_cache_gb=100, capped at the free memory
# less 8 GiB; side by side, the first run to fill the GPU leaves the others less), anchors (blocks started where
# decoding starts them: train.anchor_sampling=decoding), accum2 (two rows a step: train.accumulate=2, the same lr),
# accum2lr (the same at lr 5.66e-3: the demo's 4e-3 times sqrt 2, the usual rule for Adam at twice the batch), wd01 /
# wd1 (decoupled weight decay 0.01 / 0.1: train.weight_decay, 0 in the demo). The loss
# weightings side by side:
#   PARALLEL=1 bash benchmarks/gpu_variants.sh ce decay gamma4
# v1 against v2 at the same data and budget:
#   PARALLEL=1 TRAIN_MIN=2.5 bash benchmarks/gpu_variants.sh ce v2
# A whole session's plan in one job: variants side by side, then issue #16's benchmarks one after the other:
#   PARALLEL=1 TRAIN_MIN=4 bash benchmarks/gpu_variants.sh regen ce muon anchors512 bench:startup bench:pipeline
set -u
export PYTHONPATH=/tmp/site:${SRC:-/tmp/dflash/src} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=/tmp/dflash
OUT=${OUT:-$S/out}
D=$S/runs/demo-data
TRAIN_MIN=${TRAIN_MIN:-7}
mkdir -p "$OUT"

regen() {
  echo "=== regen ($(date +%T))"
  python3 - <<'EOF'
import logging, os, torch
from dflash_train.demo import build_demo_config, regenerate_demo_data
from dflash_train.models.target import load_tokenizer
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
cfg = build_demo_config(torch.device("cuda"), None, "/tmp/dflash/runs/demo",
                        ["model.target=/tmp/dflash/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "data.source=/tmp/dflash/data/train_chats.jsonl", *os.environ.get("REGEN_ARGS", "").split()])
_, stats = regenerate_demo_data(cfg, load_tokenizer(cfg.model.target))
print("regen stats:", stats)
EOF
  for f in $D/*.jsonl; do gzip -c "$f" > "$OUT/$(basename $f).gz"; done
}

# The demo's training settings (demo.GPU_OVERRIDES) without its data step (the data is regen's) and its clock.
demo_train_overrides() {
  python3 -c 'from dflash_train.demo import GPU_OVERRIDES
skip = ("data.regenerate", "data.self_prompt", "train.max_minutes", "train.epochs",
        "train.checkpoint_every", "train.final_eval_prompts")
print(" ".join(o for o in GPU_OVERRIDES if not o.startswith(skip)))'
}

variant_args() {
  case "$1" in
    ce) echo "" ;;
    v2) echo "model.architecture=dflash2" ;;
    kd50) echo "train.kd_weight=0.5" ;;
    kd100) echo "train.kd_weight=1.0" ;;
    deep) echo "model.num_draft_layers=8" ;;
    anchors2k) echo "train.num_anchors=2048" ;;
    lr1e3) echo "train.lr=1e-3" ;;
    lr3e3) echo "train.lr=3e-3" ;;
    lr4e3) echo "train.lr=4e-3" ;;
    lr8e3) echo "train.lr=8e-3" ;;
    rinit) echo "model.drafter_layer_init=random" ;;
    decay) echo "train.position_weights=decay" ;;
    gamma4) echo "train.position_weights=decay train.gamma=4" ;;
    dynamic0) echo "train.dynamic_alpha=0" ;;
    alpha25) echo "train.dynamic_alpha=0.25" ;;
    muon) echo "train.optimizer=muon" ;;
    muon1e3) echo "train.optimizer=muon train.lr=1e-3" ;;
    anchors512) echo "train.num_anchors=512" ;;
    reuse2) echo "train.steps_per_row=2" ;;
    reuse2a512) echo "train.steps_per_row=2 train.num_anchors=512" ;;
    cache) echo "train.feature_cache_gb=100" ;;
    anchors) echo "train.anchor_sampling=decoding" ;;
    accum2) echo "train.accumulate=2" ;;
    accum2lr) echo "train.accumulate=2 train.lr=5.66e-3" ;;
    wd01) echo "train.weight_decay=0.01" ;;
    wd1) echo "train.weight_decay=0.1" ;;
    *) echo "unknown variant $1" >&2; return 2 ;;
  esac
}

variant() {
  local v=$1 extra run=$S/runs/variant_$1
  extra=$(variant_args "$v") || return 2
  local target
  target=$(ls -d $S/runs/.cache/*-hf2 | head -1)  # the GGUF as converted once by the demo's code
  echo "=== $v ($(date +%T)): $extra"
  # shellcheck disable=SC2046  # the demo's overrides are single words (no spaces), split on purpose
  python3 -m dflash_train.cli train --config smollm2_demo model.target="$target" \
      "data.mix=[$D/regenerated.jsonl,$D/self_regenerated.jsonl]" \
      "pipeline.target_devices=[cuda:0]" "pipeline.drafter_devices=[cuda:0]" run.out_dir=$run run.overwrite=true \
      $(demo_train_overrides) train.epochs=8 train.max_minutes=$TRAIN_MIN train.checkpoint_every=0 \
      data.eval_prompts=yardstick train.final_eval_prompts=80 train.final_eval_new_tokens=256 \
      $extra ${EXTRA:-} > $S/variant_$v.log 2>&1
  grep -v -E "it/s\]|s/it\]" $S/variant_$v.log | grep -E "val |measured|data:|done|rror" | tail -8
  python3 - "$v" "$run" >> "$OUT/variants.txt" <<'EOF'
import json, sys
v, run = sys.argv[1:]
recs = [json.loads(x) for x in open(f"{run}/metrics.jsonl")]
m = [r for r in recs if r.get("split") == "measured"]
val = [r for r in recs if r.get("split") == "val"]
train = [r for r in recs if r.get("split", "train") == "train" and "step" in r]
best = max(val, key=lambda r: r.get("tau_decoding", 0)) if val else {}
steps = train[-1]["step"] if train else None
se = m[-1].get("mean_tau_se") if m else None
se = "" if se is None else f" ± {se:.2f}"
print(f"{v}: yardstick tau {m[-1]['mean_tau']:.2f}{se} speedup {m[-1]['speedup']:.2f}x | val as decoded "
      f"{best.get('tau_decoding', float('nan')):.2f} at step {best.get('step')} of {steps} | {m[-1]['verdict']}" if m
      else f"{v}: no measurement (see the log)")
EOF
  cp $run/metrics.jsonl "$OUT/metrics_$v.jsonl" 2>/dev/null
  cp $run/eval_final/eval.json "$OUT/eval_$v.json" 2>/dev/null  # per prompt: benchmarks/compare_evals.py pairs them
}

# bench:NAME after the variants (it waits for those running side by side): `bench.py --only NAME` within BENCH_S
# seconds (default 420), its JSON and log to $OUT, so that one detached job holds a session's whole GPU plan and no
# idle gap between device calls can cost it.
bench_after() {
  echo "=== bench --only $1 ($(date +%T))"
  rm -rf $S/runs/variant_* /tmp/dflash_bench_* 2>/dev/null  # their files are in $OUT; startup needs ~35 GB of /tmp
  (cd $S && timeout $(( ${BENCH_S:-420} + 60 )) python3 benchmarks/bench.py --only "$1" --budget-s "${BENCH_S:-420}" \
      --json "$OUT/bench_$1.json") > "$OUT/bench_$1.log" 2>&1
  grep -v -E "it/s\]|s/it\]" "$OUT/bench_$1.log" | tail -25
}

pids=()
for v in "$@"; do
  if [ "$v" = regen ]; then regen
  elif [[ $v == bench:* ]]; then
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
    pids=()
    bench_after "${v#bench:}"
  elif [ "${PARALLEL:-0}" = 1 ]; then variant "$v" & pids+=($!); sleep 20  # staggered: the compiles overlap less
  else variant "$v"
  fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
echo "=== done ($(date +%T))"
cat "$OUT/variants.txt"
