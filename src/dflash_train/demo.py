"""`dflash-train demo`: the whole product in one offline command.

  embedded SmolLM2-135M-Instruct + bundled ShareGPT (recipes/smollm2_demo.yaml)
    -> evaluate the random-init drafter (tau before) -> train with the pipeline for --minutes -> evaluate again
    -> one table: tau before/after, lossless verdict, target-only vs speculative tokens/s, training size, wall time

Everything lands in the run directory: the drafter, checkpoints, metrics.jsonl, TensorBoard events, training.png,
eval_before/ and eval_after/ (eval.json + eval.png), demo.json and demo.txt (the table).

The embedded GGUF is converted once into a Hugging Face directory under <out>/../.cache: every GGUF load
dequantizes all tensors and rebuilds the tokenizer (tens of seconds on a CPU), and a run loads the target several
times (tokenizer, sizes, training target, evaluation target). The weights are saved in fp32, exactly as dequantized.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from .config import Config, load_config

log = logging.getLogger("dflash_train")

RECIPE = "smollm2_demo"
# On a GPU the recipe that reached held-out tau 4.2 (recipes/smollm2_gpu2.yaml, docs/BENCHMARKS.md section 11) on one
# shared GPU and a smaller budget: the target first rewrites 8,000 training conversations (all their replies, ~4 min
# at the measured ~24k tokens/s), then 10 minutes of training on 8,192-token rows with 1,024 anchors.
GPU_OVERRIDES = ["data.regenerate=true", "data.max_samples=8000", "data.max_length=2048", "train.token_budget=8192",
                 "train.num_anchors=1024", "train.lr=2e-3", "train.warmup_ratio=0.04", "train.max_steps=15000",
                 "train.max_minutes=10", "train.log_every=100", "model.num_draft_layers=5",
                 "model.target_attention=flex", "model.target_graphs=true"]
# Held-out evaluation: (prompts, new tokens per prompt, longest prompt in tokens) per device type.
EVAL_SIZE = {"cpu": (8, 48, 256), "cuda": (32, 256, 1024)}
HF_CACHE_NAME = "SmolLM2-135M-Instruct-hf"


@dataclasses.dataclass
class DemoResult:
    out_dir: Path
    device: str
    before: dict            # EvalReport.summary() of the random-init drafter
    after: dict             # ... of the trained drafter
    steps: int
    tokens_per_step: int
    train_s: float
    tau_est: float | None   # the training-time estimate at the last logged step
    phases: dict            # seconds per phase
    wall_s: float
    eval_prompts: int
    eval_new_tokens: int

    def table(self) -> str:
        return format_demo_table(self)


def local_embedded_target(cache_root: Path) -> Path:
    """The embedded GGUF as a Hugging Face directory (fp32 safetensors + tokenizer), converted once."""
    from transformers import AutoModelForCausalLM

    from .models.target import load_causal_lm, load_tokenizer

    dest = cache_root / HF_CACHE_NAME
    if (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    log.info(f"converting the embedded SmolLM2 GGUF into {dest} (once; later runs load it in a second)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = load_tokenizer(None)
    gguf = load_causal_lm(None, "cpu", torch.float32)
    # transformers refuses to save a model loaded from GGUF ("quantized with gguf"): the same weights, already
    # dequantized, go into a plain model of the same config instead (logits identical, checked in the tests).
    config = copy.deepcopy(gguf.config)
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(gguf.state_dict(), strict=True)
    hf.generation_config = gguf.generation_config
    hf.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)  # complete or absent: a crash mid-write never leaves a half directory in place
    return dest


def build_demo_config(device: torch.device, minutes: float | None, out: str, overrides: list[str]) -> Config:
    ov = [f"pipeline.target_devices=[{device}]", f"pipeline.drafter_devices=[{device}]", f"run.out_dir={out}",
          "run.overwrite=true"]  # a demo re-run trains afresh in the same directory
    if device.type == "cuda":
        ov += GPU_OVERRIDES
    if minutes is not None:
        ov.append(f"train.max_minutes={minutes}")
    cfg = load_config(RECIPE, ov + list(overrides))
    if cfg.model.target is None:
        cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(out).parent / ".cache"
        cfg = load_config(RECIPE, ov + list(overrides) + [f"model.target={local_embedded_target(cache)}"])
    return cfg


def heldout_prompt_ids(cfg: Config, tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """n prompts from the run's held-out conversations (never trained on), at most max_prompt_tokens long each;
    topped up with built-in prompts when the held-out side has too few."""
    from .errors import UserError
    from .inference.prompts import FALLBACK_PROMPTS, Prompt, heldout_prompts, tokenize_prompts

    ids: list[list[int]] = []
    if cfg.data.source != "synthetic" and cfg.data.heldout_fraction > 0:
        try:  # 4n candidates: the length limit drops some
            prompts = heldout_prompts(cfg.data, tokenizer, 4 * n, cfg.train.seed)
            ids = [p for p in tokenize_prompts(prompts, tokenizer) if len(p) <= max_prompt_tokens][:n]
        except UserError as e:
            log.warning(f"held-out prompts unavailable ({e}); using built-in prompts")
    if len(ids) < n:
        extra = [Prompt("messages", [{"role": "user", "content": t}]) for t in FALLBACK_PROMPTS]
        ids += tokenize_prompts(extra, tokenizer)[: n - len(ids)]
    return ids


@contextlib.contextmanager
def eval_threads(device: torch.device):
    """One intra-op thread for CPU evaluation. Decoding one sequence is launch-bound. Measured on the shared 2-core
    dev machine (SmolLM2): plain decoding 16 tokens/s with 1 or 2 threads, a 16-token verify step 120 ms with 1 and
    93-106 ms with 2; but with 2 threads, whenever another process took a core, every op waited at its thread
    barrier and the same 48-token prompt took 3-23 s instead of ~3 s."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def run_demo(device: str = "auto", minutes: float | None = None, out: str = "runs/demo",
             overrides: list[str] = ()) -> DemoResult:
    from .inference.benchmark import evaluate, stop_token_ids
    from .inference.report import write_report
    from .models.build import build_drafter, init_output_norm
    from .models.checkpoint import load_drafter
    from .models.target import load_target, load_tokenizer, target_config_info
    from .pipeline.coordinator import train_pipeline
    from .devices import parse_device

    t_start = time.perf_counter()
    dev = parse_device(device, "--device")
    cfg = build_demo_config(dev, minutes, out, list(overrides))
    out_dir = Path(cfg.run.out_dir)
    n_prompts, new_tokens, max_prompt = EVAL_SIZE["cuda" if dev.type == "cuda" else "cpu"]
    tokenizer = load_tokenizer(cfg.model.target)
    prompts = heldout_prompt_ids(cfg, tokenizer, n_prompts, max_prompt)
    # The random-init drafter exactly as training builds it (build_run seeds, then sizes it the same way).
    torch.manual_seed(cfg.train.seed)
    init = build_drafter(cfg.model, target_config_info(cfg.model.target), tokenizer)
    target = load_target(cfg.model.target, init.config.target_layer_ids, device=dev, truncate=False)
    if not cfg.model.drafter_init:  # as training starts a fresh drafter (its output gain from the frozen head)
        init_output_norm(init, target.lm_head.weight)
    stop_ids = stop_token_ids(target.hf, tokenizer)
    phases = {"setup": time.perf_counter() - t_start}

    t0 = time.perf_counter()
    log.info(f"demo: evaluating the random-init drafter on {len(prompts)} held-out prompts x {new_tokens} tokens")
    with eval_threads(dev):
        before = evaluate(target, init.to(dev), prompts, new_tokens, stop_ids=stop_ids)
    write_report(before, out_dir / "eval_before")
    phases["eval_before"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = train_pipeline(cfg)
    phases["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log.info(f"demo: evaluating the trained drafter on the same {len(prompts)} prompts")
    with eval_threads(dev):
        after = evaluate(target, load_drafter(result.drafter_dir, dev), prompts, new_tokens, stop_ids=stop_ids)
    write_report(after, out_dir / "eval_after")
    phases["eval_after"] = time.perf_counter() - t0

    n_replicas = len(cfg.pipeline.drafter_devices)
    last = result.history[-1] if result.history else {}
    demo = DemoResult(out_dir, str(dev), before.summary(), after.summary(), result.steps,
                      cfg.train.token_budget * n_replicas, phases["train"], last.get("tau_est"), phases,
                      time.perf_counter() - t_start, len(prompts), new_tokens)
    (out_dir / "demo.json").write_text(json.dumps(dataclasses.asdict(demo), default=str, indent=2) + "\n")
    (out_dir / "demo.txt").write_text(demo.table() + "\n")
    return demo


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _verdict(s: dict) -> str:
    if s["lossless"] is None:
        return "n/a (sampling)"
    return f"{'yes' if s['lossless'] else 'NO'} ({s['identical_prompts']}/{s['num_prompts']} identical)"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def format_demo_table(d: DemoResult) -> str:
    b, a = d.before, d.after
    rows = [
        ("", "before (random init)", "after training"),
        (f"mean tau (B={a['block_size']})", _fmt(b["mean_tau"], ".2f"), _fmt(a["mean_tau"], ".2f")),
        ("lossless (greedy)", _verdict(b), _verdict(a)),
        ("target-only tokens/s", _fmt(b["baseline_tokens_per_s"], ".1f"), _fmt(a["baseline_tokens_per_s"], ".1f")),
        ("speculative tokens/s", _fmt(b["speculative_tokens_per_s"], ".1f"),
         _fmt(a["speculative_tokens_per_s"], ".1f")),
        ("speedup", _fmt(b["speedup"], ".2f", "x"), _fmt(a["speedup"], ".2f", "x")),
    ]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"dflash-train demo on {d.device}: {d.eval_prompts} held-out prompts x {d.eval_new_tokens} new tokens"]
    lines += [f"  {r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]:>20}" for r in rows]
    p = d.phases
    lines.append(f"  training: {d.steps} steps, {d.steps * d.tokens_per_step:,} tokens ({d.tokens_per_step:,} per step) "
                 f"in {_clock(d.train_s)}; tau estimate at the end {_fmt(d.tau_est, '.2f')}")
    lines.append(f"  wall time {_clock(d.wall_s)} (setup {_clock(p['setup'])}, eval before {_clock(p['eval_before'])}, "
                 f"training {_clock(p['train'])}, eval after {_clock(p['eval_after'])}); results in {d.out_dir}")
    return "\n".join(lines)


def run_demo_cli(args) -> int:
    demo = run_demo(args.device, args.minutes, args.out, args.overrides)
    print(demo.table())
    return 0
