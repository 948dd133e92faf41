"""Training and held-out samples for a run, from the configured source, or from several mixed with weights
(data.mix)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..config import DataConfig
from .conversations import load_chat_dataset
from .packing import DatasetSplit, Sample
from .synthetic import synthetic_samples

log = logging.getLogger("dflash_train")


def load_dataset(cfg: DataConfig, tokenizer=None, seed: int = 0, cache_dir: str | None = None) -> DatasetSplit:
    if cfg.mix:
        return load_mix(cfg, tokenizer, seed, cache_dir)
    if cfg.source == "synthetic":
        max_len = min(cfg.synthetic_max_len, cfg.max_length)
        samples = synthetic_samples(cfg.synthetic_samples, period=cfg.synthetic_period, seed=seed,
                                    min_len=min(cfg.synthetic_min_len, max_len), max_len=max_len)
        n_held = min(cfg.heldout_max, int(len(samples) * cfg.heldout_fraction))
        train = samples[n_held:]
        if cfg.max_samples:
            train = train[: cfg.max_samples]
        return DatasetSplit(train=train, heldout=samples[:n_held], stats={"source": "synthetic"})

    return load_chat_dataset(cfg, tokenizer, seed=seed, cache_dir=cache_dir)


def tokenized_cache_dir(cfg: DataConfig, out_dir: Path) -> str:
    """Where a run keeps its tokenized data: data.cache_dir, else .cache beside the run directory."""
    return cfg.cache_dir or str(Path(out_dir).parent / ".cache")


def mix_entry_config(cfg: DataConfig, source: str, cap: int | None) -> DataConfig:
    """How data.mix reads one of its sources: as data.source, at most `cap` training conversations (None: all)."""
    return dataclasses.replace(cfg, source=source, mix=[], max_samples=None if cap is None else max(cap, 1))


def mix_counts(weights: list[float], total: int) -> list[int]:
    """Counts that sum to `total`, each total * w / sum(weights) rounded down or up (largest remainders round up;
    ties go to the earlier entry)."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def repeat_to(samples: list[Sample], n: int) -> list[Sample]:
    """The first n of samples, cycled: a source smaller than its share is repeated whole, then in part."""
    return [samples[i % len(samples)] for i in range(n)]


def load_mix(cfg: DataConfig, tokenizer, seed: int = 0, cache_dir: str | None = None) -> DatasetSplit:
    """data.mix: each source read, tokenized, split and cached like data.source (load_chat_dataset: its held-out side
    too), then source i contributes counts[i] training conversations (mix_counts of the weights, or of the sources'
    sizes when the entries have none), its first ones, cycled when it holds fewer. The run trains on the
    concatenation (every epoch shuffles it). One log line per source: conversations, unique tokens, share."""

    entries = cfg.mix_weights()
    weighted = entries[0][1] is not None
    total = cfg.max_samples
    # With weights and a total, each source is read only up to its share (a 90k-conversation file stops early).
    caps = mix_counts([w for _, w in entries], total) if weighted and total is not None else [total] * len(entries)
    # A source whose share rounds to 0 is still read (one conversation): its held-out side is kept.
    splits = [load_chat_dataset(mix_entry_config(cfg, source, cap), tokenizer, seed=seed, cache_dir=cache_dir)
              for (source, _), cap in zip(entries, caps)]
    sizes = [len(s.train) for s in splits]
    weights = [w for _, w in entries] if weighted else sizes
    # Weights: data.max_samples in all, small sources repeated. No weights: at most data.max_samples, never repeated.
    n_total = sum(sizes) if total is None else total if weighted else min(total, sum(sizes))
    counts = mix_counts(weights, n_total)
    train, per_source = [], []
    for (source, _), split, n in zip(entries, splits, counts):
        if n == 0 and n_total >= len(entries):  # (a total below one per source, e.g. held-out-only loads, is meant)
            log.warning(f"data.mix: {source!r} gets no training conversations (its share of {n_total} rounds to 0)")
        chosen = repeat_to(split.train, n)
        unique = split.train[:n]  # every distinct conversation the run sees
        train += chosen
        row = {"source": source, "conversations": n, "available": len(split.train),
               "unique_tokens": sum(len(s.input_ids) for s in unique), "share": n / max(n_total, 1),
               "heldout": len(split.heldout)}
        per_source.append(row)
        use = (f"repeated {n / len(split.train):.2f}x" if n > len(split.train)
               else f"{n:,} of {len(split.train):,} available" if n < len(split.train) else "each once")
        log.info(f"data.mix: {source}: {n:,} training conversations ({use}), {row['unique_tokens']:,} unique "
                 f"tokens, share {row['share']:.1%}, {len(split.heldout)} held out")
    # Validation packs its rows from the front of the held-out list: interleaved, its first rows hold every source
    # in proportion, not only the first source's conversations.
    names = [row["source"] for row in per_source]
    held = interleave([[(h, m, name, k) for h, m, k in zip(s.heldout, s.heldout_messages or [None] * len(s.heldout),
                                                            s.heldout_keys or [None] * len(s.heldout))]
                       for s, name in zip(splits, names)])
    heldout = [h for h, _, _, _ in held]
    heldout_messages = [m for _, m, _, _ in held] if all(s.heldout_messages or not s.heldout for s in splits) else []
    heldout_sources = [Path(name).stem for _, _, name, _ in held]
    heldout_keys = [k for _, _, _, k in held] if all(s.heldout_keys or not s.heldout for s in splits) else []
    stats = {"source": "mix", "sources": per_source, "train": len(train), "heldout": len(heldout),
             "unique_tokens": sum(r["unique_tokens"] for r in per_source)}
    return DatasetSplit(train=train, heldout=heldout, heldout_messages=heldout_messages, stats=stats,
                        heldout_sources=heldout_sources, heldout_keys=heldout_keys)


def interleave(lists: list[list]) -> list:
    """Every item of every list, each list's items in their order and spread evenly over the result (item i of a
    list of n sits at (i + 0.5) / n of the way; ties go to the earlier list)."""
    keyed = [((i + 0.5) / len(items), k, item) for k, items in enumerate(lists) for i, item in enumerate(items)]
    return [item for _, _, item in sorted(keyed, key=lambda e: (e[0], e[1]))]
