"""`dflash-train` subcommands: parse arguments, call the library, nothing else.

Errors a user can cause (UserError) print one line and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .errors import UserError

log = logging.getLogger("dflash_train")


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    for noisy in ("transformers", "torch._dynamo", "torch._inductor"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_train(args) -> int:
    from .config import describe_config, load_config

    if args.help_config:
        print(describe_config())
        return 0
    cfg = load_config(args.config, args.overrides)
    check_paths(cfg)
    if args.config is None:  # the defaults are a full run: say so before the first silent minute
        log.info("train without --config: the defaults (%s drafter for %s on data.source=%s, devices %s, into %s); "
                 "`dflash-train train --help-config` lists every key, `--config tiny_cpu` is a seconds-long CPU run",
                 "single-loop" if args.single else "pipeline", cfg.model.target or "the embedded SmolLM2-135M",
                 cfg.data.source, "+".join(dict.fromkeys(cfg.pipeline.target_devices + cfg.pipeline.drafter_devices)),
                 cfg.run.out_dir)
    from .train import train
    result = train(cfg, single=args.single)
    print(f"drafter written to {result.drafter_dir}")
    return 0


def check_paths(cfg) -> None:
    """What a config names on this machine: the target, the data sources, drafter_init and the devices, checked
    before any model loads so a wrong path costs no time (config.py checks values, not the machine: a program may
    build a Config for files it writes later)."""
    from .config import ConfigError
    from .data.sources import check_source
    from .inference.prompts import read_prompt_file
    from .models.target import resolve_target_path
    from .devices import resolve_pipeline_devices

    resolve_target_path(cfg.model.target)
    if cfg.model.drafter_init is not None and not Path(cfg.model.drafter_init).expanduser().is_dir():
        raise ConfigError(f"model.drafter_init {cfg.model.drafter_init!r} is not a directory; point it at a saved "
                          "drafter (a run's drafter/ or checkpoints/step_*/), or leave it empty.")
    for source in [s for s, _ in cfg.data.mix_weights()] if cfg.data.mix else [cfg.data.source]:
        if source != "synthetic":
            check_source(source)
    if cfg.train.final_eval_prompts > 0 and cfg.data.eval_prompts not in ("heldout", "yardstick"):
        read_prompt_file(cfg.data.eval_prompts)  # read after training: a bad file must fail now, not then
    resolve_pipeline_devices(cfg.pipeline)


def cmd_eval(args) -> int:
    from .inference.benchmark import run_eval_cli
    return run_eval_cli(args)


def parse_devices(spec: str) -> list:
    """--device: 'auto', 'all' (every visible GPU, else the CPU), or a comma-separated list ('cuda:0,cuda:1')."""
    import torch

    from .devices import parse_device

    if spec.strip() == "all":
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] if n else [torch.device("cpu")]
    names = [x for x in spec.split(",") if x.strip()]
    if not names:
        raise UserError("--device is empty; use 'auto', 'all', 'cpu', 'cuda:N' or a comma-separated list of them.")
    return [parse_device(x, "--device") for x in names]


def parse_batch_size(spec) -> int | None:
    """--batch-size: a positive integer, or 'auto' (None: sized by batch_size_for once the models are loaded)."""
    if str(spec).strip().lower() == "auto":
        return None
    try:
        n = int(spec)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"--batch-size must be a positive integer or 'auto' (got {spec!r}).")
    return n


def cmd_regenerate(args) -> int:
    """`dflash-train regenerate`: the target rewrites a chat dataset's answers (generation/regenerate.py)."""
    from collections import Counter

    from .data.sources import DataError, open_source
    from .generation.engine import batch_size_for
    from .generation.regenerate import RegenerateSettings, check_settings, regenerate_dataset, select_source_records
    from .models.target import load_causal_lm, load_tokenizer
    from .pipeline.worker import RunControl, signal_exit_code, stop_on_signals

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1.")
    if args.temperature < 0:
        raise UserError("--temperature must be 0 (greedy) or positive.")
    if args.max_samples is not None and args.max_samples < 1:
        raise UserError("--max-samples must be at least 1.")
    if args.samples < 1:
        raise UserError("--samples must be at least 1.")
    if args.max_length < 2:
        raise UserError(f"--max-length must be at least 2 tokens (got {args.max_length}).")
    if args.samples > 1 and args.temperature <= 0:
        raise UserError(f"--samples {args.samples} needs --temperature > 0 (greedy answers are all the same), "
                        "e.g. --temperature 1.0.")
    fixed_batch = parse_batch_size(args.batch_size)
    out_path = Path(args.out)
    if out_path.suffix != ".jsonl":
        raise UserError(f"--out {args.out!r} must be a .jsonl file (one conversation per line).")
    if out_path.is_dir():
        raise UserError(f"--out {args.out!r} is a directory; name a .jsonl file, e.g. {args.out.rstrip('/')}/regen.jsonl.")
    if args.data == "synthetic":
        raise DataError("regenerate needs chat data: pass --data sharegpt or a .json/.jsonl chat file.")
    settings = RegenerateSettings(source=args.data, target=str(args.target or "smollm2"),
                                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  single_turn=args.single_turn, max_length=args.max_length, seed=args.seed,
                                  samples=args.samples)
    with open_source(args.data):  # a bad --data fails here, before the model loads
        pass
    check_settings(out_path, settings, replace=False)
    devices = parse_devices(args.device)
    tokenizer = load_tokenizer(args.target)
    models = [load_causal_lm(args.target, d) for d in devices]
    batch = fixed_batch or batch_size_for(models, args.max_length)
    log.info(f"regenerate: {batch} conversations per batch on each of {len(models)} device(s)")
    counts: Counter = Counter()
    control = RunControl()
    with stop_on_signals(control, "the next check; replies in flight are dropped (a rerun regenerates them)"):
        items = select_source_records(args.data, args.max_samples, counts)
        stats = regenerate_dataset(models, tokenizer, items, out_path, settings, batch, total=args.max_samples,
                                   stop=control.stop)
    skipped = {k.removeprefix("skip:"): n for k, n in counts.items() if k.startswith("skip:")}
    if skipped:
        log.info("source records skipped as unusable: " + ", ".join(f"{k}={n}" for k, n in sorted(skipped.items())))
    print(stats.line())
    if control.interrupted:
        print(f"stopped by {control.interrupted}: {out_path} holds every finished conversation; rerun the same "
              "command to resume")
        return signal_exit_code(control.interrupted)
    print(f"wrote {out_path} (train on it with data.source={out_path})")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo_cli
    return run_demo_cli(args)


def cmd_doctor(args) -> int:
    from .doctor import run_doctor_cli
    return run_doctor_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash speculative-decoding drafters.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a drafter (threaded pipeline; --single for the reference loop)")
    t.add_argument("--config", help="YAML file or bundled recipe name (tiny_cpu, smollm2_demo, ...)")
    t.add_argument("--single", action="store_true", help="single-device, single-thread reference trainer")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and help")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=3e-4")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="speculative decoding with a drafter: acceptance length, speedup, lossless")
    e.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors)")
    e.add_argument("--target", default=None, help="target directory or .gguf (default: embedded SmolLM2)")
    e.add_argument("--prompts", default=None,
                   help="a .jsonl file (or a .json list) of chats, requests (prompt, MT-Bench turns, instruction, "
                        "question: each a user turn) or raw text ({\"text\": ...}); yardstick for the bundled "
                        "80-prompt set; default: held-out ShareGPT")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--block-size", type=int, default=None, help="default: the drafter's block_size")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--num-prompts", type=int, default=None, help="use at most this many prompts")
    e.add_argument("--timed-prompts", type=int, default=None,
                   help="run plain decoding (the speedup's reference) on this many prompts, evenly spread, and check "
                        "the others' lossless verdict by one teacher-forced target pass each (default: every prompt)")
    e.add_argument("--batch-rows", type=int, default=None,
                   help="greedy: decode the prompts that are not timed this many at a time, "
                        "each taking the steps it takes alone (default 32, fewer where memory is short; 1: one at a "
                        "time)")
    e.add_argument("--device", default="auto")
    e.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target and drafter compute dtype (auto: bf16 on CUDA, fp32 on CPU); the lossless verdict "
                        "is exact in fp32, in bf16 near-ties can round differently")
    e.add_argument("--out", default=None, help="output directory for eval.json and eval.png")
    e.set_defaults(fn=cmd_eval)

    r = sub.add_parser("regenerate", help="rewrite a dataset's assistant turns with the target (greedy or sampled, "
                                          "continuous batching)")
    r.add_argument("--target", default=None)
    r.add_argument("--data", default="sharegpt", help="'sharegpt' or a .json/.jsonl file")
    r.add_argument("--out", required=True, help="output JSONL (resumable: existing lines are kept)")
    r.add_argument("--max-samples", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--batch-size", default="auto",
                   help="conversations decoded together per device, or 'auto': as many as half the free GPU memory "
                        "holds KV caches of --max-length for, up to 1536 (8 on CPU)"),
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (needed by --samples)")
    r.add_argument("--samples", type=int, default=1,
                   help="answers per conversation (sampled, each reproducible from --seed; identical ones dropped); "
                        "ids <id>_s<k>")
    r.add_argument("--device", default="auto",
                   help="'auto', 'all' (every visible GPU), or a comma-separated list (cuda:0,cuda:1): one model "
                        "replica per device, all regenerating at once")
    r.add_argument("--single-turn", action="store_true",
                   help="keep each conversation only up to its first assistant turn (one generation each)")
    r.add_argument("--max-length", type=int, default=2048,
                   help="a conversation is cut before the first turn whose prompt + new tokens exceed this")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    r.set_defaults(fn=cmd_regenerate)

    d = sub.add_parser("demo", help="train + evaluate a drafter for the embedded SmolLM2 on ShareGPT, offline")
    d.add_argument("--minutes", type=float, default=None, help="training time budget")
    d.add_argument("--device", default="auto")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--prompts", default=None, help="a .json/.jsonl prompt file of your own (from another source than "
                                                   "the training data), measured next to the bundled sets")
    d.add_argument("overrides", nargs="*", help="section.key=value overrides")
    d.set_defaults(fn=cmd_demo)

    doc = sub.add_parser("doctor", help="check versions, devices and a compiled step in a worker thread")
    doc.add_argument("--compile", default="auto", choices=["auto", "eager", "default", "reduce-overhead"],
                     help="compile mode to check (auto | eager | default | reduce-overhead)")
    doc.add_argument("--device", default="auto", help="device of the compiled step (auto = cuda:0 if present)")
    doc.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a signal: the pipeline's summary line; SIGTERM after a clean stop exits 0
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)


if __name__ == "__main__":
    from .beside import exit_with_parent

    exit_with_parent()  # `python -m dflash_train.cli` as the compile warm-up's child: gone with its run (beside.py)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # under torchrun: its failure summary then shows each rank's error
        from torch.distributed.elastic.multiprocessing.errors import record
        sys.exit(record(main)())
    sys.exit(main())
