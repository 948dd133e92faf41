"""train.profile_after / profile_steps: a trace of the steps asked for, from the pipeline and the single-device
trainer, also when the run ends inside the window; and the device-busy arithmetic its log line rests on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import single_loop_as_the_pipeline_runs

from dflash_train.config import ConfigError, load_config
from dflash_train.pipeline.coordinator import run_log_file, train_pipeline
from dflash_train.training.profiling import union_length


def cfg_for(target, out, **over):
    ov = [f"model.target={target}", f"run.out_dir={out}", "pipeline.target_devices=[cpu]",
          "pipeline.drafter_devices=[cpu]", "train.max_steps=8", "train.log_every=1"]
    return load_config("tiny_cpu", ov + [f"{k}={v}" for k, v in over.items()])


def test_busy_time_is_the_union_of_overlapping_kernels():
    assert union_length([]) == 0
    assert union_length([(5, 6), (0, 2), (1, 3)]) == 4     # overlapping streams count once, gaps not at all
    assert union_length([(0, 10), (2, 3), (9, 12)]) == 12  # a kernel inside another adds nothing


def test_the_trace_reader_finds_the_idle_gaps_between_kernels(tmp_path, capsys, monkeypatch):
    """benchmarks/trace_gaps.py, which reads these traces from a GPU: the merged kernel time, and the gaps with the
    kernels on either side and the host call running when each began."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import trace_gaps
    kernels = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d, "args": {"stream": s}}
               for n, ts, d, s in (("fwd", 0, 10, 7), ("copy", 5, 10, 8), ("bwd", 100, 10, 7), ("adam", 112, 3, 7))]
    spans = trace_gaps.busy_intervals(kernels)
    assert [(a, b) for a, b, _, _ in spans] == [(0, 15), (100, 110), (112, 115)]
    assert sum(b - a for a, b, _, _ in spans) == union_length([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    host = {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 14, "dur": 90, "tid": 3}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": kernels + [host]}))
    trace_gaps.main([str(path), "--min-us", "50", "--settle-ms", "0.05"])
    out = capsys.readouterr().out
    assert "in kernels 0.03 ms (24.3%)" in out and "in 2 gaps" in out
    assert "in the first 0.05 ms: idle 0.09 ms in 1 gaps" in out and "after it: idle 0.00 ms in 1 gaps, none" in out
    assert "85.0 us at +0.015 ms: after copy -> bwd" in out and "host: aten::item (tid 3)" in out
    assert "2.0 us" not in out  # below --min-us


def traced_ops(run_dir) -> list[dict]:
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("runner", ["pipeline", "single"])
def test_the_steps_asked_for_are_traced(runner, tiny_llama, tmp_path):
    out = tmp_path / "run"
    cfg = cfg_for(tiny_llama, out, **{"train.profile_after": 3, "train.profile_steps": 2})
    if runner == "pipeline":
        train_pipeline(cfg)
    else:  # the CLI gives this trainer its run.log
        out.mkdir()
        with run_log_file(out):
            single_loop_as_the_pipeline_runs(cfg)
    log = (out / "run.log").read_text()
    assert "profile of steps 4-5: " in log and f"trace and kernel table in {out / 'profile'}" in log
    assert any(e["name"].startswith("aten::") for e in traced_ops(out))   # the drafter's operators
    assert "Self CPU" in (out / "profile" / "kernels.txt").read_text()


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tiny_llama, tmp_path):
    out = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, out, **{"train.profile_after": 6, "train.profile_steps": 20}))
    assert "profile of steps 7-8: " in (out / "run.log").read_text()
    assert traced_ops(out)


def test_off_by_default_and_checked(tiny_llama, tmp_path):
    out = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, out, **{"train.max_steps": 3}))
    assert not (out / "profile").exists() and "profile of steps" not in (out / "run.log").read_text()
    late = tmp_path / "late"  # asked past the last step: said at the start, not silently nothing
    train_pipeline(cfg_for(tiny_llama, late, **{"train.max_steps": 3, "train.profile_after": 3}))
    assert "train.profile_after=3 is outside this run's steps (1 to 3): nothing will be traced; set it from 1 to 2." \
        in (late / "run.log").read_text()
    assert not (late / "profile").exists()
    with pytest.raises(ConfigError, match="train.profile_steps"):
        cfg_for(tiny_llama, out, **{"train.profile_steps": 0})
    with pytest.raises(ConfigError, match="train.profile_after"):
        cfg_for(tiny_llama, out, **{"train.profile_after": -1})


def test_tracing_compiled_steps_recompiles_nothing(tiny_llama, tmp_path, monkeypatch):
    """The profiler switched on between two compiled steps must not make dynamo compile them again: the pipeline's
    recompile guard would stop the run. aot_eager: the same dynamo + AOT-autograd path as inductor, in seconds."""
    import torch

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager", dynamic=False))
    out = tmp_path / "run"
    res = train_pipeline(cfg_for(tiny_llama, out, **{"train.compile": "default", "train.max_steps": 6,
                                                     "train.profile_after": 2, "train.profile_steps": 2}))
    assert res.steps == 6 and "profile of steps 3-4: " in (out / "run.log").read_text()
    assert any("CompiledFunction" in e["name"] for e in traced_ops(out))  # the compiled step ran inside the window


def test_a_window_this_process_never_reaches_is_said_at_the_start(tmp_path, caplog):
    """A resumed run starts past step `done`: a window ending there, or one past the last step, traces nothing,
    and the warning says which steps would."""
    import logging

    import torch

    from dflash_train.training.profiling import StepProfiler

    caplog.set_level(logging.WARNING, logger="dflash_train")
    cpu = torch.device("cpu")
    assert StepProfiler(800, 20, tmp_path, cpu, done=0, total_steps=2000).enabled
    resumed = StepProfiler(800, 20, tmp_path, cpu, done=1000, total_steps=2000)
    assert not resumed.enabled
    assert "train.profile_after=800 is outside this run's steps (1001 to 2000): nothing will be traced; set it from " \
           "1001 to 1999." in caplog.text
    assert not StepProfiler(800, 20, None, cpu).enabled  # ranks other than 0 write nothing
