"""Log windows of the GPU demo's training, without its data step (issue #16, 'no stalls'): every window of
train.log_every steps against the median, and what each slow one held (a validation, a checkpoint, an epoch
boundary).

The demo's training settings (demo.py GPU_OVERRIDES: 8,192-token rows, 1,024 anchors, flex target
as a compiled CUDA graph, reduce-overhead drafter step, validation every 500 steps, a checkpoint every 1,000 here;
5 draft layers, where the demo has 8: `cache_speed` passes model.num_draft_layers=8)
on a random-init SmolLM2-shaped target and the synthetic source, whose short epochs (~240 rows) put an epoch
boundary in every few windows. Weights do not change the speed of a step; document lengths do: the drafter's
attention visits every tile of an anchor's context, so the synthetic documents are as long as the demo's on average
(50-500 tokens, ~275; its chats average ~276). Before 2026-12-07 they were 200-1800 tokens, twice the attention
tiles (1,007 against 507 a layer), and a step 1.21x slower (28.4 against 23.5 ms on an H100, `cache_speed`
with each length, docs/gpu-runs/2026-12-07-h100-s/): the "pipeline overhead" earlier notes saw against the
drafter's step alone was that.

  Run (from the repo root of a GPU machine): PYTHONPATH=src python3 benchmarks/gpu_windows.py [steps [key=value ...]]
    (overrides after the steps, e.g. train.feature_cache_host_gb=40: `gpu_demo.sh cache_speed` compares where the
    feature cache keeps its rows by the windows after the first epoch)
  Read a finished run instead (any machine), e.g. the GPU demo's records:
    python3 benchmarks/gpu_windows.py --run docs/gpu-runs/2026-12-03-demo-f/metrics.jsonl.gz \
        docs/gpu-runs/2026-12-03-demo-f/demo.log.gz 500 2000     # its eval_every and checkpoint_every
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from records import open_record

WORK = Path("/tmp/dflash_windows")
LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY = 100, 500, 1000


def smollm2_shaped_target(path: Path) -> str:
    if os.environ.get("SMOKE"):
        path = path.with_name("tiny_target")
        if not (path / "config.json").is_file():
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=128)).save_pretrained(path)
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                     max_position_embeddings=8192, tie_word_embeddings=True,
                                     rope_theta=100000.0)).save_pretrained(path)
    return str(path)


def train(steps: int, overrides: list[str] = ()) -> Path:
    out = WORK / "run"
    args = [sys.executable, "-m", "dflash_train.cli", "train", "--config", "smollm2_demo",
            f"model.target={smollm2_shaped_target(WORK / 'target')}", f"run.out_dir={out}", "run.overwrite=true",
            "data.source=synthetic", "data.synthetic_samples=7000", "data.synthetic_min_len=50",
            "data.synthetic_max_len=500", "data.max_length=2048", "data.max_samples=null",
            "data.heldout_fraction=0.02", "train.token_budget=8192", "train.num_anchors=1024", "train.lr=2e-3",
            f"train.max_steps={steps}", "train.max_minutes=null", f"train.log_every={LOG_EVERY}",
            f"train.eval_every={EVAL_EVERY}", "train.eval_rows=4", f"train.checkpoint_every={CHECKPOINT_EVERY}",
            "train.final_eval_prompts=0", "model.num_draft_layers=5", "model.target_attention=flex",
            "model.target_graphs=true", "model.target_compile=default", "pipeline.target_devices=[cuda:0]",
            "pipeline.drafter_devices=[cuda:0]", *overrides]
    if os.environ.get("SMOKE"):  # the flow on a CPU in seconds: tiny shapes, nothing CUDA-only (no figures)
        args = [a for a in args if not a.startswith(("train.token_budget", "train.num_anchors", "model.target_",
                                                     "pipeline.", "model.num_draft_layers", "data.synthetic_"))]
        args += ["train.token_budget=512", "train.num_anchors=32", "model.num_draft_layers=1",
                 "data.synthetic_samples=200", "data.synthetic_max_len=96"]
    with open(WORK / "train.log", "w") as log:
        subprocess.run(args, check=True, stdout=log, stderr=subprocess.STDOUT)
    return out


def report(metrics: Path, log: Path, eval_every: int = EVAL_EVERY, checkpoint_every: int = CHECKPOINT_EVERY) -> None:
    with open_record(metrics) as f:
        recs = [json.loads(x) for x in f]
    train = [r for r in recs if r.get("split", "train") == "train" and "tokens_per_s" in r]
    with open_record(log) as f:
        found = re.search(r"(\d+) rows of \d+ tokens per epoch", f.read())
    rows_per_epoch = int(found.group(1)) if found else None
    print(f"{rows_per_epoch} rows (steps) per epoch")
    # Every window counts: since MetricsLogger.start_window the first holds steps 2-100, not the start-up (records
    # from before 2026-12-03's session 14 show their first window ~-93%: it held the compile and the captures).
    windows = train
    med = statistics.median(r["tokens_per_s"] for r in windows)
    print(f"median {med:,.0f} tokens/s over {len(windows)} windows of {LOG_EVERY} steps")
    within = [r for r in windows if abs(r["tokens_per_s"] / med - 1) <= 0.03]
    print(f"within 3% of the median: {len(within)} of {len(windows)}")
    if rows_per_epoch:  # with a feature cache the later epochs run fewer target forwards than the first
        for name, part in (("first epoch", [r for r in windows if r["step"] <= rows_per_epoch]),
                           ("after the first epoch", [r for r in windows if r["step"] - LOG_EVERY >= rows_per_epoch])):
            if part:
                part_med = statistics.median(r["tokens_per_s"] for r in part)
                near = sum(abs(r["tokens_per_s"] / part_med - 1) <= 0.03 for r in part)
                print(f"{name}: median {part_med:,.0f} tokens/s over {len(part)} windows, {near} of them within 3% "
                      "of it")
    print("step | tokens/s | vs median | validation s left out | what the window held")
    for r in windows:
        dev = r["tokens_per_s"] / med - 1
        held = []
        first = r["step"] - LOG_EVERY
        # A validation or a checkpoint at step s runs after step s is logged: in the window that starts there.
        if first % eval_every == 0 and first > 0:
            held.append("validation")
        if first % checkpoint_every == 0 and first > 0:
            held.append("checkpoint")
        if rows_per_epoch and any(first < s <= r["step"] for s in range(rows_per_epoch, r["step"] + 1,
                                                                        rows_per_epoch)):
            held.append("epoch boundary")
        if abs(dev) > 0.03 or held:
            print(f"{r['step']} | {r['tokens_per_s']:,.0f} | {dev:+.1%} | {r.get('excluded_s', 0.0):.2f} | "
                  f"{', '.join(held) or '-'}")
    if any("gc_s" in r for r in windows):
        print(f"garbage collection: {sum(r.get('gc_s', 0.0) for r in windows):.2f} s in all, the most in one window "
              f"{max(r.get('gc_s', 0.0) for r in windows):.3f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        metrics, log, *every = sys.argv[2:]
        report(Path(metrics), Path(log), *map(int, every))
    else:
        WORK.mkdir(parents=True, exist_ok=True)
        out = train(int(sys.argv[1]) if len(sys.argv) > 1 else 3000, sys.argv[2:])
        report(out / "metrics.jsonl", WORK / "train.log")
