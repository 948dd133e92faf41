"""The threaded pipeline on CPU, real threads: replicas stay identical, 1 replica equals the single-device trainer,
the result never depends on thread timing, resume is exact, and every failure stops the run with the worker named."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import RUN_HANG_GUARD_S, STOP_HANG_GUARD_S, assert_same_weights, single_loop_as_the_pipeline_runs

from dflash_train.config import ConfigError, load_config
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.pipeline.drafter_worker import RecompileGuard
from dflash_train.pipeline.faults import ENV_VAR, parse_faults
from dflash_train.pipeline.worker import THREAD_PREFIX

METRICS = ("loss", "acc", "cond_acc", "tau_est", "lr")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def cfg_for(target, out, targets=("cpu",), drafters=("cpu",), **over):
    ov = [f"model.target={target}", f"run.out_dir={out}", f"pipeline.target_devices=[{','.join(targets)}]",
          f"pipeline.drafter_devices=[{','.join(drafters)}]", "train.max_steps=12", "train.log_every=1"]
    return load_config("tiny_cpu", ov + [f"{k}={v}" for k, v in over.items()])


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]




def test_two_replicas_stay_identical_every_step(tiny_llama, tmp_path, thawed_heap):
    res = train_pipeline(cfg_for(tiny_llama, tmp_path / "run", drafters=("cpu", "cpu"), **{"train.log_every": 4}))
    assert res.steps == 12 and len(res.replica_checksums) == 12
    for step, (c0, c1) in enumerate(res.replica_checksums, start=1):
        assert c0 == c1, f"replicas differ after step {step}"
    assert len(set(c[0] for c in res.replica_checksums)) == 12  # the weights do change every step
    assert res.replica_batches == [list(range(0, 24, 2)), list(range(1, 24, 2))]  # each batch once, i -> i % 2
    assert [h["step"] for h in res.history] == [4, 8, 12]
    assert {"drafter_wait", "target_wait", "queues", "grad_norm", "grad_norm_max", "clipped"} <= res.history[-1].keys()
    assert all(0 < h["grad_norm"] <= h["grad_norm_max"] and 0 <= h["clipped"] <= 1 for h in res.history)
    busy = res.stage_fractions["busy_by_worker"]  # each worker's own share; the stage figure is their mean
    assert set(busy) == {"target0", "drafter0", "drafter1"} and all(0 < v <= 1 for v in busy.values())
    assert res.stage_fractions["drafter_busy"] == pytest.approx((busy["drafter0"] + busy["drafter1"]) / 2, rel=0.05)
    log_text = (tmp_path / "run" / "run.log").read_text()
    assert "step     12/12" in log_text and "drafter_wait" in log_text and "done: 12 steps" in log_text
    # the heap frozen for the training loop and unfrozen after it; each window's collections timed (training/heap.py)
    assert "heap frozen: " in log_text and "garbage collections during training: " in log_text
    assert all(h["gc_s"] >= 0 for h in res.history) and gc.get_freeze_count() == 0
    assert (res.drafter_dir / "model.safetensors").is_file()
    assert not pipeline_threads()


def test_one_replica_equals_the_single_device_trainer_exactly(tiny_llama, tmp_path):
    pipe = train_pipeline(cfg_for(tiny_llama, tmp_path / "pipe"))
    ref = single_loop_as_the_pipeline_runs(cfg_for(tiny_llama, tmp_path / "ref"))
    assert len(pipe.history) == len(ref.history) == 12
    for p, r in zip(pipe.history, ref.history):
        assert {k: p[k] for k in METRICS} == {k: r[k] for k in METRICS}, p["step"]  # bit-exact, not approximate
    assert_same_weights(pipe.drafter_dir, ref.drafter_dir)


def test_result_does_not_depend_on_how_many_targets_race(tiny_llama, tmp_path):
    # Two target workers finish out of order; the prefetcher restores the order, so nothing changes.
    one = train_pipeline(cfg_for(tiny_llama, tmp_path / "one", drafters=("cpu", "cpu")))
    two = train_pipeline(cfg_for(tiny_llama, tmp_path / "two", targets=("cpu", "cpu"), drafters=("cpu", "cpu"),
                                 **{"pipeline.queue_depth": 1}))
    assert one.replica_checksums == two.replica_checksums
    assert one.replica_batches == two.replica_batches
    assert [h["loss"] for h in one.history] == [h["loss"] for h in two.history]
    assert set(two.stage_fractions["busy_by_worker"]) == {"target0", "target1", "drafter0", "drafter1"}


def test_steps_per_row_runs_the_target_once_a_row_and_equals_the_single_device_trainer(tiny_llama, tmp_path,
                                                                                       monkeypatch):
    """train.steps_per_row=2: the drafter trains two steps on each row's features, the target computes them once;
    the pipeline still equals the single-device trainer bit for bit, and a crash mid-row resumes exactly."""
    from dflash_train.models.feature_cache import RowFeatures

    computed = []
    real = RowFeatures.__call__

    def counting(self, index, compute):
        before = self.computed
        out = real(self, index, compute)
        computed.extend([index] * (self.computed - before))
        return out
    monkeypatch.setattr(RowFeatures, "__call__", counting)
    k2 = {"train.steps_per_row": 2}
    pipe = train_pipeline(cfg_for(tiny_llama, tmp_path / "pipe", **k2))
    assert computed == list(range(0, 12, 2))         # batches 0, 2, 4, ...: the first of each row
    ref = single_loop_as_the_pipeline_runs(cfg_for(tiny_llama, tmp_path / "ref", **k2))
    assert [{k: h[k] for k in METRICS} for h in pipe.history] == [{k: h[k] for k in METRICS} for h in ref.history]
    assert_same_weights(pipe.drafter_dir, ref.drafter_dir)
    plain = train_pipeline(cfg_for(tiny_llama, tmp_path / "plain"))
    assert [h["loss"] for h in plain.history][1:] != [h["loss"] for h in pipe.history][1:]  # other batches
    log = (tmp_path / "pipe" / "run.log").read_text()
    assert "12 steps, 2 steps per row (train.steps_per_row)" in log
    assert pipe.data["epochs"] == pytest.approx(12 / (2 * pipe.data["rows_per_epoch"]))  # passes over the rows
    # A crash after step 7 (checkpoint at step 5: mid-row) resumes to the same weights.
    run = tmp_path / "crashed"
    monkeypatch.setenv(ENV_VAR, "drafter0:step=7:raise")
    with pytest.raises(RuntimeError, match="drafter0 failed"):
        train_pipeline(cfg_for(tiny_llama, run, **{"train.checkpoint_every": 5}, **k2))
    monkeypatch.delenv(ENV_VAR)
    train_pipeline(cfg_for(tiny_llama, run, **{"run.resume": "auto"}, **k2))
    assert "resuming from" in (run / "run.log").read_text()
    assert_same_weights(run / "drafter_last", tmp_path / "pipe" / "drafter_last")
    with pytest.raises(ConfigError, match="train.steps_per_row=2 needs one target device and one drafter device"):
        train_pipeline(cfg_for(tiny_llama, tmp_path / "two", drafters=("cpu", "cpu"), **k2))


def test_accumulated_rows_update_as_replicas_do_and_resume_exactly(tiny_llama, tmp_path, monkeypatch):
    """train.accumulate=2: one replica trains two rows a step, their mean gradient in one update; that is the update
    two replicas make from the same two rows (the same batches, the same anchors), and the single-device trainer's.
    Steps count updates (epochs, tokens a step), and a crash resumes at the right row."""
    k2 = {"train.accumulate": 2, "train.max_steps": 6}
    acc = train_pipeline(cfg_for(tiny_llama, tmp_path / "acc", **k2))
    assert acc.steps == 6 and acc.replica_batches == [list(range(12))]
    two = train_pipeline(cfg_for(tiny_llama, tmp_path / "two", drafters=("cpu", "cpu"), **{"train.max_steps": 6}))
    assert two.replica_batches == [list(range(0, 12, 2)), list(range(1, 12, 2))]
    assert_same_weights(acc.drafter_dir, two.drafter_dir)  # (g0 + g1) * 0.5 == (g0 + g1) / 2, bit for bit
    for a, b in zip(acc.history, two.history):  # the mean, not the sum (AdamW alone would hardly tell)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    ref = single_loop_as_the_pipeline_runs(cfg_for(tiny_llama, tmp_path / "ref", **k2))
    assert [{k: h[k] for k in METRICS} for h in acc.history] == [{k: h[k] for k in METRICS} for h in ref.history]
    assert_same_weights(acc.drafter_dir, ref.drafter_dir)
    one = train_pipeline(cfg_for(tiny_llama, tmp_path / "one", **{"train.max_steps": 6}))
    assert acc.data["epochs"] == pytest.approx(2 * one.data["epochs"])  # a step trains two rows
    tokens = [h["tokens_per_s"] * h["step_time_s"] for h in (acc.history[-1], one.history[-1])]
    assert tokens[0] == pytest.approx(2 * tokens[1])
    assert "6 steps, 2 rows per step (2 accumulated a replica: train.accumulate)" in \
        (tmp_path / "acc" / "run.log").read_text()
    # A crash after step 4 (checkpoint at step 3: data position 6) resumes to the same weights.
    run = tmp_path / "crashed"
    monkeypatch.setenv(ENV_VAR, "drafter0:step=4:raise")
    with pytest.raises(RuntimeError, match="drafter0 failed"):
        train_pipeline(cfg_for(tiny_llama, run, **{"train.checkpoint_every": 3}, **k2))
    monkeypatch.delenv(ENV_VAR)
    resumed = train_pipeline(cfg_for(tiny_llama, run, **{"run.resume": "auto"}, **k2))
    assert resumed.replica_batches == [list(range(6, 12))]
    assert_same_weights(run / "drafter_last", tmp_path / "acc" / "drafter_last")
    with pytest.raises(ConfigError, match="train.accumulate=2 and train.steps_per_row=2 would put"):
        cfg_for(tiny_llama, tmp_path / "bad", **k2, **{"train.steps_per_row": 2})
    with pytest.raises(ConfigError, match="train.accumulate must be at least 1"):
        cfg_for(tiny_llama, tmp_path / "bad", **{"train.accumulate": 0})


def test_feature_cache_runs_the_target_once_a_row_and_trains_the_same_steps(tiny_llama, tmp_path):
    """train.feature_cache_gb: the rows kept from the first epoch cost no target forward in the later ones, and the
    training is step for step that of the same fixed rows with nothing kept (a budget below one row), and of the
    single-device trainer with the cache."""
    small = {"data.synthetic_samples": 12}
    kept = train_pipeline(cfg_for(tiny_llama, tmp_path / "kept", **small, **{"train.feature_cache_gb": 1}))
    rows = kept.data["rows_per_epoch"]
    assert 12 >= 2 * rows, "the test needs two epochs or more"
    assert kept.target_forwards == [rows]
    assert f"target0: feature cache kept {rows} rows" in (tmp_path / "kept" / "run.log").read_text()
    none = train_pipeline(cfg_for(tiny_llama, tmp_path / "none", **small, **{"train.feature_cache_gb": 1e-12}))
    assert none.target_forwards == [12]
    assert [{k: h[k] for k in METRICS} for h in kept.history] == [{k: h[k] for k in METRICS} for h in none.history]
    assert_same_weights(kept.drafter_dir, none.drafter_dir)
    host = train_pipeline(cfg_for(tiny_llama, tmp_path / "host", **small, **{"train.feature_cache_gb": 0,
                                                                            "train.feature_cache_host_gb": 1}))
    assert host.target_forwards == [rows]  # every row kept in host memory: the same rows, the same steps
    assert f"+ {rows} in host memory" in (tmp_path / "host" / "run.log").read_text()
    assert [{k: h[k] for k in METRICS} for h in host.history] == [{k: h[k] for k in METRICS} for h in none.history]
    ref = single_loop_as_the_pipeline_runs(cfg_for(tiny_llama, tmp_path / "ref", **small,
                                                   **{"train.feature_cache_gb": 1}))
    assert [{k: h[k] for k in METRICS} for h in kept.history] == [{k: h[k] for k in METRICS} for h in ref.history]
    with pytest.raises(ConfigError, match="train.feature_cache_gb must be 0"):
        cfg_for(tiny_llama, tmp_path / "bad", **{"train.feature_cache_gb": -1})


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_a_crash_is_exact(optimizer, tiny_llama, tmp_path, monkeypatch):
    opt = {"train.optimizer": optimizer}
    straight = train_pipeline(cfg_for(tiny_llama, tmp_path / "straight", drafters=("cpu", "cpu"), **opt))
    run = tmp_path / "crashed"
    monkeypatch.setenv(ENV_VAR, "drafter1:step=7:raise")
    with pytest.raises(RuntimeError, match="drafter1 failed"):
        train_pipeline(cfg_for(tiny_llama, run, drafters=("cpu", "cpu"), **{"train.checkpoint_every": 5}, **opt))
    monkeypatch.delenv(ENV_VAR)
    other = "adamw" if optimizer == "muon" else "muon"
    with pytest.raises(ConfigError, match=f"already holds a different run \\(train.optimizer '{optimizer}' -> "):
        train_pipeline(cfg_for(tiny_llama, run, drafters=("cpu", "cpu"),
                               **{"run.resume": "auto", "train.optimizer": other}))
    resumed = train_pipeline(cfg_for(tiny_llama, run, drafters=("cpu", "cpu"), **{"run.resume": "auto"}, **opt))
    assert "resuming from" in (run / "run.log").read_text()
    assert resumed.replica_checksums == straight.replica_checksums[5:]  # steps 6..12, trained once more
    assert_same_weights(resumed.drafter_dir, straight.drafter_dir)


@pytest.mark.parametrize("fault, needle", [
    ("drafter1:warmup:raise", "drafter1 failed during startup:\nTraceback"),
    ("target0:step=3:raise", "target0 failed:\nTraceback"),
    ("loader:step=2:raise", "loader failed:\nTraceback"),
])
def test_a_failing_worker_stops_the_run_and_is_named(fault, needle, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, fault)
    with pytest.raises(RuntimeError) as info:  # a run that never stops is failed by pytest-timeout (pyproject)
        train_pipeline(cfg_for(tiny_llama, tmp_path / "run", drafters=("cpu", "cpu"),
                               **{"train.max_steps": 1000}))
    message = str(info.value)
    assert message.startswith(needle), message
    assert f"InjectedFault: injected fault {fault}" in message and "faults.py" in message
    assert not pipeline_threads()
    assert (tmp_path / "run" / "run.log").read_text().rstrip().endswith(f"InjectedFault: injected fault {fault}")


def test_a_stalled_worker_is_reported_not_waited_on(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "drafter1:step=2:stall")
    with pytest.raises(RuntimeError, match=r"drafter1 stalled: no progress for \d+\.\d s \(pipeline.stall_timeout_s=2\)"
                       ) as info:
        train_pipeline(cfg_for(tiny_llama, tmp_path / "run", drafters=("cpu", "cpu"),
                               **{"train.max_steps": 1000, "pipeline.stall_timeout_s": 2.0}))
    assert "faults.py" in str(info.value)  # where the stuck thread was
    assert not pipeline_threads()


def test_recompile_guard_fails_loudly():
    guard = RecompileGuard(enabled=True)
    guard.arm()
    guard.check("drafter0", 1)
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    with pytest.raises(RuntimeError, match="drafter0: 1 frame.s. recompiled after warm-up"):
        guard.check("drafter0", 2)


def test_config_errors(tiny_llama, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="must look like worker:phase:kind"):
        parse_faults("drafter0:step=x:raise")
    with pytest.raises(ConfigError, match="is not a device"):
        train_pipeline(cfg_for(tiny_llama, tmp_path / "r", drafters=("gpu0",)))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is visible"):
            train_pipeline(cfg_for(tiny_llama, tmp_path / "r", drafters=("cuda:0",)))
    with pytest.raises(ConfigError, match="grad_reduce must be 'host' or 'nccl'"):
        load_config("tiny_cpu", ["pipeline.grad_reduce=ring"])
    with pytest.raises(ConfigError, match="grad_reduce=nccl needs CUDA drafter devices"):
        train_pipeline(cfg_for(tiny_llama, tmp_path / "r", drafters=("cpu", "cpu"), **{"pipeline.grad_reduce": "nccl"}))


def test_nccl_grad_reduce_protocol_gives_every_replica_the_mean(monkeypatch):
    """pipeline.grad_reduce=nccl's threading protocol (copy in, one collective queued by replica 0, divide, copy
    back), on CPU with the collective replaced by an in-place sum: over rounds whose buffers are reused, every
    replica ends each round with the exact mean of that round's gradients, and log rounds also average metrics.
    The real NCCL call runs on GPUs only (docs/BENCHMARKS.md)."""
    from dflash_train.pipeline import gradsync
    from dflash_train.pipeline.worker import RunControl, Worker

    def fake_all_reduce(buffers, streams):
        total = sum(b.clone() for b in buffers)
        for b in buffers:
            b.copy_(total)
    monkeypatch.setattr(gradsync, "nccl_all_reduce", fake_all_reduce)
    n, rounds = 3, 5
    control = RunControl()
    avg = gradsync.GradAverager(n, control, method="nccl")
    params = [[torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))] for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    grads = {(r, k): [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)] for r in range(n)
             for k in range(rounds)}
    losses = {(r, k): torch.tensor(float(10 * k + r)) for r in range(n) for k in range(rounds)}
    seen: dict = {}
    errors: list = []

    def replica(r: int) -> None:
        try:
            run_replica(r)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
            control.stop.set()

    def run_replica(r: int) -> None:
        w = Worker(f"drafter{r}", control)
        avg.prepare(r, params[r], {"loss": torch.zeros(())})
        for k in range(rounds):
            for p, g in zip(params[r], grads[r, k]):
                p.grad.copy_(g)  # in place, as DrafterStep's persistent .grad buffers
            log = k % 2 == 0
            out = avg.all_reduce(r, params[r], {"loss": losses[r, k]} if log else None, w.wait_for, w.beat)
            seen[r, k] = ([p.grad.clone() for p in params[r]], out)

    for p_list in params:
        for p in p_list:
            p.grad = torch.zeros_like(p)
    threads = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STOP_HANG_GUARD_S)  # hang guard: a replica still waiting fails the count below
    assert not errors and len(seen) == n * rounds, errors
    for k in range(rounds):
        mean = [sum(grads[r, k][i] for r in range(n)) / n for i in range(2)]
        for r in range(n):
            got, metrics = seen[r, k]
            for g, m in zip(got, mean):
                torch.testing.assert_close(g, m)
            assert torch.equal(got[0], seen[0, k][0][0])  # the same bits on every replica
            if k % 2 == 0:
                assert float(metrics["loss"]) == pytest.approx(sum(10 * k + q for q in range(n)) / n)
            else:
                assert metrics is None


def _cli(args, tmp_path, env_extra=None, **popen):
    env = dict(os.environ, PYTHONPATH=SRC, **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", "train", "--config", "tiny_cpu", *args],
                            env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_cli_trains_and_fails_with_the_worker_named(tiny_llama, tmp_path):
    ok = _cli([f"model.target={tiny_llama}", f"run.out_dir={tmp_path}/ok", "train.max_steps=4"], tmp_path)
    bad = _cli([f"model.target={tiny_llama}", f"run.out_dir={tmp_path}/bad", "train.max_steps=50"], tmp_path,
               {ENV_VAR: "target0:step=1:raise"})
    out, err = ok.communicate(timeout=RUN_HANG_GUARD_S)
    assert ok.returncode == 0, err
    assert "drafter written to" in out
    out, err = bad.communicate(timeout=RUN_HANG_GUARD_S)
    assert bad.returncode != 0
    assert "target0 failed:" in err and "InjectedFault" in err.strip().splitlines()[-1]


def test_sigterm_stops_cleanly_and_checkpoints(tiny_llama, tmp_path):
    run = tmp_path / "run"
    proc = _cli([f"model.target={tiny_llama}", f"run.out_dir={run}", "train.max_steps=100000",
                 "train.log_every=1"], tmp_path)
    for line in proc.stdout:  # wait until it trains
        if "step      3/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=STOP_HANG_GUARD_S)
    assert proc.returncode == 0, err  # a scheduler's polite stop: a normal end after the checkpoint
    assert "stopped by SIGTERM at step" in err.strip().splitlines()[-1]
    state = torch.load(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                       / "training_state.pt", weights_only=False)
    assert state["step"] >= 3 and state["data_position"] == state["step"]
    assert "SIGTERM: stopped after step" in (run / "run.log").read_text()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] <= state["step"]


@pytest.mark.parametrize("graph, validation_graphs", [("training", 0), ("own", 1)])
def test_compiled_replicas_compile_once_each_and_never_again(graph, validation_graphs, tiny_llama, tmp_path,
                                                             monkeypatch):
    # Each replica has its own code object, so its own graph; both compile during warm-up, and the armed guard fails
    # any step that recompiles. With train.validation_graph=own replica 0 also compiles validation's forward-only
    # step during warm-up (one more); with training (the default) validation compiles nothing. Inductor's C++ codegen takes 20-90 s on this CPU, so the step is compiled with the
    # aot_eager backend: the same dynamo + AOT-autograd path per replica, in seconds. Inductor and CUDA graphs in
    # worker threads are exercised on the GPU (benchmarks/gpu_pipeline_check.py).
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager", dynamic=False))
    before = counters["stats"]["unique_graphs"]
    res = train_pipeline(cfg_for(tiny_llama, tmp_path / "run", drafters=("cpu", "cpu"),
                                 **{"train.compile": "default", "train.max_steps": 4,
                                    "train.validation_graph": graph}))
    assert counters["stats"]["unique_graphs"] - before == 2 + validation_graphs
    assert len(res.val_history) == 1  # at the end; the guard saw no compile after warm-up
    assert res.steps == 4 and all(c0 == c1 for c0, c1 in res.replica_checksums)
