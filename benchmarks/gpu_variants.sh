#!/usr/bin/env bash
# Recipe variants at the same data and budget on one H200, after the GPU demo (benchmarks/gpu_demo.sh) left its
# regenerated data in $S/runs/demo-data/ on the warm machine. Each variant trains from scratch on that data for
# TRAIN_MIN minutes (schedule sized to it), then speculative decoding on the bundled yardstick prompts (another
# source: 80 x 256 tokens); one line per variant (measured tau, speedup, verdict, the validation's best) goes to
# $OUT/variants.txt.
# Start it in its own session and poll (each device call is at most 10 minutes):
#   setsid nohup bash benchmarks/gpu_variants.sh ce kd50 > /tmp/dflash/variants.log 2>&1 < /dev/null &
# Variants: ce (the demo's recipe), kd50 (train.kd_weight=0.5), kd100 (kd_weight=1), deep (8 draft layers),
# anchors2k (2,048 anchors per row).
set -u
export PYTHONPATH=/tmp/site:${SRC:-/tmp/dflash/src} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=/tmp/dflash
OUT=${OUT:-$S/out}
D=$S/runs/demo-data
TRAIN_MIN=${TRAIN_MIN:-4}
mkdir -p "$OUT"
target=$(ls -d $S/runs/.cache/*-hf | head -1)  # the demo's one-time conversion of the GGUF

variant_args() {
  case "$1" in
    ce) echo "" ;;
    kd50) echo "train.kd_weight=0.5" ;;
    kd100) echo "train.kd_weight=1.0" ;;
    deep) echo "model.num_draft_layers=8" ;;
    anchors2k) echo "train.num_anchors=2048" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}

for v in "$@"; do
  extra=$(variant_args "$v") || exit 2
  run=$S/runs/variant_$v
  echo "=== $v ($(date +%T)): $extra"
  python3 -m dflash_train.cli train --config smollm2_demo model.target="$target" \
      "data.mix=[$D/regenerated.jsonl,$D/self_regenerated.jsonl]" data.max_samples=null data.max_length=2048 \
      "pipeline.target_devices=[cuda:0]" "pipeline.drafter_devices=[cuda:0]" run.out_dir=$run run.overwrite=true \
      train.token_budget=8192 train.num_anchors=1024 train.lr=2e-3 train.warmup_ratio=0.04 train.max_steps=null \
      train.epochs=8 train.max_minutes=$TRAIN_MIN train.budget_steps_per_s=29 train.log_every=100 \
      train.eval_every=500 train.eval_rows=4 train.checkpoint_every=0 model.num_draft_layers=5 \
      model.target_attention=flex model.target_graphs=true data.eval_prompts=yardstick train.final_eval_prompts=80 \
      train.final_eval_new_tokens=256 $extra 2>&1 | grep -v -E "it/s\]|s/it\]" | grep -E "val |measured|data:|done|rror"
  python3 - "$v" "$run" >> "$OUT/variants.txt" <<'EOF'
import json, sys
v, run = sys.argv[1:]
recs = [json.loads(x) for x in open(f"{run}/metrics.jsonl")]
m = [r for r in recs if r.get("split") == "measured"]
val = [r for r in recs if r.get("split") == "val"]
best = max(val, key=lambda r: r.get("tau_decoding", 0)) if val else {}
print(f"{v}: yardstick tau {m[-1]['mean_tau']:.2f} speedup {m[-1]['speedup']:.2f}x | val as decoded "
      f"{best.get('tau_decoding', float('nan')):.2f} at step {best.get('step')} | {m[-1]['verdict']}" if m else
      f"{v}: no measurement (see the log)")
EOF
  cp $run/metrics.jsonl "$OUT/metrics_$v.jsonl" 2>/dev/null
done
cat "$OUT/variants.txt"
