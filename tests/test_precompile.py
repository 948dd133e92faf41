"""The precompile child (pipeline/precompile.py, issue #16's fast start): validation's and the target's forward are
compiled in a child process while the drafters compile their training step, and the run finds them in the cache."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.devices import resolve_config
from dflash_train.models.build import build_drafter
from dflash_train.models.target import load_target, load_tokenizer, target_config_info
from dflash_train.pipeline import precompile
from dflash_train.training.startup import rebase_cold_start, use_compile_cache
from dflash_train.training.step import DrafterStep
from tiny_chat import make_tiny_chat_target, write_chats


def _cfg(tmp_path, *extra):
    target = make_tiny_chat_target(tmp_path / "target")
    chats = write_chats(tmp_path / "chats.jsonl", 300)
    return resolve_config(load_config("tiny_cpu", [
        f"model.target={target}", f"data.source={chats}", f"run.out_dir={tmp_path}/runs/run", "train.max_steps=3",
        "train.eval_every=2", "data.heldout_fraction=0.1", "train.max_minutes=null", *extra]))


def _drafter_config(cfg):
    return build_drafter(cfg.model, target_config_info(cfg.model.target), load_tokenizer(cfg.model.target)).config


def test_the_pipeline_waits_for_the_child_before_its_targets_start(no_env, tmp_path, caplog):
    """pipeline.precompile=always (the CPU's way in; auto is CUDA-only): the child runs both parts eagerly from the
    run's config (validation's own graph: through the training graph it has no part), the coordinator waits for it
    after the drafters, and the run trains as it would without it."""
    from dflash_train.pipeline.coordinator import train_pipeline

    caplog.set_level(logging.INFO, logger="dflash_train")
    result = train_pipeline(_cfg(tmp_path, "pipeline.precompile=always", "train.validation_graph=own"))
    assert result.steps == 3
    messages = [r.getMessage() for r in caplog.records]
    started = next(i for i, m in enumerate(messages) if m.startswith("precompile: a child process"))
    done = next(i for i, m in enumerate(messages) if m.startswith("precompile: done"))
    ready = next(i for i, m in enumerate(messages) if m.startswith("target0: feature forward ready"))
    assert started < done < ready, messages  # the targets start only once the child has ended
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "precompile" in r.getMessage()]
    child_log = (tmp_path / "runs" / "run" / "precompile.log").read_text()
    assert "precompile: validation compiled in" in child_log and "precompile: target compiled in" in child_log
    assert not (tmp_path / "runs" / "run" / "precompile").exists()  # its scratch directory is removed


def test_auto_starts_a_child_only_where_it_can_pay(no_env, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")
    started = []
    monkeypatch.setattr(precompile, "Precompile", lambda *a: started.append(a) or "child")
    free = [200 * 2**30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[0], 300 * 2**30))
    default = _cfg(tmp_path / "d", "train.compile=default", "model.target_compile=default")
    assert default.pipeline.precompile == "never"          # the default since a GPU run started slower with the child
    cfg = dataclasses.replace(default, pipeline=dataclasses.replace(default.pipeline, precompile="auto"))
    dcfg, gpu, cpu = _drafter_config(cfg), torch.device("cuda", 0), torch.device("cpu")
    assert precompile.precompile_parts(cfg, validating=True) == ["target"]  # validation runs the training graph
    own = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, validation_graph="own"))
    parts = precompile.precompile_parts(own, validating=True)
    assert parts == ["validation", "target"]
    start = lambda *devices, c=cfg: precompile.start_precompile(  # noqa: E731
        c, dcfg, parts, *devices, tmp_path / "scratch", child_bytes=30 * 2**30)
    assert start(cpu, cpu) is None                         # not CUDA
    assert start(gpu, gpu) == "child" and len(started) == 1  # cold cache, 200 GiB free for a 30 GiB child
    free[0] = 80 * 2**30
    assert start(gpu, gpu) is None                         # 80 < 3 x 30 GiB: no room for a second target
    assert any("compile after the training step" in m for m in caplog.messages)
    free[0] = 200 * 2**30
    graphs = use_compile_cache(cfg) / "fxgraph" / "x"      # cold when the run started using it...
    graphs.mkdir(parents=True)
    (graphs / "graph").write_text("compiled")              # ...then the run compiled something (its flex kernels)
    assert start(gpu, gpu) == "child"                      # still a cold start (the GPU run of 2026-12-03 skipped it)
    rebase_cold_start(cfg)                                 # the demo, after its warm-up child filled the cache
    assert start(gpu, gpu) is None                         # loading beats a child
    use_compile_cache(cfg)                                 # a later run that finds it warm at its start
    assert start(gpu, gpu) is None
    assert any("the compile cache was warm at the start" in m for m in caplog.messages)
    shutil.rmtree(graphs.parent)
    use_compile_cache(cfg)
    off = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, precompile="never"))
    assert start(gpu, gpu, c=off) is None
    assert start(gpu, gpu, c=default) is None
    assert precompile.precompile_parts(_cfg(tmp_path / "e", "train.compile=eager"), validating=True) == []
    assert precompile.precompile_parts(cfg, validating=False) == ["target"]
    assert len(started) == 2


@pytest.mark.slow  # inductor's C++ codegen of a tiny validation forward in the child: ~40 s on 2 cores
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor on CPU needs a C++ compiler")
def test_what_the_child_compiled_is_what_the_workers_then_load(no_env, tmp_path):
    """The child compiles validation's forward on a dummy batch of the real shapes; replica 0 then compiles it on
    the run's real held-out batch and rows: a cache hit, or the child saved nothing. (The target part is left out
    for the suite's time: its worker warms up on the very dummy batch the child uses, so only process-wide
    settings could split the two, and this case checks those too.)"""
    from torch._dynamo.utils import counters

    from dflash_train.data.dataset import load_dataset
    from dflash_train.training.validation import build_validation_rows

    cfg = _cfg(tmp_path, "train.compile=default", "model.target_compile=default", "pipeline.precompile=always",
               "train.validation_graph=own")
    use_compile_cache(cfg)
    # On a CPU inductor's code (and its cache key) depends on the intra-op thread count: the child's must be this
    # test process's one (conftest.py). On CUDA, the mode auto is for, it does not enter the key.
    no_env.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    dcfg = _drafter_config(cfg)
    child = precompile.start_precompile(cfg, dcfg, ["validation"], torch.device("cpu"),
                                        torch.device("cpu"), tmp_path / "scratch", child_bytes=0)
    assert child.finish(timeout_s=900), child.log_path.read_text()[-3000:]
    torch._dynamo.reset()  # nothing of this process's own compiles in memory: only the shared cache
    before = dict(counters["inductor"])
    target = load_target(cfg.model.target, dcfg.target_layer_ids, attention=cfg.model.target_attention)
    data = load_dataset(cfg.data, load_tokenizer(cfg.model.target), seed=0)
    rows = build_validation_rows(data.heldout, cfg, target, torch.device("cpu"))
    drafter = build_drafter(cfg.model, target_config_info(cfg.model.target)).float().train()
    step = DrafterStep(drafter, target.embed_tokens.weight, target.lm_head.weight, cfg.train, torch.device("cpu"),
                       tag="0")
    step.evaluate(rows.batches[0], rows.feats[rows.row_of[0]])     # as Validator.warm_up calls it
    got = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}
    assert got["fxgraph_cache_miss"] == 0 and got["fxgraph_cache_hit"] >= 1, got
