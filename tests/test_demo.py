"""The newcomer's path: doctor, regenerate, the time budget, training plots and the demo, on tiny chat models (CPU)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

import torch

from dflash_train.cli import main
from dflash_train.config import ConfigError, DataConfig, load_config
from dflash_train.data.conversations import load_chat_dataset
from dflash_train.generation.regenerate import read_done_ids
from dflash_train.data.sources import iter_conversations
from dflash_train.models.target import load_tokenizer
from dflash_train.training.plots import write_training_plots
from conftest import RUN_HANG_GUARD_S, SMOLLM2_GGUF_LOGITS, SMOLLM2_PROBE_IDS, STOP_HANG_GUARD_S
from tiny_chat import make_tiny_chat_target, write_chats


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    return make_tiny_chat_target(tmp_path_factory.mktemp("tiny_chat"))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ doctor

def test_doctor_eager_passes_and_names_every_check(capsys):
    assert main(["doctor", "--compile", "eager", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("versions", "embedded target", "bundled data", "cuda-graph policy", "drafter step in a worker thread"):
        assert any(line.strip().startswith("PASS") and name in line for line in out.splitlines()), (name, out)
    assert "gradients match eager" in out and "all checks passed" in out


def test_doctor_fails_with_a_fix(capsys):
    # reduce-overhead needs CUDA graphs; on a CPU-only machine that is a FAIL that says what to do instead.
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert main(["doctor", "--compile", "reduce-overhead", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  compile mode" in out and "fix: use --compile default" in out and "1 check(s) FAILED" in out


# ------------------------------------------------------------------------------------------ regenerate

def test_regenerate_writes_valid_jsonl_and_resumes(chat_target, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 12, turns=2)
    out = tmp_path / "regen.jsonl"
    args = ["regenerate", "--target", chat_target, "--data", str(data), "--out", str(out), "--max-new-tokens", "6",
            "--batch-size", "4", "--device", "cpu"]
    assert main(args + ["--max-samples", "5"]) == 0
    first = _records(out)
    assert len(first) == 5 and "generated tokens/s" in capsys.readouterr().out
    # Interrupted mid-write: a cut last line is dropped, and that conversation is regenerated.
    with open(out, "a") as f:
        f.write('{"id": "chat5_0", "messa')
    assert main(args) == 0
    recs = _records(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 12 and recs[:5] == first   # nothing duplicated, nothing redone
    assert set(ids) == {f"chat{i}_0" for i in range(12)}
    src = {c.key: c.messages for c in iter_conversations(data, Counter())}
    for r in recs:  # user turns kept in order, every assistant turn rewritten by the target
        orig = src[r["id"].rsplit("_", 1)[0]]
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in orig][: len(r["messages"])]
        assert [m["content"] for m in r["messages"] if m["role"] == "user"] == \
            [m["content"] for m in orig if m["role"] == "user"][: sum(m["role"] == "user" for m in r["messages"])]
        assert r["messages"][-1]["role"] == "assistant"
        assert all(m["content"] != o["content"] for m, o in zip(r["messages"], orig) if m["role"] == "assistant")
    # The data loader reads it back with the source's split: the ids carry the keys.
    tok = load_tokenizer(chat_target)
    split = lambda source: load_chat_dataset(DataConfig(source=str(source), heldout_fraction=0.3), tok, cache_dir=None)
    regen, orig = split(out), split(data)
    assert len(regen.train) == len(orig.train) and regen.heldout_messages[0][0] == orig.heldout_messages[0][0]
    assert main(args + ["--max-new-tokens", "7"]) == 2  # other settings: refused, not silently mixed
    assert "other settings" in capsys.readouterr().err


def test_regenerate_batch_size_auto_and_errors(chat_target, tmp_path, capsys):
    """--batch-size auto sizes the batch from the KV cache per row and the free memory; a bad value is one sentence,
    before any model loads."""
    from dflash_train.cli import main
    from dflash_train.generation.engine import MAX_AUTO_BATCH, auto_batch_size

    smollm2_kv = 2 * 30 * 3 * 64 * 2          # bytes per token: 2 (K, V) x layers x kv heads x head dim x bf16
    qwen3_8b_kv = 2 * 36 * 8 * 128 * 2
    assert auto_batch_size(smollm2_kv, 2048, 130 * 2**30) == 1472                    # 1,479 rows fit in half
    assert auto_batch_size(smollm2_kv, 2048, 200 * 2**30) == MAX_AUTO_BATCH == 1536  # capped at what was measured
    assert auto_batch_size(qwen3_8b_kv, 2048, 120 * 2**30) == 192                    # 204 rows fit, multiple of 64
    assert auto_batch_size(qwen3_8b_kv, 2048, 2**30) == 1                            # never 0
    assert auto_batch_size(qwen3_8b_kv, 2048, None) == 8                             # CPU
    for bad in ("0", "-3", "many"):
        code = main(["regenerate", "--target", chat_target, "--out", str(tmp_path / "r.jsonl"), "--batch-size", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "--batch-size must be a positive integer or 'auto'" in err[0], err
    out = tmp_path / "auto.jsonl"
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"},
                                             {"role": "assistant", "content": "x"}]}) + "\n")
    assert main(["regenerate", "--target", chat_target, "--data", str(data), "--out", str(out),
                 "--max-new-tokens", "4"]) == 0                                      # default: auto (8 on CPU)
    assert len(out.read_text().splitlines()) == 1


def test_regenerate_on_several_devices_writes_what_one_device_writes(chat_target, tmp_path):
    """Two replicas (threads, here both on the CPU) draw from one stream of conversations: together they write the
    same records as one replica, each once; the CLI takes a device list."""
    data = write_chats(tmp_path / "chats.jsonl", 14, turns=2)
    args = ["regenerate", "--target", chat_target, "--data", str(data), "--max-new-tokens", "5", "--batch-size", "3"]
    assert main(args + ["--out", str(tmp_path / "one.jsonl"), "--device", "cpu"]) == 0
    assert main(args + ["--out", str(tmp_path / "two.jsonl"), "--device", "cpu,cpu"]) == 0
    one, two = _records(tmp_path / "one.jsonl"), _records(tmp_path / "two.jsonl")
    assert len(two) == len({r["id"] for r in two}) == 14
    assert sorted(two, key=lambda r: r["id"]) == sorted(one, key=lambda r: r["id"])
    assert main(args + ["--out", str(tmp_path / "x.jsonl"), "--device", "cpu,gpu7"]) == 2


def test_a_failing_replica_stops_regeneration_and_is_named(chat_target, tmp_path, monkeypatch):
    from dflash_train.generation.regenerate import RegenerateSettings, iter_source_records, regenerate_dataset
    from dflash_train.generation.engine import Engine
    from dflash_train.models.target import load_causal_lm

    data = write_chats(tmp_path / "chats.jsonl", 40, turns=1)
    models = [load_causal_lm(chat_target, torch.device("cpu")) for _ in range(2)]
    calls = {0: 0, 1: 0}
    other_wrote = threading.Event()  # replica 0 prefilled again: a slot of its first batch was finished and written
    original = Engine._prefill

    def flaky(self, *args):
        replica = 0 if self.hf is models[0] else 1
        calls[replica] += 1
        if replica == 0 and calls[0] == 2:
            other_wrote.set()
        if replica == 1 and calls[1] == 2:
            # fail only once the other replica has written something (on a busy machine replica 1 could get here
            # first); bounded, so a broken engine fails the assertion below instead of hanging
            other_wrote.wait(timeout=120)
            raise ValueError("boom on the second prefill")
        return original(self, *args)

    monkeypatch.setattr(Engine, "_prefill", flaky)
    items = [(rid, conv, True) for rid, conv in iter_source_records(str(data), Counter())]
    out = tmp_path / "regen.jsonl"
    settings = RegenerateSettings(str(data), chat_target, 4, 0.0, False, 1024)
    with pytest.raises(RuntimeError, match=r"regeneration on cpu failed \(ValueError: boom on the second prefill\)"):
        regenerate_dataset(models, load_tokenizer(chat_target), items, out, settings, batch_size=2)
    written = _records(out)
    assert 0 < len(written) < 40 and len({r["id"] for r in written}) == len(written)  # the finished ones, once


def test_sigterm_stops_regeneration_after_its_batch_and_a_rerun_resumes(chat_target, tmp_path):
    """A time limit's SIGTERM: the batch in flight is written, the summary printed, exit 0; the rerun finishes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    data = write_chats(tmp_path / "chats.jsonl", 60, turns=1)
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, "-m", "dflash_train.cli", "regenerate", "--target", chat_target, "--data", str(data),
           "--out", str(out), "--max-new-tokens", "8", "--batch-size", "2", "--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + RUN_HANG_GUARD_S  # the first batches are written within seconds
    while not (out.is_file() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"hang guard: fewer than 2 records in {RUN_HANG_GUARD_S} s: {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=STOP_HANG_GUARD_S)  # it stops after its batch in flight
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM" in stdout and "rerun the same command to resume" in stdout
    first = _records(out)                                  # every line whole
    assert 2 <= len(first) < 60
    assert main(cmd[3:]) == 0
    ids = [r["id"] for r in _records(out)]
    assert len(ids) == len(set(ids)) == 60


def test_regenerate_single_turn_and_too_long(chat_target, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", 4, turns=3)
    out = tmp_path / "regen.jsonl"
    assert main(["regenerate", "--target", chat_target, "--data", str(data), "--out", str(out), "--single-turn",
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert all(len(r["messages"]) == 2 for r in _records(out))
    short = tmp_path / "short.jsonl"  # the first prompt (~50 tokens) + 4 new tokens never fits in 40
    assert main(["regenerate", "--target", chat_target, "--data", str(data), "--out", str(short),
                 "--max-length", "40", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert short.read_text() == ""


def test_train_with_data_regenerate(chat_target, tmp_path):
    from dflash_train.generation.run_data import regenerate_for_run
    from dflash_train.training.trainer import train_single_device

    data = write_chats(tmp_path / "chats.jsonl", 60, turns=2)
    out = tmp_path / "run"
    cfg = load_config("tiny_cpu", [f"model.target={chat_target}", f"data.source={data}", "data.regenerate=true",
                                   "data.regenerate_max_new_tokens=6", "data.max_samples=20",
                                   "data.heldout_fraction=0.2", "data.heldout_max=3", "train.max_steps=3",
                                   f"run.out_dir={out}"])
    res = train_single_device(cfg, regenerate=regenerate_for_run)
    recs = _records(out / "regenerated.jsonl")
    assert res.steps == 3 and len(recs) == 23  # 20 regenerated training chats + 3 held-out ones copied unchanged
    with pytest.raises(ConfigError, match="needs chat data"):
        load_config("tiny_cpu", ["data.regenerate=true"])


# ------------------------------------------------------------------------------------------ time budget, plots

@pytest.mark.parametrize("replicas", [1, 2])
def test_time_budget_stops_the_pipeline_on_the_same_step(tiny_llama, tmp_path, replicas):
    from dflash_train.pipeline.coordinator import train_pipeline

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "train.max_steps=100000", "train.max_minutes=0.02", "run.plots=true",
                                   "train.log_every=1", f"pipeline.drafter_devices={['cpu'] * replicas}"])
    res = train_pipeline(cfg)
    assert 0 < res.steps < 100000                          # stopped by the clock, finished normally
    assert all(len(set(c)) == 1 for c in res.replica_checksums)  # replicas identical at every step
    assert (res.drafter_dir / "model.safetensors").is_file()
    # plots whenever a window was logged: every step after the first, but a busy machine may stop the run right
    # after its first step (its window is start-up's, never logged)
    assert (tmp_path / "run" / "training.png").is_file() == bool(res.history)
    state = torch.load(tmp_path / "run" / "checkpoints" / f"step_{res.steps:08d}" / "training_state.pt",
                       weights_only=False)
    assert state["scheduler"]["last_epoch"] == res.steps   # the schedule kept its configured length


def test_time_budget_single_device_logs_the_last_step(tiny_llama, tmp_path):
    from dflash_train.training.trainer import train_single_device

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path}", "train.max_steps=100000",
                                   "train.max_minutes=0.01", "train.log_every=1000"])
    res = train_single_device(cfg)
    assert 0 < res.steps < 100000 and res.history[-1]["step"] == res.steps
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config("tiny_cpu", ["train.max_minutes=0"])


def test_training_plots(tmp_path):
    hist = [{"step": s, "loss": 5.0 / s, "acc": [min(1.0, 0.1 * s)] * 7, "tau_est": 1 + 0.2 * s} for s in range(1, 9)]
    path = write_training_plots(tmp_path, hist)
    assert path == tmp_path / "training.png" and path.stat().st_size > 10_000
    assert write_training_plots(tmp_path / "empty", []) is None


# ------------------------------------------------------------------------------------------ demo

def test_demo_gpu_settings_are_a_valid_config(chat_target, tmp_path):
    """The GPU demo's overrides (no GPU here to run them) load as a config: a misspelt key would fail only there."""
    from dflash_train.demo import build_demo_config

    cfg = build_demo_config(torch.device("cuda", 0), None, str(tmp_path / "demo"), [f"model.target={chat_target}"])
    assert cfg.data.regenerate and cfg.model.target_graphs and cfg.model.target_attention == "flex"
    assert cfg.model.target_compile == "default"  # checked against eager on an H200: benchmarks/gpu_target_compile_check.py
    assert cfg.pipeline.target_devices == cfg.pipeline.drafter_devices == ["cuda:0"]


def test_the_gpu_demo_ends_its_training_in_time_for_twenty_minutes():
    """Training ends at a deadline: DEMO_MINUTES after the start less the evaluation's allowance, whenever the data
    step ended; after a very slow one, still MIN_TRAINING_MINUTES of steps (monotonic readings are arguments: no
    clock is read)."""
    from dflash_train.demo import (BEFORE_FIRST_STEP_S, DEMO_MINUTES, EVALUATION_S, MIN_TRAINING_MINUTES,
                                   training_deadline)

    assert DEMO_MINUTES <= 20
    started = 1000.0
    for spent in (313.0, 400.0, 700.0):  # seconds before training
        end_by = training_deadline(started, started + spent)
        assert end_by + EVALUATION_S == pytest.approx(started + 60 * DEMO_MINUTES)  # the evaluation ends in time
    assert (training_deadline(started, started + 313.0) - started - 313.0 - BEFORE_FIRST_STEP_S) / 60 > 11.5  # demo-j
    late = started + 1200.0  # past the 20 minutes already: a short run, not none
    assert training_deadline(started, late) == late + BEFORE_FIRST_STEP_S + 60 * MIN_TRAINING_MINUTES


def test_only_a_gpu_demo_without_minutes_gets_a_deadline(chat_target, tmp_path):
    """On a GPU the demo's training gets the deadline, an override of train.max_minutes staying its ceiling (the
    config is left as it is); `--minutes M` is the budget itself, and a CPU demo promises no wall time."""
    from dflash_train.demo import build_demo_config, training_deadline, training_end_by

    def cfg(minutes=None, overrides=()):
        return build_demo_config(torch.device("cuda", 0), minutes, str(tmp_path / "demo"),
                                 [f"model.target={chat_target}", *overrides])

    ceiling = cfg(overrides=["train.max_minutes=12"])
    assert ceiling.train.max_minutes == 12.0
    assert training_end_by(ceiling, "cuda", None, 0.0, 313.0) == training_deadline(0.0, 313.0)
    assert training_end_by(cfg(minutes=12.0), "cuda", 12.0, 0.0, 313.0) is None
    assert training_end_by(ceiling, "cpu", None, 0.0, 313.0) is None
    assert training_end_by(cfg(overrides=["train.max_minutes=null"]), "cuda", None, 0.0, 313.0) is None


def test_demo_smoke_prints_the_table(chat_target, tmp_path, capsys, monkeypatch):
    data = write_chats(tmp_path / "chats.jsonl", 200)
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(4)))
    out = tmp_path / "demo"
    import dflash_train.inference.measure as measure_mod
    measure, seen = measure_mod.measure_acceptance, []   # demo.txt as each evaluation starts

    def measuring(*args, **kwargs):
        seen.append((out / "demo.txt").read_text() if (out / "demo.txt").is_file() else None)
        return measure(*args, **kwargs)
    monkeypatch.setattr(measure_mod, "measure_acceptance", measuring)
    rc = main(["demo", "--device", "cpu", "--out", str(out), "--minutes", "0.02", "--prompts", str(own),
               f"model.target={chat_target}", f"data.source={data}", "data.max_samples=40",
               "data.heldout_fraction=0.05", "model.num_draft_layers=1", "model.block_size=4",
               "train.token_budget=128", "train.num_anchors=8"])
    assert rc == 0
    table = capsys.readouterr().out
    for needle in ("prompts (never trained on)", "yardstick (another source): 3 x 32", "held out from the training data: 3 x 32",
                   "your prompts (own.jsonl): 4 x 32", "tau estimates: validation", "data: ", "training: ",
                   "wall time", "wiring check", "--device cuda"):
        assert needle in table, (needle, table)
    saved = (out / "demo.txt").read_text()
    assert saved in table and saved.count("yes (3/3 identical)") == 2 and "yes (4/4 identical)" in saved  # fp32: exact
    # Written after each evaluation: a run cut short during the next one still leaves what was measured.
    assert seen[0] is None and "yardstick (another source)" in seen[1] and "held out" not in seen[1]
    assert "held out from the training data" in seen[2] and "your prompts" not in seen[2]
    demo = json.loads((out / "demo.json").read_text())
    assert demo["steps"] > 0 and demo["best"]["step"] <= demo["steps"] and len(demo["evals"]) == 3
    assert demo["data"]["conversations"] > 0 and demo["data"]["epochs"] > 0
    for f in ("training.png", "eval_yardstick/eval.json", "eval_heldout/eval.png", "eval_prompts/eval.json",
              "drafter/model.safetensors", "drafter_last/model.safetensors", "demo.txt"):
        assert (out / f).is_file(), f


def test_demo_with_regeneration_and_self_prompts_reuses_its_data(chat_target, tmp_path, capsys):
    """The GPU demo's data path, at CPU size: the target rewrites the answers (held-out ones too) and writes prompts
    of its own, the run trains on what it wrote, and a second demo run reuses the regenerated data."""
    data = write_chats(tmp_path / "chats.jsonl", 60)
    out = tmp_path / "demo"
    args = ["demo", "--device", "cpu", "--out", str(out), "--minutes", "0.02", f"model.target={chat_target}",
            f"data.source={data}", "data.heldout_fraction=0.1", "data.regenerate=true", "data.self_prompts=12",
            "data.self_prompt_max_tokens=24", "data.regenerate_max_new_tokens=8", "data.regenerate_minutes=5",
            "model.num_draft_layers=1", "model.block_size=4", "train.token_budget=128", "train.num_anchors=8"]
    assert main(args) == 0
    table = (out / "demo.txt").read_text()
    assert "regeneration: " in table and "tokens/s" in table
    data_dir = tmp_path / "demo-data"
    regen = _records(data_dir / "regenerated.jsonl")
    assert len(regen) == 60  # the held-out side is regenerated too: validation scores the target's own answers
    src = {f"chat{i}": f"It is {i}." for i in range(60)}
    assert all(r["messages"][1]["content"] != src[r["id"].rsplit("_", 1)[0]] for r in regen)
    # A random tiny target rarely ends a user turn, so few of its prompts pass the filters (tests/test_self_prompts.py
    # answers and trains on them with a target that does); the file is written where re-runs find it.
    assert (data_dir / "self_prompts.jsonl").is_file()
    demo = json.loads((out / "demo.json").read_text())
    assert demo["regen"]["generated_tokens"] > 0 and demo["data"]["conversations"] > 0
    capsys.readouterr()
    assert main(args) == 0  # again: the data is reused, the old run directory moved aside
    assert "60 already done" in capsys.readouterr().out
    assert list(tmp_path.glob("demo.old-*"))


def test_read_done_ids_ignores_garbage(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "a_0", "messages": []}\nnot json\n[1, 2]\n{"id": "b_0"}\n{"id": "c_')
    assert read_done_ids(p) == {"a_0", "b_0"}
    assert p.read_text().endswith('{"id": "b_0"}\n')


# ------------------------------------------------------------------------------------------ the real SmolLM2

@pytest.mark.slow
def test_embedded_target_conversion_is_exact_and_regenerates(tmp_path, smollm2_dir):
    """The demo's one-time GGUF -> HF directory conversion keeps the logits bit-identical; the converted target
    regenerates a real ShareGPT conversation with its own chat template and stops at its end-of-turn token."""
    from dflash_train.generation.regenerate import RegenerateSettings, iter_source_records, regenerate_dataset
    from dflash_train.demo import local_embedded_target
    from dflash_train.models.target import load_causal_lm, load_target

    local = smollm2_dir
    assert local_embedded_target(local.parent) == local  # converted once
    # The GGUF side's logits were taken from the very model the conversion loaded from the GGUF (conftest's
    # smollm2_dir: load_causal_lm(None), what load_target(None) wraps), sparing a second GGUF parse (~30 s of CPU).
    gguf_logits = torch.load(local.parent / SMOLLM2_GGUF_LOGITS)
    with torch.no_grad():
        converted = load_target(str(local), [0], truncate=False).hf(torch.tensor(SMOLLM2_PROBE_IDS)).logits
    assert gguf_logits.shape == (1, len(SMOLLM2_PROBE_IDS[0]), 49152)
    assert torch.equal(gguf_logits, converted)
    tok = load_tokenizer(str(local))
    hf = load_causal_lm(str(local), torch.device("cpu"))
    items = [(rid, conv, True) for _, (rid, conv) in zip(range(2), iter_source_records("sharegpt", Counter()))]
    out = tmp_path / "regen.jsonl"
    settings = RegenerateSettings("sharegpt", str(local), 24, 0.0, True, 1024)
    stats = regenerate_dataset(hf, tok, items, out, settings, batch_size=2)
    recs = _records(out)
    assert stats.turns == 2 and len(recs) + sum(stats.dropped.values()) == 2
    # one batch of 2 rows decodes until its longer reply ends: at most 2 x 24 steps, at least what was generated
    assert stats.generated_tokens <= stats.row_steps <= 2 * 24 and 0 < stats.row_use() <= 1
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in recs)


def test_the_demo_table_gives_validation_by_source_when_the_best_step_has_it(tmp_path):
    from dflash_train.demo import DemoResult

    ev = {"yardstick (another source)": {"num_prompts": 2, "new_tokens": 8, "mean_tau": 1.5, "speedup": 1.1,
                                         "block_size": 4, "lossless": True, "identical_prompts": 2,
                                         "tie_prompts": 0, "wrong_prompts": 0}}
    best = {"metric": "val_tau_decoding", "step": 10, "value": 2.5, "by_source": {"regenerated": 2.25,
                                                                                  "self_regenerated": 2.75}}
    d = DemoResult(tmp_path, "cuda:0", ev, 12, 128, 60.0, 3.0, best, {}, None,
                   {"setup": 1, "regenerate": 0, "train": 60, "evaluate": 5}, 70.0)
    assert "validation 2.50 (regenerated 2.25, self_regenerated 2.75, decoding's walk" in d.table()
    assert " 1.50 " in d.table() and "±" not in d.table()      # a report without a standard error (older runs)
    ev["yardstick (another source)"]["mean_tau_se"] = 0.25
    assert " 1.50 ± 0.25 " in d.table()
    del best["by_source"]
    assert "validation 2.50 (decoding's walk" in d.table()


def test_the_demo_table_counts_the_epochs_its_steps_made_not_its_schedule(tmp_path):
    """A time budget stops the schedule early (the demo's 8 minutes: 17,346 of 26,930 steps): the table gives the
    passes the steps done made."""
    from dflash_train.demo import DemoResult

    data = {"conversations": 5, "unique_tokens": 900, "epochs": 10.0, "rows_per_epoch": 2693, "batches_per_step": 1}
    d = DemoResult(tmp_path, "cuda:0", {}, 17346, 8192, 60.0, 3.0, None, data, None,
                   {"setup": 1, "regenerate": 0, "train": 60, "evaluate": 5}, 70.0)
    assert "; 6.4 epochs trained" in d.table()


def test_the_demo_table_sets_validation_against_the_measurement_on_the_same_conversations(tmp_path):
    """validation_replies.json and eval_heldout/eval.json of one run paired by conversation (ids held twice left
    out), printed under the estimates: whether validation's walk reads what decoding measures, prompt by prompt."""
    from dflash_train.demo import DemoResult, paired_validation

    assert paired_validation(tmp_path) is None  # before the held-out measurement
    replies = [{"key": "a", "source": "regenerated", "tau": 4.0}, {"key": "b", "source": "regenerated", "tau": 3.0},
               {"key": "c", "source": "self_regenerated", "tau": 5.0}, {"key": "d", "source": "regenerated",
                                                                        "tau": 9.0}]
    (tmp_path / "validation_replies.json").write_text(json.dumps({"step": 10, "replies": replies}))
    (tmp_path / "eval_heldout").mkdir()
    prompts = [{"id": "a", "tau": 3.5}, {"id": "b", "tau": 2.0}, {"id": "x", "tau": 8.0},
               {"id": "d", "tau": 1.0}, {"id": "d", "tau": 2.0}]   # "d" twice: the parts of one chat
    (tmp_path / "eval_heldout" / "eval.json").write_text(json.dumps({"prompts": prompts}))
    paired = paired_validation(tmp_path)
    assert paired["pairs"] == 2 and paired["walk"] == 3.5 and paired["measured"] == 2.75
    assert paired["difference"] == -0.75 and paired["se"] == pytest.approx(0.25)
    d = DemoResult(tmp_path, "cuda:0", {}, 12, 128, 60.0, 3.0, None, {}, None,
                   {"setup": 1, "regenerate": 0, "train": 60, "evaluate": 5}, 70.0, paired)
    assert ("validation vs measured on the same 2 held-out conversations: walk 3.50, decoded 2.75 (difference "
            "-0.75 ± 0.25)\n") in d.table()  # replies without their tokens (before 2026-12-04): nothing more


def test_the_pairing_compares_the_walk_and_decoding_up_to_where_their_texts_part(tmp_path):
    """With each reply's tokens and blocks (validation_replies.json) and each prompt's decoded text and blocks (the
    eval report), the pairing also compares the two walks up to the first token where the texts differ: the same
    text gives the same blocks when validation reads what decoding does; past the parting it is another text."""
    from dflash_train.demo import DemoResult, paired_validation

    replies = [{"key": "a", "tau": 2.5, "tokens": [5, 6, 7, 8, 9, 2], "steps": [2, 3]},       # 0 -> 2 -> 5
               {"key": "b", "tau": 2.0, "tokens": [5, 6, 7, 8, 9, 10, 11, 2], "steps": [1, 1, 4, 1]},
               # a reply cut at the token limit, closed by the template's end-of-turn token (2)
               {"key": "c", "tau": 3.0, "tokens": [5, 6, 7, 8, 9, 10, 11, 2], "steps": [3, 4]}]
    prompts = [{"id": "a", "tau": 2.5, "speculative": [5, 6, 7, 8, 9, 2], "accept_lengths": [2, 3]},
               # parts from "b" at its 4th token: a block counts while it ends before it (walk 1, 1; decoded 2)
               {"id": "b", "tau": 2.5, "speculative": [5, 6, 7, 1, 1, 1], "accept_lengths": [2, 3]},
               # decoding stopped at the same limit: its last block was cut at the last token, not judged; the
               # blocks before it (3) are compared
               {"id": "c", "tau": 3.0, "speculative": [5, 6, 7, 8, 9, 10, 11], "accept_lengths": [3, 3]}]
    (tmp_path / "validation_replies.json").write_text(json.dumps({"step": 10, "replies": replies}))
    (tmp_path / "eval_heldout").mkdir()
    (tmp_path / "eval_heldout" / "eval.json").write_text(json.dumps({"prompts": prompts}))
    paired = paired_validation(tmp_path)
    assert paired["before_parting"] == {"pairs": 3, "parted": 2, "walk": 6.5 / 3, "measured": 7.5 / 3,
                                        "same_blocks": 2}
    d = DemoResult(tmp_path, "cuda:0", {}, 12, 128, 60.0, 3.0, None, {}, None,
                   {"setup": 1, "regenerate": 0, "train": 60, "evaluate": 5}, 70.0, paired)
    assert ("validation vs measured on the same 3 held-out conversations: walk 2.50, decoded 2.67 (difference "
            "+0.17 ± 0.17); up to where the texts part (2 of 3 part): walk 2.17, decoded 2.50, the same blocks in 2 "
            "of 3") in d.table()


@pytest.mark.parametrize("name", ["demo #2", "2026-12-08", "yes", "a: b"])
def test_the_demo_out_dir_is_taken_as_written(name, tmp_path):
    """--out goes into the config as run.out_dir: read as YAML, `runs/demo #2` became runs/demo (a comment; that run
    then moved aside), a date or `null` was refused as not a string naming run.out_dir, which the user never set."""
    from dflash_train.demo import build_demo_config

    out = str(tmp_path / name) if " " in name else name  # relative: nothing is created for it here
    cfg = build_demo_config(torch.device("cpu"), None, out, [f"model.target={tmp_path}"])
    assert cfg.run.out_dir == out
