"""Reliability on CPU: exact resume after SIGKILL, atomic checkpoints, the fault matrix, signals and bad input.

docs/RELIABILITY.md lists every cell of the fault matrix with its outcome and the test that proves it. Matrix runs
are in-process (a tiny target, 2 drafter replicas, 12 steps, a checkpoint every 4): about a second each, a stall
cell the stall timeout more. Signals and SIGKILL go through the real CLI in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import RUN_HANG_GUARD_S, STOP_HANG_GUARD_S

from dflash_train.cli import main as cli_main
from dflash_train.config import load_config
from dflash_train.data.packing import BatchSchedule
from dflash_train.data.synthetic import synthetic_samples
from dflash_train.errors import UserError
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.pipeline.faults import ENV_VAR, FaultPlan, RANK_ENV_VAR, parse_faults
from dflash_train.pipeline.worker import THREAD_PREFIX
from dflash_train.training.checkpointing import STATE_NAME, CheckpointManager
from dflash_train.training.run import RUN_CONFIG_NAME

SRC = str(Path(__file__).resolve().parents[1] / "src")
STALL_S = 2.0     # pipeline.stall_timeout_s of stall cells: far above any step here, even on a loaded 2-core box
SIGKILL_SEED = 20261201  # fixed: a failure reruns with the same kill point (the message names it)


def matrix_cfg(target, out, **over):
    ov = [f"model.target={target}", f"run.out_dir={out}", "pipeline.target_devices=[cpu]",
          "pipeline.drafter_devices=[cpu,cpu]", "train.max_steps=12", "train.checkpoint_every=4",
          "train.log_every=1"]
    return load_config("tiny_cpu", ov + [f"{k}={v}" for k, v in over.items()])


def dflash_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def latest_step(out: Path) -> int | None:
    """The step `latest` names, after checking that checkpoint loads and no half-written one is left behind."""
    ckpt = CheckpointManager(out)
    assert not list(ckpt.root.glob(".step_*.tmp")), "a half-written checkpoint was left behind"
    if not ckpt.step_dirs():
        return None
    found = ckpt.load_latest()
    assert found is not None and found[2] == ckpt.latest(), "the latest checkpoint does not load"
    return found[1]["step"]


@pytest.fixture(scope="module")
def straight(tiny_llama, tmp_path_factory):
    """The uninterrupted matrix run: the reference of every resume here."""
    return train_pipeline(matrix_cfg(tiny_llama, tmp_path_factory.mktemp("straight") / "run"))


def assert_same_final_weights(res, ref):
    from safetensors.torch import load_file
    a, b = (load_file(str(Path(r.drafter_dir) / "model.safetensors")) for r in (res, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_faulty(monkeypatch, cfg, fault: str):
    """Train with DFLASH_FAULT=fault; (exception, seconds). Asserts no pipeline thread outlives the run."""
    monkeypatch.setenv(ENV_VAR, fault)
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        train_pipeline(cfg)
    seconds = time.monotonic() - t0  # for lower bounds only: a stall is reported no sooner than its timeout
    assert not dflash_threads(), dflash_threads()
    return info.value, seconds


# ------------------------------------------------------------------------------------------ the fault matrix
# (fault, expected `latest` step after it: an int, None for no checkpoint, "any" when it depends on how far the
# other stages got). Startup faults come before the first step; checkpoint=0/1 is the step-4/8 write by drafter0,
# checkpoint=2 the coordinator's final one at step 12 (the writer fails mid-write: the previous one stays latest;
# any other worker fails while the writer holds the write open: that write completes).
POINTS = {
    "loader": [("startup", None), ("step=20", "any"), ("checkpoint=0", 4), ("shutdown", "any")],
    "target0": [("startup", None), ("step=20", "any"), ("checkpoint=0", 4), ("shutdown", "any")],
    "prefetch": [("startup", None), ("step=16", "any"), ("checkpoint=0", 4), ("shutdown", "any")],
    "drafter1": [("startup", None), ("step=6", "any"), ("checkpoint=0", 4), ("shutdown", 8)],
    "drafter0": [("checkpoint=1", 4)],  # the periodic writer
    "coordinator": [("startup", None), ("step=6", "any"), ("checkpoint=0", 4), ("checkpoint=2", 8),
                    ("shutdown", 8)],
}
CELLS = [(f"{w}:{p}", latest) for w, points in POINTS.items() for p, latest in points]
OOM_CELLS = [("drafter0:startup", None), ("drafter1:step=3", "any"), ("target0:step=5", "any"),
             ("loader:step=3", "any"), ("prefetch:step=5", "any"), ("coordinator:checkpoint=2", 8)]


def _when(point: str) -> str:
    return {"startup": " during startup", "shutdown": " during shutdown"}.get(point.split(":")[1], "")


def _check_latest(out: Path, expected) -> None:
    step = latest_step(out)
    if expected == ">=4":
        assert step is not None and step >= 4, f"latest is step {step}, expected at least 4"
    elif expected != "any":
        assert step == expected, f"latest is step {step}, expected {expected}"


@pytest.mark.parametrize("point, latest", CELLS, ids=[c[0] for c in CELLS])
def test_exception_stops_the_run_naming_the_worker(point, latest, tiny_llama, tmp_path, monkeypatch):
    fault = f"{point}:raise"
    err, _ = run_faulty(monkeypatch, matrix_cfg(tiny_llama, tmp_path / "run"), fault)
    worker = point.split(":")[0]
    assert type(err) is RuntimeError and str(err).startswith(f"{worker} failed{_when(point)}:\nTraceback"), err
    assert str(err).rstrip().endswith(f"InjectedFault: injected fault {fault}")
    _check_latest(tmp_path / "run", latest)


@pytest.mark.parametrize("point, latest", OOM_CELLS, ids=[c[0] for c in OOM_CELLS])
def test_out_of_memory_names_the_worker_and_the_fix(point, latest, tiny_llama, tmp_path, monkeypatch):
    err, _ = run_faulty(monkeypatch, matrix_cfg(tiny_llama, tmp_path / "run"), f"{point}:oom")
    worker = point.split(":")[0]
    first = str(err).splitlines()[0]
    assert first.startswith(f"{worker} failed{_when(point)}: out of memory; lower train.token_budget or "
                            "train.num_anchors"), first
    assert "torch.OutOfMemoryError" in str(err)
    _check_latest(tmp_path / "run", latest)


@pytest.mark.parametrize("point, latest", CELLS, ids=[c[0] for c in CELLS])
def test_stall_is_reported_with_where_it_is_stuck(point, latest, tiny_llama, tmp_path, monkeypatch):
    cfg = matrix_cfg(tiny_llama, tmp_path / "run", **{"pipeline.stall_timeout_s": STALL_S})
    err, seconds = run_faulty(monkeypatch, cfg, f"{point}:stall")
    worker = point.split(":")[0]
    assert type(err) is RuntimeError
    assert str(err).startswith(f"{worker} stalled: no progress for "), err
    assert f"(pipeline.stall_timeout_s={STALL_S:g}); it is here:\n" in str(err) and "faults.py" in str(err)
    assert seconds > STALL_S
    # A stalled writer abandons its checkpoint; another worker stalled during a write lets it complete, and the
    # stages it does not block may train on (and checkpoint) until the stall is detected.
    _check_latest(tmp_path / "run", ">=4" if point.endswith("checkpoint=0") else latest)


def test_nonfinite_steps_are_skipped_on_every_replica(tiny_llama, tmp_path, monkeypatch):
    # NaN in one replica's gradients, Inf in the other's, NaN target features (so one replica's loss): the averaged
    # gradients are non-finite each time, so both replicas skip the update, and stay identical.
    monkeypatch.setenv(ENV_VAR, "drafter1:step=2:nan,drafter0:step=7:inf,target0:step=9:nan")
    res = train_pipeline(matrix_cfg(tiny_llama, tmp_path / "run"))
    skipped = [3, 8, 5]  # 1-based steps: drafter step index 2, 7; batch 9 is step 5's second batch
    assert res.steps == 12 and res.skipped_steps == 3
    weights = [c[0] for c in res.replica_checksums]
    assert all(c0 == c1 for c0, c1 in res.replica_checksums)
    for step in range(2, 13):
        assert (weights[step - 1] == weights[step - 2]) == (step in skipped), step
    by_step = {h["step"]: h for h in res.history}
    assert all(not torch.isfinite(torch.tensor(by_step[s]["loss"])) for s in skipped)
    assert [by_step[s]["skipped"] for s in (2, 3, 5, 8, 12)] == [0, 1, 2, 3, 3]
    log = (tmp_path / "run" / "run.log").read_text()
    assert "step      8/12 | loss inf" in log and "| skipped 3" in log
    assert "step 5: non-finite loss or gradients, update skipped on every replica (2 so far)" in log
    assert latest_step(tmp_path / "run") == 12


def test_nonfinite_stop_names_the_step(tiny_llama, tmp_path, monkeypatch):
    cfg = matrix_cfg(tiny_llama, tmp_path / "run", **{"train.nonfinite": "stop"})
    err, _ = run_faulty(monkeypatch, cfg, "drafter1:step=5:nan")
    assert isinstance(err, UserError), err  # the CLI prints one line: error: drafterN: Step 6 has ...
    assert str(err).startswith(("drafter0: Step 6 has a non-finite loss", "drafter1: Step 6 has a non-finite loss"))
    assert "train.nonfinite=skip" in str(err) and "\n" not in str(err)
    assert latest_step(tmp_path / "run") == 4


def test_fault_specs_parse_and_reject_nonsense():
    f = parse_faults("drafter0:warmup:raise, coordinator:checkpoint:stall,target1:step=3:nan")
    assert [(x.worker, x.phase, x.n, x.kind) for x in f] == [("drafter0", "startup", None, "raise"),
                                                            ("coordinator", "checkpoint", 0, "stall"),
                                                            ("target1", "step", 3, "nan")]
    assert str(f[0]) == "drafter0:warmup:raise"  # messages quote the spec as written
    for bad in ("drafter:startup:raise", "loader:step=1:explode", "loader:step=1:nan", "drafter0:startup:inf",
                "prefetch:step=x:raise", "coordinator:step=2"):
        with pytest.raises(UserError, match=ENV_VAR):
            parse_faults(bad)


def test_a_run_without_faults_carries_no_plan(monkeypatch):
    """The fault-injection seam: no DFLASH_FAULT (or faults for another rank) is no plan at all, so every injection
    point is one `is None` test and checkpoints get no hook; faults for this rank are a plan."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(RANK_ENV_VAR, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert FaultPlan.from_env() is None
    monkeypatch.setenv(ENV_VAR, " , ")
    assert FaultPlan.from_env() is None
    monkeypatch.setenv(ENV_VAR, "drafter0:step=2:raise")
    assert [str(f) for f in FaultPlan.from_env().faults] == ["drafter0:step=2:raise"]
    monkeypatch.setenv(RANK_ENV_VAR, "1")
    assert FaultPlan.from_env() is None  # this process is rank 0
    monkeypatch.setenv("RANK", "1")
    assert FaultPlan.from_env() is not None


# ------------------------------------------------------------------------------------------ checkpoints

def test_checkpoint_interrupted_mid_write_never_becomes_latest(straight, tiny_llama, tmp_path, monkeypatch):
    run = tmp_path / "run"
    err, _ = run_faulty(monkeypatch, matrix_cfg(tiny_llama, run), "drafter0:checkpoint=1:raise")
    assert str(err).startswith("drafter0 failed:") and "checkpointing.py" in str(err)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert not (run / "checkpoints" / "step_00000008").exists()
    assert latest_step(run) == 4
    monkeypatch.delenv(ENV_VAR)
    resumed = train_pipeline(matrix_cfg(tiny_llama, run, **{"run.resume": "auto"}))
    assert resumed.replica_checksums == straight.replica_checksums[4:]
    assert_same_final_weights(resumed, straight)


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(straight, tiny_llama, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(straight.out_dir, run)
    saved = yaml.safe_load((run / RUN_CONFIG_NAME).read_text())
    (run / RUN_CONFIG_NAME).write_text(yaml.safe_dump(dict(saved, run=dict(saved["run"], out_dir=str(run)))))
    ckpt = CheckpointManager(run)
    assert [d.name for d in ckpt.step_dirs()] == ["step_00000004", "step_00000008", "step_00000012"]
    weights = ckpt.root / "step_00000012" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])        # truncated weights
    state = ckpt.root / "step_00000008" / STATE_NAME
    state.write_bytes(state.read_bytes()[:100])                                      # truncated training state
    _, st, path = ckpt.load_latest()
    assert path.name == "step_00000004" and st["step"] == 4 and st["data_position"] == 8
    warnings = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
    assert len(warnings) == 2 and "step_00000012" in warnings[0] and "step_00000008" in warnings[1]
    # A training state that loads but is not this step's is refused too.
    torch.save({"step": 8}, state)
    assert ckpt.load_latest()[2].name == "step_00000004"
    resumed = train_pipeline(matrix_cfg(tiny_llama, run, **{"run.resume": "auto"}))
    assert resumed.replica_checksums == straight.replica_checksums[4:]
    assert_same_final_weights(resumed, straight)


def test_data_position_alone_resumes_data_and_anchors():
    # Nothing in training draws from a global RNG: the data order is seeded by (seed, epoch), each batch's anchors
    # by (seed, batch index). So the saved data position reproduces the batches exactly, whatever the RNG state.
    schedule = BatchSchedule(synthetic_samples(64, period=8, seed=0, max_len=96), 256, 32, seed=0, max_batches=40)
    whole = list(schedule)
    torch.manual_seed(1234)
    random.seed(99)
    resumed = list(schedule.iter_from(27))
    assert [b.index for b in resumed] == list(range(27, 40))
    for a, b in zip(whole[27:], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


# ------------------------------------------------------------------------------------------ the CLI, for real

def _cli(args: list[str], cwd: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env.update(PYTHONPATH=SRC, **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", "train", "--config", "tiny_cpu", *args],
                            env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_line(proc: subprocess.Popen, needle: str) -> None:
    for line in proc.stdout:
        if needle in line:
            return
    raise AssertionError(f"the run ended before {needle!r}: {proc.wait()} {proc.stderr.read()}")


def _last_record_per_step(path: Path) -> dict[int, dict]:
    """metrics.jsonl appends: a resumed run re-logs the steps after its checkpoint; the last record wins. Training
    records only (validation's split=val records share their step numbers)."""
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r for r in records if r.get("split", "train") == "train"}


@pytest.mark.slow  # three CLI processes
def test_sigkill_then_resume_continues_bit_exactly(tiny_llama, tmp_path):
    seed = SIGKILL_SEED
    rng = random.Random(seed)
    kill_after = rng.randint(5, 20)  # after the first checkpoint (step 4), well before the run ends
    args = [f"model.target={tiny_llama}", "train.max_steps=32", "train.checkpoint_every=4", "train.log_every=1"]
    ref = _cli(args + [f"run.out_dir={tmp_path}/ref"], tmp_path)
    run = tmp_path / "killed"
    proc = _cli(args + [f"run.out_dir={run}"], tmp_path)
    _wait_for_line(proc, f"step {kill_after:>6}/32")
    time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the next step, or in the checkpoint being written
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=STOP_HANG_GUARD_S)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_last_record_per_step(run / "metrics.jsonl"))
    resumed = _cli(args + [f"run.out_dir={run}", "run.resume=auto"], tmp_path)
    out, err = resumed.communicate(timeout=RUN_HANG_GUARD_S)
    assert resumed.returncode == 0, err
    assert "resuming from" in out
    out, err = ref.communicate(timeout=RUN_HANG_GUARD_S)
    assert ref.returncode == 0, err
    assert [d.name for d in CheckpointManager(run).step_dirs()] == [f"step_{s:08d}" for s in (24, 28, 32)]  # keep 3
    got, want = (_last_record_per_step(r / "metrics.jsonl") for r in (run, tmp_path / "ref"))
    assert sorted(got) == sorted(want) == list(range(1, 33))
    for step in want:  # bit-exact: floats through JSON round-trip exactly
        for key in ("loss", "acc", "cond_acc", "tau_est", "lr"):
            assert got[step][key] == want[step][key], (f"seed {seed}: killed after step {killed_at}", step, key)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_checkpoints_and_exits_with_a_summary(sig, code, tiny_llama, tmp_path):
    run = tmp_path / "run"
    proc = _cli([f"model.target={tiny_llama}", f"run.out_dir={run}", "train.max_steps=100000",
                 "train.log_every=1"], tmp_path)
    _wait_for_line(proc, "step      4/")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=STOP_HANG_GUARD_S)
    assert proc.returncode == code, err
    summary = err.strip().splitlines()[-1]
    step = latest_step(run)
    assert summary == (f"stopped by {sig.name} at step {step}; checkpoint at {run}/checkpoints/step_{step:08d}; "
                       "resume with run.resume=auto")
    assert step >= 4
    assert max(_last_record_per_step(run / "metrics.jsonl")) <= step


def test_second_ctrl_c_exits_at_once_without_a_checkpoint(tiny_llama, tmp_path):
    # The first Ctrl-C starts the checkpoint; a fault holds it open while its state is copied (as a stuck device
    # would), and the second Ctrl-C abandons it: exit 130 at once, and no checkpoint is left.
    run = tmp_path / "run"
    proc = _cli([f"model.target={tiny_llama}", f"run.out_dir={run}", "train.max_steps=100000", "train.log_every=1"],
                tmp_path, {ENV_VAR: "coordinator:checkpoint=0:stall"})
    _wait_for_line(proc, "step      3/")
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_HANG_GUARD_S
    while "; writing a checkpoint" not in (run / "run.log").read_text():  # the save begins: the stall follows
        assert proc.poll() is None, proc.stderr.read()
        if time.monotonic() > deadline:
            pytest.fail(f"hang guard: no checkpoint began within {STOP_HANG_GUARD_S} s of the first SIGINT")
        time.sleep(0.02)
    # The stalled write never ends by itself (pipeline.stall_timeout_s is 600 s): exit 130 is the second SIGINT's.
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=STOP_HANG_GUARD_S)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "second SIGINT: stopped at once, without a checkpoint"
    assert latest_step(run) is None


# ------------------------------------------------------------------------------------------ bad input

@pytest.fixture(scope="module")
def tiny_chat():
    return pytest.importorskip("tiny_chat")  # tests/tiny_chat.py: a byte-level chat tokenizer beside a tiny target


@pytest.fixture(scope="module")
def chat_target(tiny_chat, tmp_path_factory):
    return tiny_chat.make_tiny_chat_target(tmp_path_factory.mktemp("tiny_chat"))


def _train_cli(capsys, out: Path, *overrides: str) -> tuple[int, list[str]]:
    code = cli_main(["train", "--config", "tiny_cpu", f"run.out_dir={out}", "train.max_steps=4", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def _assert_one_error_line(code: int, err: list[str], *needles: str) -> None:
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert not any("Traceback" in line for line in err), err
    for needle in needles:
        assert needle in errors[0], errors[0]


def _chat_file(tmp_path: Path, name: str, records: list | None = None) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records or []))
    return path


@pytest.mark.parametrize("case", ["directory", "unreadable", "csv", "empty", "no_assistant_turn"])
def test_bad_data_is_one_error_line(case, tiny_chat, chat_target, tmp_path, capsys):
    if case == "directory":
        source, needles = tmp_path / "chats.jsonl", ("is a directory",)
        source.mkdir()
    elif case == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        source, needles = tiny_chat.write_chats(tmp_path / "chats.jsonl", 8), ("cannot be read", "permissions")
        source.chmod(0)
    elif case == "csv":
        source, needles = tmp_path / "chats.csv", ("is not a .json or .jsonl file",)
        source.write_text("user,assistant\nhi,hello\n")
    elif case == "empty":
        source, needles = _chat_file(tmp_path, "chats.jsonl"), ("holds no records",)
    else:
        questions = [{"conversations": [{"from": "human", "value": f"question {i}?"}]} for i in range(6)]
        source, needles = _chat_file(tmp_path, "chats.jsonl", questions), ("no usable", "no_assistant_turn")
    code, err = _train_cli(capsys, tmp_path / "run", f"model.target={chat_target}", f"data.source={source}")
    _assert_one_error_line(code, err, str(source.name), *needles)


def test_tokenizer_without_chat_template_is_one_error_line(tiny_chat, chat_target, tmp_path, capsys):
    target = tmp_path / "no_template"
    shutil.copytree(chat_target, target)
    for name in ("chat_template.jinja", "chat_template.json"):
        (target / name).unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    chats = tiny_chat.write_chats(tmp_path / "chats.jsonl", 8)
    code, err = _train_cli(capsys, tmp_path / "run", f"model.target={target}", f"data.source={chats}")
    _assert_one_error_line(code, err, "has no chat template")


def test_samples_longer_than_the_token_budget_are_truncated_and_counted(tiny_llama, tmp_path, capsys):
    # Synthetic documents are up to 96 tokens long; with a 64-token budget the longer ones are cut, not a crash.
    code = cli_main(["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", f"run.out_dir={tmp_path}/run",
                     "train.max_steps=3", "train.token_budget=64", "train.num_anchors=8"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if "longer than train.token_budget=64" in x)
    n, total = int(line.split()[1]), int(line.split()[3])  # "<time> n of total training samples ..."
    assert 0 < n < total and "truncated to its first 64 tokens" in line


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(writer, tiny_llama, tmp_path, capsys, monkeypatch):
    calls = {"n": 0}

    def full_disk(real):
        def save(*args, **kwargs):
            calls["n"] += 1
            # The first checkpoint fits, the second does not (a checkpoint writes one training state and two
            # safetensors files: the servable bf16 weights and the fp32 training weights).
            if calls["n"] == (2 if writer == "torch.save" else 3):
                if writer == "torch.save":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                   f'"{os.strerror(errno.ENOSPC)}" }})')  # what safetensors' Rust writer says
            return real(*args, **kwargs)
        return save

    import dflash_train.models.checkpoint as servable
    if writer == "torch.save":
        monkeypatch.setattr(torch, "save", full_disk(torch.save))
    else:
        monkeypatch.setattr(servable, "save_file", full_disk(servable.save_file))
    run = tmp_path / "run"
    code = cli_main(["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", f"run.out_dir={run}",
                     "train.max_steps=6", "train.checkpoint_every=2"])
    err = capsys.readouterr().err.strip().splitlines()
    _assert_one_error_line(code, err, "drafter0: The disk is full", f"{run}/checkpoints", "step_00000004",
                           "the previous checkpoint, step_00000002, is intact")
    assert latest_step(run) == 2


def test_a_failed_checkpoint_write_is_logged_when_another_failure_stops_the_run(tiny_llama, tmp_path, monkeypatch):
    """The periodic write of step 4 fails on the background writer (a full disk) and drafter1 fails at step 6, before
    drafter0 waits for that write again: the run reports drafter1's failure, and the write's error, which only the
    coordinator's final wait sees, is in the log too (docs/RELIABILITY.md: never lost)."""
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    run = tmp_path / "run"
    err, _ = run_faulty(monkeypatch, matrix_cfg(tiny_llama, run), "drafter1:step=5:raise")
    assert str(err).startswith("drafter1 failed:\nTraceback"), err
    log = (run / "run.log").read_text()
    assert "The disk is full: checkpoint step_00000004 could not be written" in log, log[-3000:]
    assert latest_step(run) is None


def test_out_dir_of_a_different_run_is_one_error_line(tiny_llama, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train_cli(capsys, run, f"model.target={tiny_llama}", "train.max_steps=2")[0] == 0
    code, err = _train_cli(capsys, run, f"model.target={tiny_llama}", "train.max_steps=2", "train.lr=1e-4")
    _assert_one_error_line(code, err, "already holds a different run", "run.overwrite=true")


def test_a_worker_inside_its_polling_wait_is_late_not_stuck():
    """Stall detection names a worker whose heartbeat is stale; one found inside its own polling wait (a queue it
    polls) was only not scheduled on a machine busier than the run, so the supervisor passes it over. A worker
    stuck in its own code, or in a fault fired from inside a wait, is not in a polling wait."""
    import queue
    import threading

    from dflash_train.pipeline.worker import RunControl, Worker

    inbox, release = queue.Queue(), threading.Event()

    class Poller(Worker):
        def setup(self):
            pass

        def loop(self):
            self.get(inbox)

    class Stuck(Worker):
        def setup(self):
            pass

        def loop(self):
            release.wait()  # its own work, blocked

    control = RunControl()
    workers = [Poller("poller", control), Stuck("stuck", control)]
    for w in workers:
        w.start()
    try:
        for _ in range(200):  # until both threads are blocked where they block
            if workers[0].in_polling_wait() and not workers[1].in_polling_wait() and workers[1].running:
                break
            threading.Event().wait(0.01)
        assert workers[0].in_polling_wait() and not workers[1].in_polling_wait()
    finally:
        inbox.put(None)
        release.set()
        for w in workers:
            w.thread.join()
