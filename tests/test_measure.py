"""The measurement after training (train.py + inference/measure.py): speculative decoding with the trained drafter on
prompts it never trained on, next to the training and validation estimates."""

from __future__ import annotations

import json

import pytest

from dflash_train.config import load_config
from dflash_train.train import train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_training_ends_with_a_measured_tau_next_to_the_estimates(tiny_llama, tmp_path):
    out = tmp_path / "run"
    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={out}", "data.heldout_fraction=0.1",
                                   "train.max_steps=30", "train.eval_every=10", "train.final_eval_prompts=3",
                                   "train.final_eval_new_tokens=16"])
    result = train(cfg, single=True)
    assert result.measured is not None and result.measured["num_prompts"] == 3
    assert 1.0 <= result.measured["mean_tau"] <= cfg.model.block_size
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if r.get("split") == "measured"]
    assert len(measured) == 1 and measured[0]["mean_tau"] == result.measured["mean_tau"]
    assert measured[0]["val_tau_est"] == result.best["value"] and "train_tau_est" in measured[0]
    assert measured[0]["verdict"].startswith("yes")  # fp32 on CPU: speculative output is the target's own
    assert (out / "eval_final" / "eval.json").is_file()
    log = (out / "run.log").read_text()
    assert "measured tau" in log and "serve the drafter" in log and '"num_speculative_tokens": 7' in log  # B=8


def test_chat_run_measures_on_the_bundled_yardstick(tmp_path):
    from tiny_chat import make_tiny_chat_target, write_chats

    target = make_tiny_chat_target(tmp_path / "chat", max_position_embeddings=4096)
    data = write_chats(tmp_path / "chats.jsonl", 40)
    out = tmp_path / "run"
    cfg = load_config("tiny_cpu", [f"model.target={target}", f"data.source={data}", f"run.out_dir={out}",
                                   "train.max_steps=4", "data.eval_prompts=yardstick", "train.final_eval_prompts=2",
                                   "train.final_eval_new_tokens=8"])
    result = train(cfg, single=True)
    assert result.measured["num_prompts"] == 2
    report = json.loads((out / "eval_final" / "eval.json").read_text())
    assert {p["category"] for p in report["prompts"]} <= {"writing", "roleplay", "reasoning", "math", "coding",
                                                          "extraction", "stem", "humanities"}


def test_no_heldout_synthetic_data_skips_the_measurement_with_a_line(tiny_llama, tmp_path, caplog):
    import logging

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "data.heldout_fraction=0.0", "train.max_steps=2", "train.final_eval_prompts=2"])
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        result = train(cfg, single=True)
    assert result.measured is None
    assert any("measured acceptance skipped" in r.message for r in caplog.records)
