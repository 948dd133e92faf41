#!/usr/bin/env bash
# The README's GPU demo on one H200 (torch 2.11, no network, at most 64 MiB carried and 10 minutes per call),
# run from the repo root in back-to-back device calls on one warm machine:
#   stage    carry .gpu/a .gpu/data .gpu/whl (one call: ~62 MB with the ~5.6 MB tree, of 64 MiB): stage the first
#            half of the GGUF, the ShareGPT chats (replies blanked, written here by `PYTHONPATH=src python3
#            benchmarks/gpu_data.py`) and the gguf wheel under /tmp. The tree stays small because docs/gpu-runs keeps
#            its large records gzipped (tests/test_repo_size.py); gzip -9 -n new ones over 50 KB before committing
#   check    stage, then the GPU checks that need no real weights: a tiny pipeline with validation and the measurement
#            after training (reduce-overhead steps in worker threads, flex target as a CUDA graph), and the
#            `generate` benchmark (continuous batching vs static batches, SmolLM2 shape, random weights)
#   check_tiny  the tiny pipeline alone (no staging needed: a random tiny Llama target)
#   check2   the tiny pipeline with a DFlash 2 drafter (model.architecture=dflash2)
#   check_cache   the tiny pipeline with train.feature_cache_gb, with every row in host memory
#                 (train.feature_cache_host_gb), and against the same fixed rows with nothing kept
#   cache_speed   the demo's training settings (benchmarks/gpu_windows.py: SmolLM2 shape, random weights, synthetic
#                 rows) with every row's features kept on the GPU, every row in host memory, and nothing kept:
#                 tokens/s after the first epoch (CACHE_STEPS steps each, default 1200; CACHE_WHERE, default
#                 "device host none", picks among them; CACHE_EXTRA adds overrides, e.g. "train.profile_after=800
#                 train.profile_steps=20": a profiler trace of 20 steps after the first epoch, kernels_<where>.txt
#                 and trace_<where>.json.gz to $OUT)
#   check_val     the tiny pipeline with validation through the training graph, then through its own (same numbers)
#   check_flex    the engine's flex decode attention, folded and grouped, timed; the engine in a worker thread
#   check_anchors the tiny pipeline with train.anchor_sampling=decoding (anchors drawn on the device)
#   check_compile the drafter's flex attention (fwd + bwd, Qwen3-8B shape) compiled cold, per kernel-option set
#                 (COMPILE_SETS, default the kernel-option sets of benchmarks/gpu_flex_compile.py; its sets step and
#                 step_sdpa compile the whole training step instead; COMPILE_SET_S seconds at most a set, COMPILE_S
#                 for all), each kernel's compile timed
#   check_target  the compiled target forward against eager per compile / graph setting, each-layer compile included
#                 (benchmarks/gpu_target_compile_check.py; no staging needed)
#   flex_demo  the demo drafter's flex attention alone, one layer fwd + bwd, per mask variant and backward launch
#              setting (no staging needed; PROBE_S seconds at most, default 300; PROBE_VARIANTS names some, e.g.
#              "tiles64 bwd_w4 autotune")
#   profile_drafter  the demo's drafter step alone (benchmarks/gpu_profile.py drafter, v1): ms a step with CUDA graphs
#                    and without, the compiled step's top kernels (PROFILE_MODES="reduce-overhead eager": eager's;
#                    PROFILE_TILES="product default sparse64": the step with flex's own tile sizes too, and
#                    with the mask's tiles 64 wide (objective.DRAFTER_MASK_TILE), each compiled afresh;
#                    PROFILE_LOSS_CHUNKS="default 512": with 512-row loss chunks too)
#   start    carry .gpu/b: join the GGUF, start `dflash-train demo --device cuda` in its own session (setsid), return
#   variants carry .gpu/b: join the GGUF, start benchmarks/gpu_variants.sh (regen, then VARIANTS side by side)
#   poll     wait until the demo ends or POLL_S seconds (default 500) pass, then the demo log's last lines (issue the
#            next call at once: a machine idle for 30 s is given back, and the demo with it)
#   finish   the demo's last poll and what follows, in one call so that no idle gap can lose the machine: wait for
#            the demo to end (at most POLL_S), collect, then `bench` with what is left of FINISH_S (default 560;
#            BENCH picks the benchmark: BENCH=generate for the regeneration row of record, ~120 s on an H100; no
#            bench while the demo still runs: then poll or finish again at once)
#   vpoll / vcollect   the same for the variants (variants.txt, the regenerated data gzipped, and variants_files.tgz:
#            logs, metrics_<variant>.jsonl, bench JSON)
#   eval_batched  no staging (carry .gpu/tok): the evaluator's untimed prompts one at a time and together on a
#            random SmolLM2-shaped target, fp32 then bf16, timed (benchmarks/eval_batched.py)
#   eval_rows  after the demo: its drafter on the yardstick with the untimed prompts decoded together (EVAL_ROWS) and
#            one at a time, timed, the same tokens? (benchmarks/eval_batched.py --drafter)
#   collect  the demo's table, logs, metrics and eval reports into $OUT
#   bench    after the demo, on the same machine: issue #16's Qwen3-8B benchmarks named in BENCH (default startup:
#            command -> first step, cold then warm; or pipeline), within BENCH_S seconds (default 500), JSON to $OUT.
#            A cold start at Qwen3-8B's shape takes 304-496 s, so cold and warm take two calls: set
#            DFLASH_STARTUP_DIR=/tmp/dflash_startup in both (the second finds the cold run done and times the warm one)
# The GGUF halves: `split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf` into .gpu/a and .gpu/b (git-ignored).
set -u
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=/tmp/dflash
OUT=${OUT:-/tmp/out}
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
banner() { echo; echo "=== $1 ($(date +%T))"; }
# detach LOG CMD...: CMD in its own session (it outlives the device call), output to LOG, its pid to LOG.pid, run
# from /tmp, and no descriptor inherited but 0-2. `setsid nohup CMD > LOG 2>&1 &` is not enough here: bash keeps a copy of the call's
# output pipe (fd 251, from `... | tee` below), the child inherits it, and the device call then waits for the whole
# demo (the `start` calls of 2026-12-02 and -03 ran into their time limits without output).
detach() {
  python3 -c 'import subprocess, sys
p = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True, cwd="/tmp")
open(sys.argv[1] + ".pid", "w").write(str(p.pid))' "$@"
}

# wait_for LOG SECONDS: sleep until the job detached with LOG has ended, or SECONDS have passed. A poll that sleeps
# its full time after the job ended wastes device time, and one that returns while the job still runs leaves a gap
# before the next call in which the machine may be given back (30 s idle), the job with it.
wait_for() {
  local end=$(( SECONDS + $2 ))
  while (( SECONDS < end )) && running "$1"; do sleep 5; done
  running "$1" && echo "(still running after $2 s)" || echo "(ended)"
}
running() { kill -0 "$(cat "$1.pid" 2>/dev/null)" 2>/dev/null; }  # running LOG: the job detached with LOG runs

stage() {
  banner "staging"
  # Whatever this call carried (all three in one call since the records in docs/gpu-runs are gzipped; a second
  # `stage` with the rest still works if a call cannot carry them all).
  mkdir -p $S/data
  if [[ -f .gpu/a/ggufpart00 ]]; then cp .gpu/a/ggufpart00 $S/; fi
  if [[ -f .gpu/data/train_chats.jsonl.gz ]]; then
    gunzip -c .gpu/data/train_chats.jsonl.gz > $S/data/train_chats.jsonl
  fi
  if compgen -G ".gpu/whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
  fi
  ls -la $S $S/data
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
}

tiny_llama() {
  python3 - <<'EOF'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
                             tie_word_embeddings=False)).save_pretrained("/tmp/tiny_llama")
EOF
}

# The tiny pipeline on the GPU (validation + measurement after training, reduce-overhead steps in worker threads,
# compiled flex target as a CUDA graph, on a cold cache the precompile child); $1 = run directory, the rest = extra
# overrides.
tiny_run() {
  local run=$1; shift
  tiny_llama
  timeout 300 python3 -m dflash_train.cli train --config tiny_cpu model.target=/tmp/tiny_llama run.out_dir=$run \
      run.overwrite=true "pipeline.target_devices=[cuda:0]" "pipeline.drafter_devices=[cuda:0]" \
      train.compile=reduce-overhead train.attention=flex train.dtype=bf16 model.target_attention=flex \
      model.target_graphs=true model.target_compile=default data.heldout_fraction=0.1 train.max_steps=60 \
      train.eval_every=20 \
      train.final_eval_prompts=4 train.final_eval_new_tokens=32 train.compile_times=true "$@" 2>&1 \
      | grep -v -E "it/s\]|s/it\]" > $run.log
  # the start-up (the precompile child on a cold cache, each stage's compile time), then the run's end
  grep -E "precompile|ready in|first step|compile_inner|bw_compiler|async_compile.wait" $run.log; tail -14 $run.log
}

check() {
  stage
  check_tiny
  banner "generate benchmark: continuous batching vs static batches (SmolLM2 shape, random weights)"
  timeout 240 python3 benchmarks/bench.py --only generate --budget-s 200 2>&1 | tail -22
}

check_tiny() {
  banner "tiny pipeline on the GPU"
  tiny_run /tmp/tinyrun
}

check2() {
  banner "tiny pipeline on the GPU, DFlash 2 drafter"
  tiny_run /tmp/tinyrun2 model.architecture=dflash2
}

# train.feature_cache_gb on the GPU (CUDA graphs, flex, the shared GPU's streams): the tiny pipeline over several
# epochs with the rows' features kept, then with the same fixed rows and nothing kept; the two logs' summaries.
check_cache() {
  banner "tiny pipeline on the GPU: feature cache on the device, in host memory, then fixed rows with nothing kept"
  tiny_run /tmp/tinycache data.synthetic_samples=48 train.feature_cache_gb=1
  tiny_run /tmp/tinyhost data.synthetic_samples=48 train.feature_cache_gb=0.000001 train.feature_cache_host_gb=1
  tiny_run /tmp/tinynocache data.synthetic_samples=48 train.feature_cache_gb=0.000001
  for r in /tmp/tinycache /tmp/tinyhost /tmp/tinynocache; do
    echo "--- $r"; grep -E "feature cache|peak GPU memory|rows of .* tokens per epoch|val +60/|done:" $r.log
  done
}

cache_speed() {
  local steps=${CACHE_STEPS:-1200} tiny=train.feature_cache_gb=0.000001 where
  declare -A how=([device]="train.feature_cache_gb=100" [host]="$tiny train.feature_cache_host_gb=40" [none]="$tiny")
  for where in ${CACHE_WHERE:-device host none}; do
    set -- $where ${how[$where]}
    banner "feature cache: $1"; shift
    rm -rf /tmp/dflash_windows/run/profile
    timeout 400 python3 benchmarks/gpu_windows.py "$steps" model.num_draft_layers=8 train.eval_every=0 \
        train.checkpoint_every=0 "$@" ${CACHE_EXTRA:-} 2>&1 | grep -E "rows .*per epoch|median|feature cache|within 3%|Error"
    grep -E "feature cache|peak GPU|profile of steps" /tmp/dflash_windows/train.log | tail -4
    if [[ -f /tmp/dflash_windows/run/profile/kernels.txt ]]; then  # CACHE_EXTRA="train.profile_after=N ..."
      mkdir -p "$OUT" && cp /tmp/dflash_windows/run/profile/kernels.txt "$OUT/kernels_$where.txt"
      gzip -c /tmp/dflash_windows/run/profile/trace.json > "$OUT/trace_$where.json.gz"
    fi
  done
}

# train.validation_graph on the GPU (reduce-overhead CUDA graphs in worker threads, validation every 20 of 60 steps
# between training steps): through the training step's graph (the default), then through a graph of its own; the
# two runs should train the same steps and read the same validation, up to the two graphs' bf16 rounding.
check_val() {
  banner "tiny pipeline on the GPU: validation through the training graph, then through its own"
  tiny_run /tmp/tinyval_training train.validation_graph=training
  tiny_run /tmp/tinyval_own train.validation_graph=own
  python3 - <<'EOF2'
import json
runs = {g: [json.loads(x) for x in open(f"/tmp/tinyval_{g}/metrics.jsonl")] for g in ("training", "own")}
for kind in ("train", "val"):
    for g, recs in runs.items():
        rows = [(r["step"], round(r["loss"], 4)) for r in recs if r.get("split") == kind and "loss" in r]
        print(f"{kind:5s} {g:8s}", rows[-4:])
EOF2
}

# train.anchor_sampling=decoding on the GPU (the target's token probabilities in its compiled, graphed forward;
# anchors drawn on the device in the drafter's thread, reduce-overhead step): the tiny pipeline.
check_anchors() {
  banner "tiny pipeline on the GPU: anchors drawn where the target was unsure (train.anchor_sampling=decoding)"
  tiny_run /tmp/tinyanchors train.anchor_sampling=decoding
}

# The engine's flex decode attention on the GPU (benchmarks/gpu_flex_check.py): the grouped query heads as rows and
# as grouped heads against fp32 SDPA, each timed (TB/s of K/V read), then the engine in a worker thread.
check_flex() {
  banner "flex decode attention and the engine in a thread"
  # inductor's autotune tables (12 lines a kernel) left out: on 2026-12-04 they pushed the folded line out of a tail
  timeout 300 python3 benchmarks/gpu_flex_check.py 2>&1 |
    grep -v -E "it/s\]|s/it\]|^Autotune Choices|^\{\"num_choices|^AUTOTUNE|^strides:|^dtypes:|^  triton_|^SingleProcess" | tail -12
}

check_compile() {
  banner "the drafter's flex attention compiled cold at the Qwen3-8B shape, per kernel-option set"
  # Streamed, not tailed: on 2026-12-06 a call cut at its limit (the session's device time) returned nothing of a
  # `| tail -60` that had not ended. The probe prints only the kernels that took >= 1 s, so the output stays short.
  timeout ${COMPILE_S:-480} python3 benchmarks/gpu_flex_compile.py ${COMPILE_SETS:-} 2>&1 |
    grep --line-buffered -v -E "it/s\]|s/it\]"
}

# The pipeline's compiled target forward on the GPU (benchmarks/gpu_target_compile_check.py): each compile and CUDA
# graph setting, model.target_compile_layers included, against eager, in a thread named like the target worker.
check_target() {
  banner "the compiled target forward: against eager, no recompile across layouts, per setting"
  timeout ${CHECK_TARGET_S:-300} python3 benchmarks/gpu_target_compile_check.py 2>&1 |
    grep --line-buffered -v -E "it/s\]|s/it\]|^Autotune Choices|^\{\"num_choices|^AUTOTUNE|^strides:|^dtypes:|^  triton_|^SingleProcess"
}

profile_drafter() {
  banner "the demo's drafter step (8 layers, 8,192 x 1,024 x 16): time per mode, the compiled step's kernels"
  # streamed (a cut call still returns what ran); the whole output is in gpu_demo.log
  PROFILE_ARCHS=dflash timeout ${PROFILE_S:-150} python3 benchmarks/gpu_profile.py drafter 2>&1 |
    grep --line-buffered -v -E "it/s\]|s/it\]|UserWarning|return node.target"
}

flex_demo() {
  banner "the demo drafter's flex attention, one layer, per mask variant (benchmarks/gpu_flex_demo_attention.py)"
  timeout ${PROBE_S:-300} python3 benchmarks/gpu_flex_demo_attention.py ${PROBE_VARIANTS:-} 2>&1 |
    grep --line-buffered -v -E "UserWarning|warnings.warn|_warn_once"
}

join() {
  # A machine idle for 30 s is given back, and with it what `stage` left under /tmp: say so instead of starting
  # nothing (on 2026-12-04 a `start` after such a gap printed four errors and returned 0).
  if [[ ! -f $S/ggufpart00 || ! -f $S/data/train_chats.jsonl ]]; then
    echo "nothing staged on this machine (a fresh one: the last was given back after 30 s idle); run stage first"
    exit 3
  fi
  cat $S/ggufpart00 .gpu/b/ggufpart01 > $GGUF && md5sum $GGUF
  # The working tree is laid anew at every call: the jobs run from their own copy of the source.
  rm -rf $S/src $S/benchmarks && cp -r src $S/src && cp -r benchmarks $S/benchmarks
}

variants() {
  banner "start the variants: regen ${VARIANTS:-ce kd50 kd100}"
  join
  # OUT=$S/out: the job outlives this call, whose $OUT the device machine empties at the next one (the variants'
  # table of 2026-12-03 was lost that way); vpoll/vcollect copy $S/out into each call's $OUT.
  detach $S/variants.log env OUT=$S/out PARALLEL=${PARALLEL:-1} TRAIN_MIN=${TRAIN_MIN:-7} \
      bash $S/benchmarks/gpu_variants.sh regen ${VARIANTS:-ce kd50 kd100}
  sleep 45; tail -5 $S/variants.log
}

start() {
  banner "start the demo"
  # A start repeated after a call that seemed to fail: a second demo (and join replacing $S/src under the first)
  if running $S/demo.log; then echo "a demo already runs (pid $(cat $S/demo.log.pid)): poll it instead"; return; fi
  join
  # TOKENIZERS_PARALLELISM unset, as a user runs it: the demo tokenizes ~76k conversations in parallel.
  detach $S/demo.log env -u TOKENIZERS_PARALLELISM PYTHONPATH=/tmp/site:$S/src PYTHONUNBUFFERED=1 \
      python3 -m dflash_train.cli demo --device cuda --out $S/runs/demo model.target=$GGUF \
      data.source=$S/data/train_chats.jsonl ${DEMO_ARGS:-}
  sleep 45; grep -v -E "it/s\]|s/it\]" $S/demo.log | tail -8
}

poll() {
  wait_for $S/demo.log "${POLL_S:-500}"
  collect > /dev/null  # what ran so far (log, finished evaluations) comes back even if the lease ends
  grep -v -E "it/s\]|s/it\]" $S/demo.log | grep -v "^.*step .*tok/s" | tail -12
  grep -E "^.* step " $S/demo.log | tail -3
}

vpoll() {
  wait_for $S/variants.log "${POLL_S:-500}"
  vcollect > /dev/null  # what ran so far (variants.txt, metrics, bench JSON) comes back even if the lease ends
  tail -4 $S/variants.log
  for f in $S/variant_*.log; do echo "-- $f"; grep -E " step |val " $f | tail -2; done 2>/dev/null
}

# A device call brings back only a few files (8 on 2026-12-03; the rest "left out"): the table and the regenerated
# data (three gzipped files) come as they are, everything else in one archive (the job's log, the variants' logs and
# metrics, the benchmarks' JSON and logs).
vcollect() {
  mkdir -p "$OUT"
  cp $S/out/variants.txt $S/out/*.jsonl.gz "$OUT/" 2>/dev/null
  tar -czf "$OUT/variants_files.tgz" -C $S variants.log $(cd $S && ls variant_*.log 2>/dev/null) \
      $(cd $S && ls out/* 2>/dev/null | grep -v -E "variants.txt|jsonl.gz") 2>/dev/null
  cat $S/out/variants.txt 2>/dev/null
}

bench() {
  banner "bench --only ${BENCH:-startup}"; mkdir -p "$OUT"
  rm -rf $S/runs/variant_* /tmp/dflash_bench_* 2>/dev/null  # the startup runs need ~35 GB of /tmp
  # Streamed, not tailed at the end: a call stopped at its limit still returns what ran (the JSON is rewritten after
  # each row, the whole log is in $OUT).
  timeout $(( ${BENCH_S:-500} + 60 )) python3 benchmarks/bench.py --only "${BENCH:-startup}" --budget-s "${BENCH_S:-500}" \
      --json "$OUT/bench_${BENCH:-startup}.json" 2>&1 | grep --line-buffered -v -E "^    \| .*(it/s\]|s/it\])" \
      | tee "$OUT/bench_${BENCH:-startup}.log" | grep --line-buffered -v -E "^    \| (.*(Loading|Writing)|\s*$)"
}

finish() {
  local t0=$SECONDS
  poll
  collect
  local left=$(( ${FINISH_S:-560} - (SECONDS - t0) - 90 ))  # 90 s: the bench's own start and timeout margin
  # Not beside a demo that still runs (after POLL_S): the bench would time against the demo's evaluation and slow it
  if running $S/demo.log; then echo "the demo still runs: no bench; poll or finish again at once"
  elif (( left > 120 )); then BENCH_S=$left bench; else echo "no time left for a bench ($left s)"; fi
}

# No staging needed (carry .gpu/tok: SmolLM2's config and tokenizer): `evaluate` on a random model of SmolLM2's shape
# with a random drafter (tau 1: every prompt takes all its steps), the untimed prompts decoded one at a time and
# EVAL_ROWS (default 32) at a time, in fp32 (the same tokens?) then bf16 (the evaluator's dtype on a GPU: the times);
# EVAL_PROMPTS prompts (default 33: one timed, the rest one batch) x 256 new tokens (benchmarks/eval_batched.py).
eval_batched() {
  local dtype
  for dtype in fp32 bf16; do
    banner "evaluate on a random SmolLM2-shaped target ($dtype): untimed prompts one at a time and together"
    timeout 220 python3 benchmarks/eval_batched.py "${EVAL_PROMPTS:-33}" 256 "${EVAL_ROWS:-32}" --device cuda \
        --target random:.gpu/tok --dtype $dtype --repeats 1 2>&1 | grep -v -E "it/s\]|s/it\]|Warning|warn"
  done
}

# After a demo on the same machine: its drafter measured on the yardstick as the demo measures it (80 x 256, 16
# timed, bf16), the untimed prompts decoded one at a time and EVAL_ROWS (default 32) at a time, each evaluation
# timed, and whether both gave the same tokens and acceptance lengths (benchmarks/eval_batched.py --drafter).
eval_rows() {
  local d
  d=$(grep -o "servable drafter in [^ ]*" $S/demo.log 2>/dev/null | tail -1 | cut -d' ' -f4)
  if [[ -z $d ]]; then echo "no servable drafter named in $S/demo.log: the demo has not finished its training"; return; fi
  # The line comes before the demo's own evaluation (~90 s): wait for it rather than time both against each other
  if running $S/demo.log && [[ $(wait_for $S/demo.log 150) != "(ended)" ]]; then
    echo "the demo still evaluates after 150 s more: run eval_rows again"; return
  fi
  banner "the demo's drafter ($d) on the yardstick: untimed prompts one at a time and together"
  timeout 400 python3 benchmarks/eval_batched.py 80 256 "${EVAL_ROWS:-32}" --device cuda --target $GGUF \
      --drafter "$d" --dtype bf16 --timed 16 --repeats 1 2>&1 | grep -v -E "it/s\]|s/it\]|Warning|warn"
}

# A call brings back 8 files at most (gpu_demo.log, written by this script, is one): demo.log, demo.txt and the two
# evaluations as they are, the rest (demo.json, training.png, metrics.jsonl, validation_replies.json, the warm-up
# child's log) in extras.tgz, so that finish's bench JSON and log fit beside them.
collect() {
  mkdir -p "$OUT"
  local r=$S/runs/demo
  cp $S/demo.log "$OUT/" 2>/dev/null
  cp $r/demo.txt "$OUT/" 2>/dev/null
  # demo-p's metrics.jsonl and validation_replies.json, then files of their own, did not come back from finish
  tar -czf "$OUT/extras.tgz" -C / $(ls $r/demo.json $r/training.png $r/metrics.jsonl $r/validation_replies.json \
      $S/runs/demo-data/compile_warmup.log 2>/dev/null | sed 's|^/||') 2>/dev/null
  for e in yardstick heldout; do cp $r/eval_$e/eval.json "$OUT/eval_$e.json" 2>/dev/null; done
  cat $r/demo.txt 2>/dev/null
}

for s in "${@:-check}"; do "$s"; done 2>&1 | tee -a "$OUT/gpu_demo.log"
