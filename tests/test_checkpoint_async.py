"""Checkpoints written in the background (issue #16): save() copies the state and returns, one writer thread writes
it, at most one write is in flight. Proven here on CPU: a checkpoint holds the state of the step it was taken at
(not what training changed meanwhile), is complete, atomic and loadable; `best` marked during the write follows it;
a write's error reaches the next save, wait() or close(), naming the checkpoint; a process SIGKILLed mid-write leaves
the previous complete checkpoint (or the new complete one), and resume continues from it. The snapshot is the
drafter's config and weights, no module: a DFlash 2 drafter's checkpoint is still DFlash 2's, servable and resumed."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import STOP_HANG_GUARD_S

from dflash_train.config import load_config
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import CheckpointError
from dflash_train.models.drafter2 import DFlash2Drafter
from dflash_train.models.target import target_config_info
from dflash_train.training import checkpointing
from dflash_train.training.checkpointing import CheckpointManager, load_training_weights, resume_point
from dflash_train.training.optim import build_scheduler

pytestmark = pytest.mark.usefixtures("one_thread")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def build_state(target, *overrides):
    """A tiny drafter, its AdamW and LR schedule (also used by the subprocess below)."""
    cfg = load_config("tiny_cpu", list(overrides))
    drafter = build_drafter(cfg.model, target_config_info(target))
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr)
    return drafter, opt, build_scheduler(opt, cfg.train, 10)


def train_step(drafter, opt, sched) -> None:
    """Stands in for a training step: every parameter and AdamW moment changes in place."""
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()


def host_copy(drafter, opt) -> tuple[dict, dict]:
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return weights, moments


def held_writer(monkeypatch, events: list):
    """Hold the background writer before its first file until `release` is set; `events` records each write's
    start and its `latest` update, in order."""
    started, release = threading.Event(), threading.Event()
    real_save, real_text = checkpointing.save_drafter, checkpointing._atomic_write_text

    def save_drafter(drafter, out):
        events.append(("start", Path(out).name))
        started.set()
        assert release.wait(STOP_HANG_GUARD_S), "hang guard: the test never released the writer"
        return real_save(drafter, out)

    def atomic_write_text(path, text):
        real_text(path, text)
        if path.name == "latest":
            events.append(("latest", text.strip()))

    monkeypatch.setattr(checkpointing, "save_drafter", save_drafter)
    monkeypatch.setattr(checkpointing, "_atomic_write_text", atomic_write_text)
    return started, release


def test_a_checkpoint_holds_the_state_it_was_taken_at(tiny_llama, tmp_path, monkeypatch):
    drafter, opt, sched = build_state(tiny_llama)
    train_step(drafter, opt, sched)
    weights, moments = host_copy(drafter, opt)
    ckpt = CheckpointManager(tmp_path, run_id="r")
    started, release = held_writer(monkeypatch, events := [])
    path = ckpt.save(1, drafter, opt, sched, data_position=2)
    assert started.wait(STOP_HANG_GUARD_S), "hang guard: the writer never started"
    assert not path.exists() and ckpt.latest() is None  # nothing is published before the write is complete
    train_step(drafter, opt, sched)  # training goes on while the writer holds the copy
    release.set()
    assert ckpt.wait() == path and events == [("start", ".step_00000001.tmp"), ("latest", "step_00000001")]
    assert not list(ckpt.root.glob(".step_*.tmp"))
    back, state, found = ckpt.load_latest()
    assert found == path and state["step"] == 1 and state["data_position"] == 2
    for k, v in back.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, weights[k]), k
        assert not torch.equal(v, drafter.state_dict()[k]), k  # the live weights moved on
    for i, s in state["optimizer"]["state"].items():
        assert all(torch.equal(v, moments[i][k]) for k, v in s.items()), i
    assert state["scheduler"]["last_epoch"] == 1 and sched.state_dict()["last_epoch"] == 2


def test_reserve_prepares_every_buffer_a_save_fills(tiny_llama, tmp_path, monkeypatch):
    """CheckpointManager.reserve walks the same tensors under the same keys as save() copies (on CUDA it pins their
    buffers; a key that differed would leave the first checkpoint to pin its own, mid-run). Recorded through the
    copier's two leaf functions, so it runs on the CPU."""
    drafter, opt, sched = build_state(tiny_llama)
    train_step(drafter, opt, sched)
    ckpt = CheckpointManager(tmp_path, run_id="r")
    reserved, copied = [], []
    monkeypatch.setattr(ckpt._copier, "_reserve_tensor", lambda t, key: reserved.append((key, t.shape)))
    real = ckpt._copier._tensor
    monkeypatch.setattr(ckpt._copier, "_tensor", lambda t, key: copied.append((key, t.shape)) or real(t, key))
    ckpt.reserve(drafter, opt, sched)
    ckpt.save(1, drafter, opt, sched, data_position=2)
    ckpt.wait()
    assert reserved == copied and len(copied) > len(drafter.state_dict())  # weights and the moments


def test_a_dflash2_checkpoint_is_dflash2s_servable_and_resumes_exactly(tiny_llama, tmp_path):
    drafter, opt, sched = build_state(tiny_llama, "model.architecture=dflash2")
    assert isinstance(drafter, DFlash2Drafter)
    train_step(drafter, opt, sched)
    ckpt = CheckpointManager(tmp_path, run_id="r")
    path = ckpt.save(1, drafter, opt, sched, data_position=1)
    ckpt.wait()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert not (path / "modeling_dflash.py").exists() and "DFlash 2" in (path / "serve.txt").read_text()
    back, _, found = ckpt.load_latest()
    assert found == path and isinstance(back, DFlash2Drafter)
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_one_write_in_flight_and_best_follows_the_write(tiny_llama, tmp_path, monkeypatch):
    drafter, opt, sched = build_state(tiny_llama)
    ckpt = CheckpointManager(tmp_path, keep=1, run_id="r")
    started, release = held_writer(monkeypatch, events := [])
    ckpt.save(2, drafter, opt, sched, data_position=2)
    assert started.wait(STOP_HANG_GUARD_S), "hang guard: the writer never started"
    assert ckpt.mark_best(2, "val_tau_est", 1.5) == ckpt.root / "step_00000002"  # while it is written
    assert ckpt.best() is None  # `best` never names a checkpoint that is not complete
    with pytest.raises(FileNotFoundError, match="save the step before marking it best"):
        ckpt.mark_best(1, "val_tau_est", 2.0)
    second_waits = threading.Event()
    real_wait = ckpt.wait
    monkeypatch.setattr(ckpt, "wait", lambda: (second_waits.set(), real_wait())[1])
    second = threading.Thread(target=ckpt.save, args=(4, drafter, opt, sched, 4))
    second.start()
    assert second_waits.wait(STOP_HANG_GUARD_S), "hang guard: the second save never started"
    release.set()
    second.join()
    real_wait()
    # The second write began only after the first was complete; keep=1 keeps the best one as well.
    assert events == [("start", ".step_00000002.tmp"), ("latest", "step_00000002"),
                      ("start", ".step_00000004.tmp"), ("latest", "step_00000004")]
    assert ckpt.best() == {"name": "step_00000002", "step": 2, "metric": "val_tau_est", "value": 1.5, "run_id": "r"}
    assert [d.name for d in ckpt.step_dirs()] == ["step_00000002", "step_00000004"]
    assert ckpt.latest().name == "step_00000004"


@pytest.mark.parametrize("error", ["io", "bug"])
def test_a_write_error_reaches_the_next_save_naming_the_checkpoint(error, tiny_llama, tmp_path, monkeypatch):
    drafter, opt, sched = build_state(tiny_llama)
    ckpt = CheckpointManager(tmp_path, run_id="r")
    ckpt.save(2, drafter, opt, sched, data_position=2)
    ckpt.wait()
    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        if Path(f).name == checkpointing.STATE_NAME:
            raise OSError(errno.EIO, os.strerror(errno.EIO)) if error == "io" else ValueError("a writer bug")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", broken_save)
    ckpt.save(4, drafter, opt, sched, data_position=4)  # returns: the failure happens on the writer thread
    expected = CheckpointError if error == "io" else RuntimeError
    with pytest.raises(expected) as info:
        ckpt.save(6, drafter, opt, sched, data_position=6)
    message = str(info.value)
    assert f"checkpoint step_00000004" in message.lower() and str(ckpt.root) in message, message
    assert "the previous checkpoint, step_00000002, is intact" in message, message
    if error == "io":
        assert "make run.out_dir writable" in message and os.strerror(errno.EIO) in message
    else:
        assert isinstance(info.value.__cause__, ValueError)  # a bug keeps its own traceback
    assert ckpt.wait() is None  # raised once; nothing else in flight
    assert ckpt.latest().name == "step_00000002" and not list(ckpt.root.glob(".step_*.tmp"))
    # At close (the end of a run) the same; leaving a `with` that is already failing logs it instead.
    ckpt.save(8, drafter, opt, sched, data_position=8)
    with pytest.raises(expected, match="step_00000008"):
        ckpt.close()


def test_a_write_error_while_another_exception_leaves_is_logged(tiny_llama, tmp_path, monkeypatch, caplog):
    drafter, opt, sched = build_state(tiny_llama)

    def broken_save(obj, f, *args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyError, match="the training failed"):
        with CheckpointManager(tmp_path, run_id="r") as ckpt:
            ckpt.save(2, drafter, opt, sched, data_position=2)
            raise KeyError("the training failed")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "the checkpoint write also failed" in errors[0] and "step_00000002" in errors[0]


KILLED = textwrap.dedent("""
    import sys, threading
    import torch
    from test_checkpoint_async import build_state, train_step
    from dflash_train.training import checkpointing

    target, out, point = sys.argv[1:]
    torch.manual_seed(0)
    drafter, opt, sched = build_state(target)
    ckpt = checkpointing.CheckpointManager(out, run_id="r")
    train_step(drafter, opt, sched)
    ckpt.save(2, drafter, opt, sched, data_position=2)
    ckpt.wait()
    torch.save({k: v.clone() for k, v in drafter.state_dict().items()}, f"{out}/weights_2.pt")
    train_step(drafter, opt, sched)
    torch.save({k: v.clone() for k, v in drafter.state_dict().items()}, f"{out}/weights_4.pt")

    def hold():
        print("held", flush=True)  # the parent SIGKILLs this process now
        threading.Event().wait()

    if point == "state":  # the weights are on disk, the training state is being written
        real_save = torch.save
        torch.save = lambda obj, f, *a, **k: hold() if str(f).endswith("training_state.pt") else real_save(obj, f)
    else:  # the checkpoint is renamed into place, `latest` not yet replaced
        real_text = checkpointing._atomic_write_text
        checkpointing._atomic_write_text = lambda p, t: hold() if p.name == "latest" else real_text(p, t)
    ckpt.save(4, drafter, opt, sched, data_position=4)
    ckpt.wait()
""")


@pytest.mark.parametrize("point", ["state", "latest"])
def test_sigkill_mid_write_leaves_a_complete_checkpoint_and_resume_works(point, tiny_llama, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent)]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED, tiny_llama, str(out), point], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()  # blocks until the writer holds (or the script failed: then stderr says why)
    if line.strip() != "held":
        proc.kill()
        pytest.fail(f"the script ended before the write was held: {proc.communicate(timeout=STOP_HANG_GUARD_S)}")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=STOP_HANG_GUARD_S)
    assert proc.returncode == -signal.SIGKILL

    ckpt = CheckpointManager(out, run_id="r")
    names = [d.name for d in ckpt.step_dirs()]
    if point == "state":  # half-written: a temporary directory nothing reads
        assert names == ["step_00000002"] and (ckpt.root / ".step_00000004.tmp").is_dir()
    else:  # complete but not yet `latest`: it loads, and `latest` still names the previous one
        assert names == ["step_00000002", "step_00000004"]
        assert all(torch.equal(v, torch.load(out / "weights_4.pt")[k])
                   for k, v in load_training_weights(ckpt.root / "step_00000004").state_dict().items())
    assert ckpt.latest().name == "step_00000002"

    fresh, opt0, sched0 = build_state(tiny_llama)
    drafter, state = resume_point("auto", ckpt, fresh)
    assert drafter is not fresh and state["step"] == 2 and state["data_position"] == 2
    want = torch.load(out / "weights_2.pt")
    assert all(torch.equal(v, want[k]) for k, v in drafter.state_dict().items())
    opt = torch.optim.AdamW(drafter.parameters(), lr=opt0.param_groups[0]["lr"])
    sched = build_scheduler(opt, load_config("tiny_cpu", []).train, 10)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    train_step(drafter, opt, sched)  # training continues from the resumed state, and checkpoints again
    ckpt.save(4, drafter, opt, sched, data_position=4)
    ckpt.close()
    assert ckpt.latest().name == "step_00000004" and not list(ckpt.root.glob(".step_*.tmp"))
    assert ckpt.load_latest()[1]["step"] == 4
