#!/usr/bin/env bash
# Multi-process check on a 2-GPU machine (nvidia-h200-x2; torch 2.11, no network, nothing installed):
#   two-procs   torchrun, 2 processes x 1 GPU each (pipeline devices 'auto' = cuda:LOCAL_RANK: target + drafter
#               on the same GPU), NCCL all-reduce of the drafter grads every step
#   one-proc    1 process driving both GPUs: targets [cuda:0, cuda:1], drafters [cuda:0, cuda:1] (threads)
# Same random-init Qwen3-shaped target, data and steps as benchmarks/gpu_pipeline_check.py (reduce-overhead, flex, bf16).
# Prints tokens/s and steps/s of both (global: both GPUs' tokens), the ratio, and whether the replicas stayed identical
# (two-procs: rank 0 and rank 1 compare weight checksums of every step at the end; one-proc: full weights compared).
#
#   Run from the repo root: bash benchmarks/gpu_distributed_check.sh      (about 4-6 minutes)
set -uo pipefail

# Keep NVLink multicast (NVLS) and symmetric-memory multicast off on these machines (see the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
WORK=/tmp/dflash_gpu_distributed_check
STEPS=${STEPS:-30}
LOG_EVERY=5
CASE_TIMEOUT_S=270
mkdir -p "$WORK"

python3 - "$WORK/target" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from gpu_foundation_check import make_target
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", flush=True)
if torch.cuda.device_count() < 2:
    sys.exit("needs 2 GPUs (nvidia-h200-x2)")
if not (Path(sys.argv[1]) / "config.json").is_file():
    make_target(sys.argv[1], layers=8, hidden=1024)
EOF
[ $? -eq 0 ] || exit 1

COMMON=(--config tiny_cpu "model.target=$WORK/target" run.overwrite=true model.block_size=16 model.num_draft_layers=2
        model.num_feature_layers=3 train.token_budget=4096 train.num_anchors=256 "train.max_steps=$STEPS"
        "train.log_every=$LOG_EVERY" train.compile=reduce-overhead train.attention=flex train.dtype=bf16
        data.synthetic_samples=4000 train.checkpoint_every=0 pipeline.stall_timeout_s=180)

echo; echo "=== two-procs: torchrun --nproc-per-node 2, each process: target + drafter on cuda:LOCAL_RANK"
rm -rf "$WORK/two-procs"
timeout "$CASE_TIMEOUT_S" python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m dflash_train.cli train \
  "${COMMON[@]}" "run.out_dir=$WORK/two-procs" "pipeline.target_devices=[auto]" "pipeline.drafter_devices=[auto]" \
  > "$WORK/two-procs.log" 2>&1
echo $? > "$WORK/two-procs.rc"
tail -n 25 "$WORK/two-procs.log" | cut -c1-240

echo; echo "=== one-proc: 1 process, targets [cuda:0,cuda:1], drafters [cuda:0,cuda:1]"
rm -rf "$WORK/one-proc"
timeout "$CASE_TIMEOUT_S" python3 -m dflash_train.cli train "${COMMON[@]}" "run.out_dir=$WORK/one-proc" \
  "pipeline.target_devices=[cuda:0,cuda:1]" "pipeline.drafter_devices=[cuda:0,cuda:1]" > "$WORK/one-proc.log" 2>&1
echo $? > "$WORK/one-proc.rc"
tail -n 15 "$WORK/one-proc.log" | cut -c1-240

python3 - "$WORK" "$LOG_EVERY" "$STEPS" <<'EOF'
import json, sys
from pathlib import Path
work, log_every, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = {}
for case in ("two-procs", "one-proc"):
    rc = int((work / f"{case}.rc").read_text())
    text = (work / f"{case}.log").read_text()
    metrics = work / case / "metrics.jsonl"
    hist = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.is_file() else []
    late = [h for h in hist if h["step"] > log_every]  # the first window holds the pipeline fill
    mean = lambda k: sum(h[k] for h in late) / len(late) if late else float("nan")  # noqa: E731
    done = f"done: {steps} steps" in text
    # two-procs: the end-of-run check across ranks logs this line on both ranks (and raises if they differ);
    # one-proc: the coordinator compares every replica's full weights and raises if they differ.
    identical = (text.count("replicas identical on all 2 ranks") == 2) if case == "two-procs" else (rc == 0 and done)
    rows[case] = dict(rc=rc, ok=rc == 0 and done, tok_s=mean("tokens_per_s"), steps_s=1 / mean("step_time_s") if late
                      else float("nan"), identical=identical,
                      loss=f"{hist[0]['loss']:.2f} -> {hist[-1]['loss']:.2f}" if hist else "-")
print(f"\n{steps} steps, token_budget 4096 per replica, 2 replicas (one per GPU), reduce-overhead, flex, bf16")
print(f"{'case':<10} {'exit':>4} {'verdict':<8} {'tok/s':>10} {'steps/s':>8} {'identical':>9}  loss")
for case, r in rows.items():
    verdict = "PASS" if r["ok"] and r["identical"] else "FAIL"
    print(f"{case:<10} {r['rc']:>4} {verdict:<8} {r['tok_s']:>10,.0f} {r['steps_s']:>8.2f} {r['identical']!s:>9}  {r['loss']}")
a, b = rows["two-procs"]["tok_s"], rows["one-proc"]["tok_s"]
print(f"two-procs / one-proc throughput: {a / b:.2f}" if a == a and b == b and b > 0 else "ratio: n/a")
EOF
