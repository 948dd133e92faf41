"""Training and held-out samples for a run, from the configured source."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import DataConfig
from .packing import Sample
from .synthetic import synthetic_samples


@dataclass
class DatasetSplit:
    train: list[Sample]
    heldout: list[Sample]
    # held-out conversations as chat messages (prompts for evaluation); empty for the synthetic source
    heldout_messages: list[list[dict]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def load_dataset(cfg: DataConfig, tokenizer=None, seed: int = 0, cache_dir: str | None = None) -> DatasetSplit:
    if cfg.source == "synthetic":
        max_len = min(cfg.synthetic_max_len, cfg.max_length)
        samples = synthetic_samples(cfg.synthetic_samples, period=cfg.synthetic_period, seed=seed,
                                    min_len=min(cfg.synthetic_min_len, max_len), max_len=max_len)
        n_held = min(cfg.heldout_max, int(len(samples) * cfg.heldout_fraction))
        train = samples[n_held:]
        if cfg.max_samples:
            train = train[: cfg.max_samples]
        return DatasetSplit(train=train, heldout=samples[:n_held], stats={"source": "synthetic"})
    from .conversations import load_chat_dataset  # tokenizer-dependent path

    return load_chat_dataset(cfg, tokenizer, seed=seed, cache_dir=cache_dir)
