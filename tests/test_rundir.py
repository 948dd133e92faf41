"""Run directories that never hand out the wrong model (issue #17): overwrite moves the old run aside, checkpoints
carry the run id and only this run's are resumed, rotation by step keeps the newest, `latest` and `best`, a lock
refuses a second run, and resume allows (and logs) only the keys that may change. Tiny CPU runs, seconds each."""

from __future__ import annotations

import fcntl
import json
import logging
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.config import ConfigError, load_config
from dflash_train.errors import UserError
from dflash_train.models.build import build_drafter
from dflash_train.models.target import target_config_info
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.training.checkpointing import CheckpointManager, resume_point
from dflash_train.training.optim import build_scheduler, lr_factor
from dflash_train.training.run import prepare_out_dir, release_run_dir
from dflash_train.training.rundir import LOCK_NAME
from dflash_train.training.trainer import train_single_device

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_for(target, out, *over):
    return load_config("tiny_cpu", [f"model.target={target}", f"run.out_dir={out}", "train.log_every=1", *over])


def names(ckpt: CheckpointManager) -> list[str]:
    return [d.name for d in ckpt.step_dirs()]


def assert_unlocked(out: Path) -> None:
    """No one (this process included: a second open file conflicts with its own flock) holds out's lock."""
    with open(out / LOCK_NAME) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
        fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------ finding 1: the wrong model

def test_overwrite_moves_the_old_run_aside_and_resume_never_loads_it(tiny_llama, tmp_path):
    """The issue's case: an older run's higher-step checkpoints in the directory, run.overwrite=true with fewer
    steps, then run.resume=auto. Before: the new checkpoints were pruned at once and the resume continued the *old*
    run at its last step, writing its weights into drafter/."""
    run = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=12", "train.checkpoint_every=2"))  # keeps 8, 10, 12
    new = train_pipeline(cfg_for(tiny_llama, run, "run.overwrite=true", "train.max_steps=6",
                                 "train.checkpoint_every=2"))
    ckpt = CheckpointManager(run)
    assert names(ckpt) == ["step_00000002", "step_00000004", "step_00000006"]
    assert ckpt.latest().name == "step_00000006"
    (aside,) = tmp_path.glob("run.old-*")  # moved aside whole, nothing deleted
    assert names(CheckpointManager(aside)) == ["step_00000008", "step_00000010", "step_00000012"]
    assert (aside / "run_id").read_text() != (run / "run_id").read_text()
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 6  # metrics of the new run only
    new_weights = load_file(str(new.drafter_dir / "model.safetensors"))

    resumed = train_pipeline(cfg_for(tiny_llama, run, "run.resume=auto", "train.max_steps=6",
                                     "train.checkpoint_every=2"))
    assert resumed.steps == 6
    got = load_file(str(resumed.drafter_dir / "model.safetensors"))
    assert got.keys() == new_weights.keys() and all(torch.equal(got[k], new_weights[k]) for k in got)


def test_resume_never_into_a_trained_run_is_refused(tiny_llama, tmp_path):
    """Same config, run.resume=never: a fresh start would mix its checkpoints and metrics with the old run's."""
    run = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=2"))
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints up to step_00000002\); pass "
                                          r"run.resume=auto to continue it, run.overwrite=true"):
        prepare_out_dir(cfg_for(tiny_llama, run, "train.max_steps=2"))
    assert_unlocked(run)


def test_only_checkpoints_of_this_run_are_resumed(tiny_llama, tmp_path, caplog):
    """A checkpoint of another run id (copied in) is reported and skipped; resume=auto then starts fresh and says
    so."""
    run = tmp_path / "run"
    prepare_out_dir(cfg_for(tiny_llama, run, "run.resume=auto"))
    release_run_dir(run)
    drafter, opt, sched = _drafter_and_optimizer(tiny_llama)
    with CheckpointManager(run, run_id="another-run") as other:  # leaving waits for the write
        other.save(5, drafter, opt, sched, data_position=5)
    caplog.set_level(logging.INFO, logger="dflash_train")
    init, state = resume_point("auto", CheckpointManager(run), fresh=drafter)
    assert init is drafter and state is None
    assert "belongs to another run (run id another-run" in caplog.text
    assert "no checkpoint found, starting fresh" in caplog.text


def test_checkpoints_from_before_run_ids_are_not_resumed(tiny_llama, tmp_path):
    run = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=2"))
    (run / "run_id").unlink()  # as an older dflash-train left it
    with pytest.raises(ConfigError, match="checkpoints without a run id .* run.overwrite=true"):
        prepare_out_dir(cfg_for(tiny_llama, run, "train.max_steps=2", "run.resume=auto"))


# ------------------------------------------------------------------------------------------ finding 2: the lock

_HOLDER = textwrap.dedent("""
    import sys
    from dflash_train.config import load_config
    from dflash_train.training.run import prepare_out_dir
    prepare_out_dir(load_config("tiny_cpu", [f"run.out_dir={sys.argv[1]}"]))
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until killed
""")


def test_a_second_run_in_the_same_directory_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as info:
            prepare_out_dir(load_config("tiny_cpu", [f"run.out_dir={run}"]))
        msg = str(info.value)
        assert f"{run} is in use by another training run (PID {holder.pid} on host {socket.gethostname()}" in msg
        assert "choose another run.out_dir" in msg and "\n" not in msg
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its flock died with it, and the lock file it left is no obstacle.
    assert (run / LOCK_NAME).is_file()
    prepare_out_dir(load_config("tiny_cpu", [f"run.out_dir={run}"]))
    release_run_dir(run)


def test_the_lock_is_released_when_training_ends_or_fails(tiny_llama, tmp_path):
    run = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=2"))
    assert_unlocked(run)
    with pytest.raises(ConfigError, match="target_graphs"):  # fails after the directory was prepared (and locked)
        train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=4", "run.resume=auto", "model.target_graphs=true"))
    assert_unlocked(run)
    with pytest.raises(ConfigError, match="no CUDA device"):  # the single-device loop, failing after build_run
        train_single_device(cfg_for(tiny_llama, tmp_path / "single", "train.max_steps=2",
                                    "pipeline.drafter_devices=[cuda:0]"))
    assert_unlocked(tmp_path / "single")


# ------------------------------------------------------------------------------------------ finding 3: resume rules

def test_raising_max_steps_on_resume_is_allowed_logged_and_the_cosine_ends_at_the_new_last_step(
        tiny_llama, tmp_path, caplog):
    run = tmp_path / "run"
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=4"))
    caplog.set_level(logging.INFO, logger="dflash_train")
    cfg = cfg_for(tiny_llama, run, "train.max_steps=8", "run.resume=auto", "train.log_every=2")
    res = train_pipeline(cfg)
    assert "resuming with train.max_steps 4 -> 8, train.log_every 1 -> 2" in caplog.text
    assert "resuming from" in caplog.text and res.steps == 8
    # From the resume point on, the LR is the warm-up + cosine of the new length: it ends at step 8.
    t = cfg.train
    lr = {r["step"]: r["lr"] for r in res.history}
    assert sorted(lr) == [6, 8]
    for s in lr:
        assert lr[s] == pytest.approx(t.lr * lr_factor(s, 8, t.warmup_ratio, t.min_lr_ratio), rel=1e-6, abs=1e-12)
    assert lr[8] == pytest.approx(t.lr * t.min_lr_ratio, abs=1e-12)


def test_a_key_that_changes_training_is_refused_naming_its_old_and_new_value(tmp_path):
    run = tmp_path / "run"
    prepare_out_dir(load_config("tiny_cpu", [f"run.out_dir={run}"]))
    release_run_dir(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the run logged a step: a new config would mix with it
    changed = load_config("tiny_cpu", [f"run.out_dir={run}", "run.resume=auto", "train.lr=1e-3",
                                       "model.block_size=4", "train.max_steps=100"])
    with pytest.raises(ConfigError) as info:
        prepare_out_dir(changed)
    msg = str(info.value)
    assert msg.startswith(f"{run} already holds a different run (")
    assert "model.block_size 8 -> 4; train.lr 0.01 -> 0.001)" in msg and "max_steps" not in msg
    assert "run.overwrite=true" in msg
    assert_unlocked(run)


@pytest.mark.parametrize("left", [None, "regenerated.jsonl", "checkpoints", "metrics.jsonl"])
def test_a_start_that_failed_before_writing_anything_is_no_obstacle_to_a_new_config(tmp_path, caplog, left):
    """A start that failed early (a wrong data.source) left only its own files; the corrected command starts a new
    run there, with a new run id. Anything more it left (data, checkpoints, logged steps) keeps the refusal."""
    run = tmp_path / "run"
    prepare_out_dir(load_config("tiny_cpu", [f"run.out_dir={run}", "data.source=wrong.jsonl"]))
    release_run_dir(run)
    (run / "run.log").write_text("error: Data file 'wrong.jsonl' ...\n")
    first_id = (run / "run_id").read_text()
    if left == "checkpoints":
        (run / "checkpoints").mkdir()
    elif left:
        (run / left).write_text('{"step": 1}\n')
    fixed = load_config("tiny_cpu", [f"run.out_dir={run}", "data.source=synthetic"])
    if left:
        with pytest.raises(ConfigError, match="already holds a different run \\(data.source 'wrong.jsonl' -> "):
            prepare_out_dir(fixed)
        return
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        prepare_out_dir(fixed)
    release_run_dir(run)
    assert "trained nothing and wrote no data; starting a new run there with data.source 'wrong.jsonl' -> " \
        "'synthetic'" in caplog.text
    assert (run / "run_id").read_text() != first_id
    assert load_config(str(run / "run_config.yaml"), []).data.source == "synthetic"


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_checkpoints_below_one_is_refused(keep):
    with pytest.raises(ConfigError, match=f"train.keep_checkpoints must be at least 1 \\(got {keep}\\)"):
        load_config("tiny_cpu", [f"train.keep_checkpoints={keep}"])


def test_overwrite_and_resume_together_are_refused():
    with pytest.raises(ConfigError, match="pass only one of them"):
        load_config("tiny_cpu", ["run.overwrite=true", "run.resume=auto"])


# ------------------------------------------------------------------------------------------ rotation and best

def _drafter_and_optimizer(target):
    cfg = load_config("tiny_cpu", [])
    drafter = build_drafter(cfg.model, target_config_info(target))
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr)
    return drafter, opt, build_scheduler(opt, cfg.train, 10)


def test_rotation_orders_by_step_and_keeps_the_newest_latest_and_best(tiny_llama, tmp_path):
    drafter, opt, sched = _drafter_and_optimizer(tiny_llama)
    ckpt = CheckpointManager(tmp_path, keep=2, run_id="r")
    save = lambda step: (ckpt.save(step, drafter, opt, sched, data_position=step), ckpt.wait())  # noqa: E731
    for step in (10, 20, 30):
        save(step)
    assert names(ckpt) == ["step_00000020", "step_00000030"]
    assert ckpt.mark_best(20, "val_tau_est", 1.5) == ckpt.root / "step_00000020"
    save(100_000_000)  # 9 digits: sorts after step 30 by number, before it by name
    assert names(ckpt) == ["step_00000020", "step_00000030", "step_100000000"]  # best kept past `keep`
    save(2)  # a lower step (a run resumed from an older checkpoint): `latest` names it, it is kept
    assert ckpt.latest().name == "step_00000002"
    assert names(ckpt) == ["step_00000002", "step_00000020", "step_00000030", "step_100000000"]
    save(3)
    assert names(ckpt) == ["step_00000003", "step_00000020", "step_00000030", "step_100000000"]
    assert ckpt.best() == {"name": "step_00000020", "step": 20, "metric": "val_tau_est", "value": 1.5, "run_id": "r"}
    assert CheckpointManager(tmp_path, run_id="other").best() is None  # another run's pointer is not this run's
    with pytest.raises(FileNotFoundError, match="save the step before marking it best"):
        ckpt.mark_best(4, "val_tau_est", 2.0)


def test_the_best_checkpoint_survives_resume_and_rotation(tiny_llama, tmp_path):
    run = tmp_path / "run"
    over = ("train.checkpoint_every=2", "train.keep_checkpoints=2")
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=4", *over))
    CheckpointManager(run).mark_best(2, "val_tau_est", 1.25)
    train_pipeline(cfg_for(tiny_llama, run, "train.max_steps=8", "run.resume=auto", *over))
    ckpt = CheckpointManager(run)
    assert names(ckpt) == ["step_00000002", "step_00000006", "step_00000008"]
    best = ckpt.best()
    assert best is not None and (best["name"], best["step"], best["value"]) == ("step_00000002", 2, 1.25)
    assert best["run_id"] == (run / "run_id").read_text().strip()
