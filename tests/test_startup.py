"""Fast start (issue #16): torch.compile's caches in a directory kept across runs (train.compile_cache_dir), set
once by the training entry, and the start-up line that says how long the command took to reach its first step."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from dflash_train.cli import main as cli_main
from dflash_train.config import ConfigError, load_config
from dflash_train.training import metrics as metrics_module
from dflash_train.training import startup
from dflash_train.training.metrics import MetricsLogger
from dflash_train.training.startup import ENV_VAR, compile_cache_dir, use_compile_cache


def test_the_cache_directory_defaults_beside_the_data_cache(no_env, tmp_path):
    runs = tmp_path / "runs"
    assert compile_cache_dir(load_config("tiny_cpu", [f"run.out_dir={runs}/a"])) == runs / ".cache" / "torch_compile"
    cfg = load_config("tiny_cpu", [f"run.out_dir={runs}/a", f"data.cache_dir={tmp_path}/data"])
    assert compile_cache_dir(cfg) == tmp_path / "data" / "torch_compile"
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    no_env.setenv(ENV_VAR, default_cache_dir())  # what inductor writes there itself once imported: no one's choice
    assert compile_cache_dir(cfg) == tmp_path / "data" / "torch_compile"
    no_env.setenv(ENV_VAR, str(tmp_path / "env"))  # the environment's choice, when the config makes none
    assert compile_cache_dir(cfg) == tmp_path / "env"
    cfg = load_config("tiny_cpu", [f"run.out_dir={runs}/a", f"train.compile_cache_dir={tmp_path}/mine"])
    assert compile_cache_dir(cfg) == tmp_path / "mine"  # the config's beats it
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="train.compile_cache_dir .* is a file"):
        load_config("tiny_cpu", [f"train.compile_cache_dir={tmp_path}/a_file"])


def test_use_compile_cache_points_inductor_at_it_and_says_warm_or_cold(no_env, tmp_path, caplog):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    caplog.set_level(logging.INFO, logger="dflash_train")
    cfg = load_config("tiny_cpu", [f"train.compile_cache_dir={tmp_path}/cc"])
    d = use_compile_cache(cfg)
    assert d == tmp_path / "cc" and d.is_dir() and cache_dir() == str(d)  # where inductor looks now
    (d / "fxgraph" / "ab").mkdir(parents=True)
    (d / "fxgraph" / "ab" / "entry").write_text("")
    no_env.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    use_compile_cache(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile cache:")]
    assert lines == [f"compile cache: {d} (cold: compiling fills it)",
                     f"compile cache: {d} (warm: 1 compiled artifacts from earlier runs; turned off by "
                     "TORCHINDUCTOR_AUTOGRAD_CACHE=0)"]


@pytest.mark.slow  # inductor's C++ codegen: 10-20 s on a 2-core CPU, once
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor on CPU needs a C++ compiler")
def test_a_compile_fills_the_cache_and_the_next_one_loads_it(no_env, tmp_path):
    from torch._dynamo.utils import counters

    d = use_compile_cache(load_config("tiny_cpu", [f"train.compile_cache_dir={tmp_path}/cc"]))
    x = torch.arange(8.0)
    for _ in range(2):  # the second time as a new process would: dynamo traces again, inductor finds the graph
        torch._dynamo.reset()
        before = dict(counters["inductor"])
        assert torch.compile(lambda t: (t * 3 + 1).sum(), mode="default")(x).item() == 92.0
        got = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}
        if _ == 0:
            assert got == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}, got
            assert any(p.is_file() for p in (d / "fxgraph").rglob("*"))
        else:
            assert got == {"fxgraph_cache_miss": 0, "fxgraph_cache_hit": 1}, got


@pytest.mark.parametrize("single", [False, True], ids=["pipeline", "single"])
def test_a_run_logs_its_compile_cache_and_the_time_to_its_first_step(single, no_env, tiny_llama, tmp_path, capsys,
                                                                      monkeypatch):
    started = []  # the steps after which the log windows started
    real_start = MetricsLogger.start_window
    monkeypatch.setattr(MetricsLogger, "start_window", lambda self, step: (started.append(step),
                                                                           real_start(self, step)))
    run = tmp_path / "runs" / "run"
    args = ["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", f"run.out_dir={run}", "train.max_steps=2"]
    assert cli_main(args + (["--single"] if single else [])) == 0
    assert started == [1]  # once, after the first step: no window holds the start-up
    out = capsys.readouterr().out
    d = tmp_path / "runs" / ".cache" / "torch_compile"
    assert f"compile cache: {d} (cold: compiling fills it)" in out
    first = [line for line in out.splitlines() if "first step (step 1) done " in line]
    assert len(first) == 1 and first[0].endswith(" s after the command started"), first
    assert startup.seconds_since_process_start() > 0


def test_a_cache_directory_that_cannot_be_made_is_a_warning(no_env, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")
    assert use_compile_cache(load_config("tiny_cpu", ["train.compile_cache_dir=/proc/dflash-no-such/cc"])) is None
    assert ENV_VAR not in os.environ  # torch's default stays
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/proc/dflash-no-such/cc cannot be created" in warnings[0]
    assert "train.compile_cache_dir" in warnings[0]


def test_the_first_log_window_leaves_the_start_up_out(monkeypatch, tmp_path):
    """The logger is made before the workers compile; its first window must start after the first step, or a
    minute of compiling reads as a -90% stall (the demos of 2026-12-03: the only window outside 3% of the median)."""
    now = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: now[0])  # a fake clock: nothing is timed
    logger = MetricsLogger(None, total_steps=300, tokens_per_step=1000, log_every=100, tensorboard=False)
    counts = torch.tensor([[3.0, 1.0], [4.0, 4.0], [3.0, 1.0], [4.0, 3.0]])  # [4, B-1] (acceptance_from_counts)
    metrics = {"loss": torch.tensor(1.0), "counts": counts, "num_labels": torch.tensor(4.0)}
    now[0] = 60.0             # a minute of start-up ends with step 1
    logger.start_window(1)
    now[0] = 60.0 + 99 * 0.5  # steps 2..100 at 0.5 s each
    first = logger.log(100, metrics, lr=1e-3)
    now[0] += 100 * 0.5
    second = logger.log(200, metrics, lr=1e-3)
    assert first["step_time_s"] == pytest.approx(0.5) and second["step_time_s"] == pytest.approx(0.5)
    assert first["tokens_per_s"] == pytest.approx(2000.0)


def test_compile_times_are_logged_once_something_compiled(caplog):
    """train.compile_times: torch's own table of where compiling went (dynamo's stages at least, with any backend)."""
    fn = torch.compile(lambda x: torch.sin(x) * 2, backend="eager", dynamic=False)
    fn(torch.ones(3))
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        startup.log_compile_times()
    table = [m for m in caplog.messages if m.startswith("compile times (train.compile_times):")]
    assert len(table) == 1 and "_compile.compile_inner, " in table[0], caplog.messages
