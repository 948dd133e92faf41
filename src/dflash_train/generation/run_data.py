"""data.regenerate for a training run: before the first step the target rewrites the run's conversations
(generation/regenerate.py) into the run directory, then, with data.self_prompts, writes prompts of its own
(generation/self_prompts.py) and answers them; the run then trains on what was written. build_run
(training/run.py) takes `regenerate_for_run` from the layer that owns generation (the pipeline, train.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from ..data.conversations import is_heldout
from ..data.dataset import mix_entry_config, tokenized_cache_dir
from ..data.sources import iter_conversations
from ..data.tokenize_ahead import TokenizeAheads, wants_tokenize_ahead
from ..devices import resolve_pipeline_devices
from ..errors import UserError
from ..models.target import load_causal_lm
from .engine import batch_size_for
from .regenerate import RegenerateSettings, iter_source_records, regenerate_dataset
from .self_prompts import (SelfPromptSettings, read_openers, read_self_prompts, self_prompt_items,
                           write_self_prompts)

log = logging.getLogger("dflash_train")


def answer_self_prompts(cfg, out_dir: Path, tokenizer, models, batch_size: int, regenerated: Path, settings,
                        openers: dict[str, list[str]], stop: threading.Event | None = None, stats=None,
                        engines: dict | None = None, ahead: Callable[[Path], None] | None = None):
    """data.self_prompts (called by regenerate_for_run with its loaded models, after it regenerated data.source into
    `regenerated` with `settings`): write <out_dir>/self_prompts.jsonl with the first model (a share of the prompts
    steered by `openers`, read_openers of data.self_prompt_openers), have every model
    answer them into <out_dir>/self_regenerated.jsonl (greedy, like the other conversations; resumable), and return
    the DataConfig that reads both files, each conversation once (data.mix without weights: one log line each).
    A set `stop` (a time limit) ends both phases before their next batch: what was written is used. stats: the
    source's RegenerateStats, to which the answers' counts and seconds are added. engines: the source pass's
    (regenerate_dataset), reused for the answers. ahead(path): called once the answers' file is open to append to
    (`TokenizeAheads.start`)."""
    d = cfg.data
    path = Path(out_dir) / "self_prompts.jsonl"
    answers = Path(out_dir) / "self_regenerated.jsonl"
    own = SelfPromptSettings(target=settings.target, seed=cfg.train.seed, batch_size=batch_size,
                             max_new_tokens=d.self_prompt_max_tokens, openers=openers, steered=d.self_prompt_steered)
    steered = f" ({own.steered:.0%} start from an opener of {d.self_prompt_openers!r})" if own.steering else ""
    log.info(f"data.self_prompts: the target writes {d.self_prompts} prompts of its own into {path}{steered}")
    meta = path.with_suffix(".meta.json")
    if path.is_file() and meta.is_file():
        # the batch size changes what each batch draws: a resumed file keeps the one it was written with
        own.batch_size = json.loads(meta.read_text()).get("batch_size", batch_size)
    write_self_prompts(models[0], tokenizer, path, d.self_prompts, own, replace=cfg.run.overwrite, stop=stop)
    written = read_self_prompts(path)
    records = written[:d.self_prompts]
    # The mix below reads the answers whole: answers to other prompts (the prompts written again with other settings,
    # or fewer of them asked for, under run.overwrite into a kept directory such as the demo's) must not stay in it.
    if _answers_other_prompts(answers, written, d.self_prompts):
        if not cfg.run.overwrite:
            raise UserError(f"{answers} holds answers to other prompts than the {len(records)} of {path} this run "
                            "uses; delete it, or pass run.overwrite=true to start over.")
        log.warning(f"{answers} answers other prompts than the {len(records)} of {path} this run uses: starting over")
        answers.unlink()
    if records and not (stop is not None and stop.is_set()):
        answered = regenerate_dataset(models, tokenizer, self_prompt_items(records), answers,
                                      dataclasses.replace(settings, source=str(path)), batch_size=batch_size,
                                      total=len(records), replace_mismatch=cfg.run.overwrite, stop=stop,
                                      engines=engines, opened=ahead and (lambda: ahead(answers)))
        if stats is not None:
            stats.add(answered)
            stats.seconds += answered.seconds
    # Both files hold exactly what was chosen (data.max_samples of the source, data.self_prompts of the target's):
    # read them whole. A file with nothing on its training side (no prompt passed the filters, data.max_samples=0)
    # is left out rather than failing the load.
    mix = [str(p) for p in (regenerated, answers) if _has_training_side(p, cfg.train.seed, d.heldout_fraction)]
    if str(answers) not in mix:
        log.warning(f"data.self_prompts: no self-written conversation to train on in {answers}")
    if mix in ([], [str(regenerated)]):  # as without self-written prompts (with nothing at all, the loader says so)
        return dataclasses.replace(d, self_prompts=0)
    return dataclasses.replace(d, mix=mix, max_samples=None, regenerate=False, self_prompts=0)


def regenerate_for_run(cfg, out_dir: Path, tokenizer):
    """data.regenerate: regenerate the run's conversations (the first data.max_samples on the training side of the
    split, and the held-out side too: validation scores the drafter on the target's own answers to prompts it never
    trained on) into <out_dir>/regenerated.jsonl, then data.self_prompts, all within data.regenerate_minutes.
    Returns (the DataConfig that reads the result, the regeneration's stats as a dict)."""
    d = cfg.data
    targets, drafters = resolve_pipeline_devices(cfg.pipeline)
    devices = list(dict.fromkeys(targets + drafters))  # every device the run will use, once each
    out_path = Path(out_dir) / "regenerated.jsonl"
    settings = RegenerateSettings(source=d.source, target=str(cfg.model.target or "smollm2"),
                                  max_new_tokens=d.regenerate_max_new_tokens, temperature=0.0,
                                  single_turn=d.regenerate_first_turn_only, max_length=d.max_length,
                                  seed=cfg.train.seed)
    counts: Counter = Counter()
    cap = {False: d.max_samples, True: d.heldout_max if d.heldout_fraction > 0 else 0}

    def items():
        # Held-out conversations first: a time limit must never leave validation without its rows.
        records = [(rid, conv, is_heldout(conv.key, cfg.train.seed, d.heldout_fraction))
                   for rid, conv in iter_source_records(d.source, counts)]
        taken = {False: 0, True: 0}
        for rid, conv, held in sorted(records, key=lambda r: not r[2]):  # stable: file order within each side
            if cap[held] is None or taken[held] < cap[held]:
                taken[held] += 1
                yield rid, conv, True
            if all(cap[h] is not None and taken[h] >= cap[h] for h in (False, True)):
                return

    total = None if d.max_samples is None else d.max_samples + cap[True]
    openers = read_openers(d.self_prompt_openers) if d.self_prompts else {}  # a malformed file fails before loading
    limit = f", for at most {d.regenerate_minutes:g} minutes" if d.regenerate_minutes else ""
    log.info(f"data.regenerate: the target rewrites {d.max_samples or 'all'} training conversations of "
             f"{d.source!r} into {out_path} on {', '.join(map(str, devices))}{limit}")
    models = [load_causal_lm(cfg.model.target, dev) for dev in devices]
    cuda = devices[0].type == "cuda"
    batch = batch_size_for(models, d.max_length)
    log.info(f"data.regenerate: {batch} conversations per batch on each device")
    stop = threading.Event()  # set by the time limit: every phase below stops at its engine's next check
    timer = threading.Timer(60 * d.regenerate_minutes, stop.set) if d.regenerate_minutes else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    engines: dict = {}  # the source pass's engines, reused for the answers to self-written prompts

    def loads_as(path: Path):
        """The settings the run loads a file written here with (data.tokenize_ahead tokenizes it with them): one
        source of a data.mix beside the answers to self-written prompts, else data.source itself."""
        asked = cfg.data  # as asked: `d` changes below
        if asked.self_prompts:
            return mix_entry_config(dataclasses.replace(asked, regenerate=False, self_prompts=0), str(path), None)
        return dataclasses.replace(asked, source=str(path), regenerate=False)

    with TokenizeAheads(wants_tokenize_ahead(d, cuda), loads_as, tokenizer, cfg.train.seed,
                        tokenized_cache_dir(d, out_dir), Path(out_dir) / ".tokenize_ahead") as ahead:
        try:
            stats = regenerate_dataset(models, tokenizer, items(), out_path, settings, batch_size=batch,
                                       total=total, replace_mismatch=cfg.run.overwrite, stop=stop, engines=engines,
                                       opened=lambda: ahead.start(out_path))
            ahead.complete(out_path)
            if d.self_prompts and not stop.is_set():  # prompts the target writes itself (generation/self_prompts.py)
                d = answer_self_prompts(cfg, Path(out_dir), tokenizer, models, batch, out_path, settings, openers,
                                        stop=stop, stats=stats, engines=engines, ahead=ahead.start)
            elif d.self_prompts:
                log.warning("data.regenerate_minutes ran out before data.self_prompts: training without "
                            "self-written prompts (raise data.regenerate_minutes for them)")
                d = dataclasses.replace(d, self_prompts=0)
        finally:
            if timer is not None:
                timer.cancel()
        ahead.finish()
    if stop.is_set():
        log.info(f"data.regenerate: stopped at the {d.regenerate_minutes:g}-minute limit; what was written is used "
                 "(a rerun into the same directory resumes)")
    del models, engines
    gc.collect()  # the runners' reference cycles hold the models, caches and graph pools until collected
    if cuda:
        torch.cuda.empty_cache()
    return (dataclasses.replace(d, source=str(out_path), regenerate=False),
            {"generated_tokens": stats.generated_tokens, "seconds": stats.seconds, "turns": stats.turns,
             "conversations": stats.conversations, "row_use": stats.row_use()})


def _answers_other_prompts(answers: Path, prompts: list[dict], count: int) -> bool:
    """Whether `answers` holds an answer to one of `prompts` (the prompt file's records) other than the one its id
    names there, or to one past the first `count` (those the run uses): e.g. answers to a prompt file written before
    with other settings, whose ids (`self_<n>_0`) would pass for answers to the new prompts. An id the prompts do not
    hold (yet: a resumed file's last batch is sampled again, the same) says nothing."""
    if not answers.is_file():
        return False
    asked = {f"{r['id']}_0": (n < count, r["messages"][0]) for n, r in enumerate(prompts)}
    with open(answers, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError, KeyError, IndexError):
                record = json.loads(line)
                if record["id"] in asked and asked[record["id"]] != (True, record["messages"][0]):
                    return True
    return False


def _has_training_side(path: Path, seed: int, fraction: float) -> bool:
    """Whether a chat file holds a conversation on the training side of the split: read up to the first one (the
    whole file only when it has none; reading 100,000 answers whole took 1.35 s on the 2-core dev box, all of it
    before the first step)."""
    if not path.is_file():
        return False
    return any(not is_heldout(c.key, seed, fraction) for c in iter_conversations(path, Counter()))
