"""The compile warm-up (training/warmup.py, issue #16's fast start): a child process compiles the training step while
the target regenerates, and the run then finds every graph it compiles in the shared cache."""

from __future__ import annotations

import logging
import os
import shutil
import sys

import pytest
import torch
import yaml

from dflash_train.beside import NICENESS
from dflash_train.config import load_config
from dflash_train.devices import resolve_config
from dflash_train.training.startup import compile_cache_dir, use_compile_cache
from dflash_train.training.warmup import CompileWarmup, wants_warmup, warmup_overrides
from tiny_chat import make_tiny_chat_target, write_chats


def _cfg(tmp_path, *extra):
    target = make_tiny_chat_target(tmp_path / "target")
    chats = write_chats(tmp_path / "chats.jsonl", 300)
    return load_config("tiny_cpu", [f"model.target={target}", f"data.source={chats}",
                                    f"run.out_dir={tmp_path}/runs/run", "train.max_steps=3", "train.eval_every=2",
                                    "train.max_minutes=null", *extra])


def test_the_child_trains_two_steps_of_the_source_as_it_is_into_its_own_directories(no_env, tmp_path):
    cfg = _cfg(tmp_path, "data.regenerate=true", "data.self_prompts=100", "train.compile=default")
    scratch = tmp_path / "scratch"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    child = load_config(str(tmp_path / "config.yaml"), warmup_overrides(cfg, scratch))
    assert (child.train.max_steps, child.train.max_minutes, child.train.final_eval_prompts) == (2, None, 0)
    assert (child.data.regenerate, child.data.self_prompts, child.data.source) == (False, 0, cfg.data.source)
    assert child.run.out_dir == str(scratch / "run") and child.data.cache_dir == str(scratch / "cache")
    assert compile_cache_dir(child) == compile_cache_dir(cfg)  # what it compiles lands where the run looks
    for key in ("model", "pipeline"):  # the shapes and settings the compiled code depends on: the run's own
        assert getattr(child, key) == getattr(cfg, key)
    assert (child.train.token_budget, child.train.num_anchors, child.train.compile, child.train.dtype) == \
        (cfg.train.token_budget, cfg.train.num_anchors, cfg.train.compile, cfg.train.dtype)


def test_a_warmup_pays_only_when_the_run_regenerates_and_compiles(tmp_path):
    base = ["model.target=x", f"run.out_dir={tmp_path}/r", "data.source=sharegpt"]
    assert wants_warmup(load_config("tiny_cpu", base + ["data.regenerate=true", "train.compile=default"]))
    assert not wants_warmup(load_config("tiny_cpu", base + ["data.regenerate=true", "train.compile=eager"]))
    assert not wants_warmup(load_config("tiny_cpu", base + ["data.regenerate=false", "train.compile=default"]))
    on_cpu = resolve_config(load_config("tiny_cpu", base + ["data.regenerate=true", "train.compile=auto",
                                                            "pipeline.drafter_devices=[cpu]"]))
    assert not wants_warmup(on_cpu)  # "auto" is eager on a CPU


@pytest.mark.slow  # inductor's C++ codegen of a tiny drafter step in the child: about a minute on 2 CPU cores
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor on CPU needs a C++ compiler")
def test_the_run_loads_every_graph_the_warmup_compiled(no_env, tmp_path, caplog):
    from torch._dynamo.utils import counters

    from dflash_train.pipeline.coordinator import train_pipeline

    caplog.set_level(logging.INFO, logger="dflash_train")
    cfg = _cfg(tmp_path, "train.compile=default", "train.eval_every=0")
    use_compile_cache(cfg)
    with CompileWarmup(cfg, tmp_path / "scratch", tmp_path / "warmup.log") as warmup:
        assert warmup.finish(timeout_s=900), (tmp_path / "warmup.log").read_text()[-3000:]
    assert not (tmp_path / "scratch").exists()
    before = dict(counters["inductor"])
    result = train_pipeline(cfg)
    got = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}
    assert result.steps == 3
    assert got["fxgraph_cache_miss"] == 0 and got["fxgraph_cache_hit"] >= 2, got  # forward and backward at least
    assert any("compile warm-up: done " in r.getMessage() for r in caplog.records)


def test_a_failing_child_is_a_warning_that_quotes_its_log(no_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")
    cfg = load_config("tiny_cpu", [f"model.target={tmp_path}/no-such-model", f"run.out_dir={tmp_path}/runs/run",
                                   "train.compile=default"])
    with CompileWarmup(cfg, tmp_path / "scratch", tmp_path / "warmup.log") as warmup:
        assert not warmup.finish(timeout_s=300)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compile warm-up: the child exited with" in warnings[0], warnings
    assert "no-such-model" in warnings[0]  # the child's own error, quoted from its log
    assert not (tmp_path / "scratch").exists()


class _Sleeper(CompileWarmup):
    def command(self, cfg):
        return [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_child_past_its_timeout_is_stopped(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")
    cfg = load_config("tiny_cpu", [f"run.out_dir={tmp_path}/runs/run"])
    with _Sleeper(cfg, tmp_path / "scratch", tmp_path / "warmup.log") as warmup:
        if hasattr(os, "setpriority"):  # below the run's priority: the regeneration it works beside comes first
            assert os.getpriority(os.PRIO_PROCESS, warmup.proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0)
                                                                          + NICENESS)
        assert not warmup.finish(timeout_s=0.1)
        assert warmup.proc.poll() is not None  # stopped, not left running
    assert any("not done 0 s after the regeneration ended; stopped" in r.getMessage() for r in caplog.records)


def test_a_caller_that_fails_before_finish_leaves_no_child(tmp_path):
    cfg = load_config("tiny_cpu", [f"run.out_dir={tmp_path}/runs/run"])
    with pytest.raises(RuntimeError, match="regeneration failed"):
        with _Sleeper(cfg, tmp_path / "scratch", tmp_path / "warmup.log") as warmup:
            raise RuntimeError("regeneration failed")
    assert warmup.proc.poll() is not None
    assert not (tmp_path / "scratch").exists()


def test_the_gpu_demo_config_makes_a_valid_child_config(tmp_path):
    """The child's config is the run's written out as YAML and read back with warmup_overrides: a key the YAML
    round trip loses, or an override the GPU demo's settings refuse, would fail only on the GPU."""
    from dflash_train.demo import build_demo_config

    target = make_tiny_chat_target(tmp_path / "target")
    cfg = build_demo_config(torch.device("cuda", 0), None, str(tmp_path / "demo"), [f"model.target={target}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    child = load_config(str(tmp_path / "config.yaml"), warmup_overrides(cfg, tmp_path / "scratch"))
    assert child.model == cfg.model and child.pipeline == cfg.pipeline
    assert child.train.max_steps == 2 and not child.data.regenerate and child.data.max_samples == 512
