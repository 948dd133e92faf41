"""`dflash-train demo`: the whole product in one offline command.

  embedded SmolLM2-135M-Instruct + bundled ShareGPT (recipes/smollm2_demo.yaml)
    GPU: the target rewrites every ShareGPT answer and answers prompts it writes itself (data.self_prompts), for at
         most data.regenerate_minutes -> train with the pipeline for a few epochs of that data, validating as it goes
         -> measure the best drafter on the bundled yardstick prompts (another source) and on held-out ShareGPT
    CPU: a wiring check: every stage end to end at a size a 2-core machine runs in minutes
    -> one table: measured tau, speedup and lossless verdict per prompt set, next to the estimates; data volume and
       epochs; wall time per phase

The regenerated data lives beside the run directory (<out>-data/), so a second demo run reuses it (regeneration
resumes where it stopped); the run directory itself is moved aside on a re-run (run.overwrite). Everything else
lands in the run directory: the drafter (best validation step), drafter_last/, checkpoints, metrics.jsonl,
TensorBoard events, training.png, eval_<set>/ (eval.json + eval.png), demo.json and demo.txt (the table).

The embedded GGUF (or a model.target=X.gguf) is converted once into a Hugging Face directory under <out>/../.cache: every GGUF load
dequantizes all tensors and rebuilds the tokenizer (tens of seconds on a CPU), and a run loads the target several
times (tokenizer, sizes, regeneration, training target, evaluation target). The weights are saved in fp32, exactly
as dequantized.
"""

from __future__ import annotations

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
from .errors import UserError
from .training.rundir import make_dir

log = logging.getLogger("dflash_train")

RECIPE = "smollm2_demo"
# One H200: ~4 minutes of regeneration (the first answer of every ShareGPT conversation, then 100,000 prompts the
# target writes itself; at most 7 minutes; 4:15 in demo-m, 2026-12-04) while a child process compiles the training
# step (training/warmup.py), then what the 20 minutes leave to training (~12 minutes, training_deadline; 11.98 in
# demo-n on an H100), its LR schedule following the clock (training/optim.py, follows_clock) over at most 10 epochs
# of the data (5.9 in demo-n); the drafter's 8 layers start as copies of the target's last ones
# (model.drafter_layer_init); 8,192-token rows with 1,024 anchors, the target's forward compiled and replayed as a
# CUDA graph (flex attention), validation every 500 steps on 4 held-out rows. The first epoch's rows
# keep their target features on the GPU for the later epochs, up to 120 GiB (train.feature_cache_gb, capped at the
# free memory less 8 GiB; demo-m at 100: 2,275 of its 3,988 rows, peak 107 of 140 GiB, so ~7 GiB is training's; an
# H100 kept 1,489 of 3,975 in demo-n), and the rows past that in host memory, up to 96 GiB (train.feature_cache_host_gb,
# capped at what the host can spare less 8 GiB): later epochs without any target forward ran 1.25x faster on an H100
# (cache_speed, session 28) against demo-n's 37% of rows kept.
GPU_OVERRIDES = ["data.regenerate=true", "data.max_samples=null", "data.regenerate_first_turn_only=true",
                 "data.self_prompts=100000", "data.regenerate_minutes=7", "data.max_length=2048",
                 "train.token_budget=8192", "train.num_anchors=1024", "train.lr=4e-3", "train.warmup_ratio=0.04",
                 "train.max_steps=null", "train.epochs=10", "train.max_minutes=13",
                 "train.log_every=100", "train.eval_every=500", "train.eval_rows=4", "train.checkpoint_every=2000",
                 "train.final_eval_prompts=0", "train.feature_cache_gb=120", "train.feature_cache_host_gb=96",
                 "model.num_draft_layers=8", "model.drafter_layer_init=target", "model.target_attention=flex",
                 "model.target_graphs=true", "model.target_compile=default"]
# The GPU demo's promise is the whole command in 20 minutes on one H200. Its training ends at a deadline: DEMO_MINUTES
# after the command started, less what the evaluation is allowed (EVALUATION_S: 143 s in demo-j with plain decoding
# on every prompt; 84 s in demo-p with plain decoding timed on 16 prompts a set, EVAL_PLAN, every prompt decoded
# alone, 27 s of it the 80 untimed ones; predicted ~68 s with the untimed ones decoded together, inference/batched.py,
# and 64 held-out prompts instead of 32: on an H100 with a random drafter (every prompt 255 steps), evaluate on 33
# prompts (one timed) took 8.0 s in bf16 with the 32 others together against 51.3 s one at a time,
# docs/gpu-runs/2026-12-08-h100-eval-batched/; 80 s so that a fallback to one at a
# time, ~96 s, still ends within 20 minutes). The budget is set when
# the first step runs (TimeBudget.start), so the minutes between the data step and the first step (61 s in demo-m,
# 2026-12-04: tokenizing, loading the compiled step) are never guessed: whatever they take, training ends on time,
# and what they do not take goes to training. On an H200 that leaves ~12 minutes; train.max_minutes (13) is only a
# ceiling. Where the regeneration runs slower, the training is cut, not the promise, down to MIN_TRAINING_MINUTES
# after a first step predicted BEFORE_FIRST_STEP_S after the data step.
DEMO_MINUTES = 19.75
BEFORE_FIRST_STEP_S, EVALUATION_S = 75.0, 80.0
MIN_TRAINING_MINUTES = 1.0


def training_deadline(started: float, now: float) -> float:
    """The time.monotonic() reading by which a GPU demo that started at `started` and ended its data step at `now`
    ends its training: DEMO_MINUTES after the start less EVALUATION_S, or MIN_TRAINING_MINUTES of steps after the
    predicted first step where that is later."""
    return max(started + 60 * DEMO_MINUTES - EVALUATION_S, now + BEFORE_FIRST_STEP_S + 60 * MIN_TRAINING_MINUTES)


def training_end_by(cfg: Config, kind: str, minutes: float | None, started: float, now: float) -> float | None:
    """The deadline train_pipeline ends the demo's training by (training_deadline), or None: a CPU demo promises
    no wall time, `--minutes` sets the training budget itself, and without train.max_minutes (an override of null)
    the run has no clock to end by. The configured train.max_minutes (an override included) stays the ceiling."""
    if kind != "cuda" or minutes is not None or cfg.train.max_minutes is None:
        return None
    end_by = training_deadline(started, now)
    steps_min = (end_by - now - BEFORE_FIRST_STEP_S) / 60
    log.info(f"demo: {now - started:.0f} s spent before training; training ends {end_by - now:.0f} s from now, "
             f"~{min(steps_min, cfg.train.max_minutes):.1f} minutes of steps (at most train.max_minutes="
             f"{cfg.train.max_minutes:g}), so that the demo ends within {DEMO_MINUTES} minutes (--minutes sets the "
             "training budget and lifts this limit)")
    return end_by


# What each device evaluates: (prompt set, prompts, new tokens per prompt, prompts plain decoding runs on for the
# speedup). None = every prompt of the set. On a GPU plain decoding was ~70% of the evaluation (demo-m: 2:13 for 112
# prompts); timing it on 16 prompts a set (the others checked lossless token by token) leaves the rest to training.
# The untimed prompts decode together (evaluate's batch_rows), so 64 held-out prompts cost seconds more than 32 and
# halve the held-out figure's variance (its standard error ~0.23 instead of ~0.32).
EVAL_PLAN = {"cpu": [("yardstick", 3, 32, None), ("heldout", 3, 32, None)],
             "cuda": [("yardstick", None, 256, 16), ("heldout", 64, 256, 16)]}
USER_PROMPTS_NEW_TOKENS = {"cpu": 32, "cuda": 256}
SET_NAMES = {"yardstick": "yardstick (another source)", "heldout": "held out from the training data"}
# Printed by the CPU demo: what the same command reaches on a GPU (docs/BENCHMARKS.md, "The GPU demo").
GPU_REFERENCE = ("On one H100 (2026-12-07), `dflash-train demo --device cuda` measured tau 3.95 (2.11x) on the "
                 "yardstick and 4.09 (2.38x) on held-out ShareGPT, lossless, in 19:37 with its data regenerated "
                 "(3.97 the run before; on an H200, 2026-12-04, an earlier recipe: 3.79; docs/BENCHMARKS.md, \"The "
                 "GPU demo\").")
# "-hf2": converted since the tokenizer keeps the GGUF's own pre-tokenizer (models/gguf_header.GGUF_PRE_TOKENIZERS); a
# directory converted before would tokenize digits after whitespace differently, so it is not reused.
HF_CACHE_NAME = "SmolLM2-135M-Instruct-hf2"
WARMUP_WAIT_S = 240  # after the regeneration, at most this long for the compile warm-up (training/warmup.py)


@dataclasses.dataclass
class DemoResult:
    out_dir: Path
    device: str
    evals: dict             # prompt set -> EvalReport.summary()
    steps: int
    tokens_per_step: int
    train_s: float
    tau_est: float | None   # training's estimate at the last logged step
    best: dict | None       # the validation's best step {"metric", "step", "value"}
    data: dict              # the run's data summary (RunSetup.data_summary)
    regen: dict | None      # the regeneration's stats (None: no regeneration ran)
    phases: dict            # seconds per phase
    wall_s: float
    paired: dict | None = None  # validation's walk against the held-out measurement on the same conversations

    def table(self) -> str:
        return format_demo_table(self)


def local_embedded_target(cache_root: Path, gguf: str | None = None) -> Path:
    """The embedded GGUF (or the .gguf file `gguf`) as a Hugging Face directory (fp32 safetensors + tokenizer),
    converted once into cache_root."""
    from transformers import AutoModelForCausalLM

    from .models.target import gguf_parsed_once, load_causal_lm, load_tokenizer

    if gguf is None:
        dest = cache_root / HF_CACHE_NAME
    else:  # named after the file and its size, so that another file of the same name is converted afresh
        dest = cache_root / f"{Path(gguf).stem}-{Path(gguf).stat().st_size}-hf2"
    if (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    log.info(f"converting {gguf or 'the embedded SmolLM2 GGUF'} into {dest} (once; later runs load it in a second)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with gguf_parsed_once():  # runs before any other thread starts
        tokenizer = load_tokenizer(gguf)
        model = load_causal_lm(gguf, "cpu", torch.float32)
    # transformers refuses to save a model loaded from GGUF ("quantized with gguf"): the same weights, already
    # dequantized, go into a plain model of the same config instead (logits identical, checked in the tests).
    config = copy.deepcopy(model.config)
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(model.state_dict(), strict=True)
    hf.generation_config = model.generation_config
    hf.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)  # complete or absent: a crash mid-write never leaves a half directory in place
    return dest


def build_demo_config(device: torch.device, minutes: float | None, out: str, overrides: list[str]) -> Config:
    ov = [f"pipeline.target_devices=[{device}]", f"pipeline.drafter_devices=[{device}]",
          f"run.out_dir={json.dumps(str(out), ensure_ascii=False)}",  # quoted: `#`, `: `, a date are path text
          "run.overwrite=true"]  # a demo re-run trains afresh (the previous run is moved aside, not deleted)
    if device.type == "cuda":
        ov += GPU_OVERRIDES
    if minutes is not None:
        if not minutes > 0:
            raise UserError(f"--minutes must be positive (got {minutes:g}); leave it out for the demo's own "
                            "budget (20 minutes in all on a GPU).")
        ov.append(f"train.max_minutes={minutes}")
    cfg = load_config(RECIPE, ov + list(overrides))
    gguf = cfg.model.target
    if gguf is None or (gguf.endswith(".gguf") and Path(gguf).is_file()):
        # A GGUF load dequantizes every tensor and rebuilds the tokenizer, and a demo loads the target many times
        cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(out).parent / ".cache"
        make_dir(cache, "the demo's cache directory", "data.cache_dir" if cfg.data.cache_dir else "--out")
        target = json.dumps(str(local_embedded_target(cache, gguf)), ensure_ascii=False)
        cfg = load_config(RECIPE, ov + list(overrides) + [f"model.target={target}"])
    return cfg


def data_dir_for(out: str | Path) -> Path:
    """Where the demo keeps its regenerated data: beside the run directory, so that re-runs reuse it."""
    out = Path(out)
    return out.with_name(out.name + "-data")


def regenerate_demo_data(cfg: Config, tokenizer) -> tuple[Config, dict | None]:
    """data.regenerate outside the run directory (data_dir_for), then the config that trains on the result."""
    if not cfg.data.regenerate:
        return cfg, None
    from .generation.run_data import regenerate_for_run

    where = data_dir_for(cfg.run.out_dir)
    where.mkdir(parents=True, exist_ok=True)
    data, stats = regenerate_for_run(cfg, where, tokenizer)
    return dataclasses.replace(cfg, data=data), stats


def run_demo(device: str = "auto", minutes: float | None = None, out: str = "runs/demo",
             overrides: list[str] = (), prompts: str | None = None) -> DemoResult:
    """prompts: a prompt file of the user's own (another source than the training data), evaluated too."""
    from .devices import parse_device, resolve_config
    from .inference.measure import measure_acceptance
    from .models.target import load_tokenizer
    from .pipeline.coordinator import run_log_file, train_pipeline
    from .training.startup import rebase_cold_start, use_compile_cache
    from .training.warmup import CompileWarmup, wants_warmup

    t_start, started = time.perf_counter(), time.monotonic()
    if prompts in SET_NAMES:  # eval's name for a bundled set: the demo measures it already (EVAL_PLAN)
        raise UserError(f"--prompts {prompts}: the demo measures the {SET_NAMES[prompts]} prompts already; --prompts "
                        "adds a .json/.jsonl prompt file of your own next to them, or leave it out.")
    dev = parse_device(device, "--device")
    cfg = build_demo_config(dev, minutes, out, list(overrides))
    if prompts is not None:  # checked now, not after the training
        from .inference.prompts import read_prompt_file
        read_prompt_file(prompts)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    if kind == "cpu":
        log.info("demo on a CPU: a wiring check of every stage (regeneration off, a few minutes of training, a few "
                 "prompts); the GPU demo (--device cuda) is the one that trains a useful drafter")
    tokenizer = load_tokenizer(cfg.model.target)
    phases = {"setup": time.perf_counter() - t_start}

    t0 = time.perf_counter()
    use_compile_cache(cfg)  # the run's compiles and the warm-up's share it
    if wants_warmup(resolve_config(cfg)):  # the training step compiles in a child process while the target regenerates
        where = data_dir_for(cfg.run.out_dir)
        where.mkdir(parents=True, exist_ok=True)
        with CompileWarmup(cfg, where / "compile_warmup", where / "compile_warmup.log") as warmup:
            cfg, regen = regenerate_demo_data(cfg, tokenizer)
            warmup.finish(WARMUP_WAIT_S)
        rebase_cold_start(cfg)  # the warm-up filled the cache: the pipeline's precompile child would only repeat it
    else:
        cfg, regen = regenerate_demo_data(cfg, tokenizer)
    phases["regenerate"] = time.perf_counter() - t0
    end_by = training_end_by(cfg, kind, minutes, started, time.monotonic())

    t0 = time.perf_counter()
    result = train_pipeline(cfg, end_by=end_by)
    phases["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan = list(EVAL_PLAN[kind]) + ([(prompts, None, USER_PROMPTS_NEW_TOKENS[kind], None)] if prompts else [])
    evals = {}
    last = result.history[-1] if result.history else {}

    def written() -> DemoResult:
        """The result so far into demo.json and demo.txt: after each evaluation, so that a run cut short (a lost
        machine, a signal) still leaves the figures it measured."""
        phases["evaluate"] = time.perf_counter() - t0
        demo = DemoResult(Path(result.out_dir), str(dev), evals, result.steps,
                          cfg.train.token_budget * len(cfg.pipeline.drafter_devices), phases["train"],
                          last.get("tau_est"), result.best, result.data, regen, phases,
                          time.perf_counter() - t_start, paired_validation(Path(result.out_dir)))
        out_dir = Path(result.out_dir)
        (out_dir / "demo.json").write_text(json.dumps(dataclasses.asdict(demo), default=str, indent=2) + "\n")
        (out_dir / "demo.txt").write_text(demo.table() + "\n")
        return demo

    with run_log_file(Path(result.out_dir)), eval_threads(dev):
        for spec, n, new_tokens, timed in plan:
            name = spec if spec in SET_NAMES else "prompts"
            report = measure_acceptance(cfg, result.drafter_dir, dev, result, spec=spec, n=n or 10**9,
                                        new_tokens=new_tokens, out_name=f"eval_{name}", timed=timed)
            if report is not None:
                name = SET_NAMES.get(spec, f"your prompts ({Path(spec).name})")
                evals[name] = dict(report.summary(), new_tokens=new_tokens)
                written()
    return written()


def paired_validation(out_dir: Path) -> dict | None:
    """The best step's walk per held-out conversation (REPLIES_FILE) against the held-out measurement
    (eval_heldout/eval.json) on the conversations both hold; None before that measurement or without keys."""
    from .training.validation import REPLIES_FILE, paired_with_measured

    replies, report = out_dir / REPLIES_FILE, out_dir / "eval_heldout" / "eval.json"
    if not (replies.is_file() and report.is_file()):
        return None
    return paired_with_measured(json.loads(replies.read_text())["replies"], json.loads(report.read_text())["prompts"])


class eval_threads:
    """One intra-op thread for CPU evaluation. Decoding one sequence is launch-bound: on a shared 2-core machine a
    second thread gains little and, whenever another process takes a core, makes every op wait at its barrier."""

    def __init__(self, device: torch.device):
        self.device, self.saved = device, None

    def __enter__(self):
        if self.device.type == "cpu":
            self.saved = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_num_threads(self.saved)


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def format_demo_table(d: DemoResult) -> str:
    from .inference.report import tau_text, verdict_text

    rows = [("prompts (never trained on)", "tau", "speedup", "lossless (greedy)")]
    for name, s in d.evals.items():
        rows.append((f"{name}: {s['num_prompts']} x {s['new_tokens']}", tau_text(s), _fmt(s["speedup"], ".2f", "x"),
                     verdict_text(s)))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    block = next(iter(d.evals.values()), {}).get("block_size", "?")
    lines = [f"dflash-train demo on {d.device}: SmolLM2-135M-Instruct + a DFlash drafter (B={block}), greedy"]
    lines += [f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows]
    est = [f"training {_fmt(d.tau_est, '.2f')} (on its own rows)"]
    if d.best:
        sources = "".join(f"{k} {v:.2f}, " for k, v in d.best.get("by_source", {}).items())
        est.insert(0, f"validation {d.best['value']:.2f} ({sources}decoding's walk over held-out replies, best step "
                      f"{d.best['step']:,} of {d.steps:,}: the drafter measured above)")
    lines.append("  tau estimates: " + "; ".join(est))
    if pr := d.paired:  # the estimate's honesty, prompt by prompt: the same conversations walked and decoded
        se = f" ± {pr['se']:.2f}" if pr["se"] is not None else ""
        line = (f"  validation vs measured on the same {pr['pairs']} held-out conversation"
                f"{'s' if pr['pairs'] != 1 else ''}: walk {pr['walk']:.2f}, decoded {pr['measured']:.2f} "
                f"(difference {pr['difference']:+.2f}{se})")
        if (bp := pr.get("before_parting")) and bp["pairs"]:  # where decoding reproduced the reply validation walked
            line += (f"; up to where the texts part ({bp['parted']} of {pr['pairs']} part): walk {bp['walk']:.2f}, "
                     f"decoded {bp['measured']:.2f}, the same blocks in {bp['same_blocks']} of {bp['pairs']}")
        lines.append(line)
    data = d.data or {}
    if data:
        lines.append(f"  data: {data['conversations']:,} conversations, {data['unique_tokens']:,} unique tokens "
                     f"({', '.join(f'{k} {v:.0%}' for k, v in data.get('shares', {}).items()) or 'one source'}); "
                     f"{epochs_trained(d):.1f} epochs trained")
    if d.regen:
        lines.append(f"  regeneration: {d.regen['generated_tokens']:,} tokens in {_clock(d.regen['seconds'])} "
                     f"({d.regen['generated_tokens'] / max(d.regen['seconds'], 1e-9):,.0f} tokens/s)")
    lines.append(f"  training: {d.steps:,} steps x {d.tokens_per_step:,} tokens in {_clock(d.train_s)} (loading and "
                 "compiling included)")
    p = d.phases
    lines.append(f"  wall time {_clock(d.wall_s)} (setup {_clock(p['setup'])}, regenerate {_clock(p['regenerate'])}, "
                 f"train {_clock(p['train'])}, evaluate {_clock(p['evaluate'])}); results in {d.out_dir}")
    if not d.device.startswith("cuda"):
        lines.append("  This was a wiring check: on a CPU the drafter is too small and trains too briefly to accept "
                     "much.")
        lines.append("  " + GPU_REFERENCE)
    return "\n".join(lines)


def epochs_trained(d: DemoResult) -> float:
    """Passes over the training rows the steps done made (the time budget may stop the schedule early)."""
    return d.steps * d.data["batches_per_step"] / (d.data["rows_per_epoch"] * d.data.get("steps_per_row", 1))


def run_demo_cli(args) -> int:
    demo = run_demo(args.device, args.minutes, args.out, args.overrides, args.prompts)
    print(demo.table())
    return 0
