"""The LR schedule: over steps, or following the clock of train.max_minutes (training/optim.py, training/budget.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.training.budget import TimeBudget
from dflash_train.training.optim import build_scheduler, follows_clock, lr_factor


class FakeClock:
    """Stands in for a TimeBudget: the share of the time spent, set by the test."""

    def __init__(self):
        self.share = 0.0

    def spent_share(self, steps_done: int) -> float:
        return self.share


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _train_cfg(*extra):
    return load_config("tiny_cpu", list(extra)).train


def test_follows_clock_only_with_max_minutes_and_no_step_count():
    assert follows_clock(_train_cfg("train.max_steps=null", "train.max_minutes=3"))
    assert not follows_clock(_train_cfg("train.max_steps=100", "train.max_minutes=3"))
    assert not follows_clock(_train_cfg("train.max_steps=null", "train.max_minutes=3", "train.budget_steps_per_s=9"))
    assert not follows_clock(_train_cfg("train.max_steps=null"))


def test_step_schedule_is_unchanged_by_a_clock_it_does_not_follow():
    cfg = _train_cfg("train.max_steps=20", "train.warmup_ratio=0.1")
    clock = FakeClock()
    opt = _opt()
    sched = build_scheduler(opt, cfg, 20, clock=clock)  # max_steps set: the clock is ignored
    clock.share = 0.9
    for s in range(1, 20):
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(s, 20, 0.1, cfg.min_lr_ratio))


def test_clock_schedule_warms_up_then_decays_to_the_end_with_the_time():
    cfg = _train_cfg("train.max_steps=null", "train.max_minutes=1", "train.warmup_ratio=0.1",
                     "train.min_lr_ratio=0.1")
    clock = FakeClock()
    opt = _opt()
    sched = build_scheduler(opt, cfg, 1000, clock=clock)
    lrs = []
    for s, share in enumerate([0.0, 0.05, 0.1, 0.4, 0.55, 0.8, 1.0], start=1):
        clock.share = share
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(2 / 1000 / 0.1)   # warm-up: at least one step's worth of progress
    assert lrs[1] == pytest.approx(0.5)              # half-way through the warm-up share
    assert lrs[2] == pytest.approx(1.0)              # peak at the end of warm-up
    assert lrs[3] > lrs[4] > lrs[5] > lrs[6]         # cosine over the time
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5)  # (0.55 - 0.1) / 0.9 = half of the cosine
    assert lrs[6] == pytest.approx(0.1)              # the end of the schedule when the time is spent: 7 of 1,000 steps


def test_clock_schedule_ends_with_the_steps_when_they_run_out_first():
    cfg = _train_cfg("train.max_steps=null", "train.max_minutes=60", "train.warmup_ratio=0.0")
    clock = FakeClock()  # a long budget: hardly any of it spent
    opt = _opt()
    sched = build_scheduler(opt, cfg, 10, clock=clock)
    for _ in range(10):
        opt.step()
        sched.step()
    assert sched.progress == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(cfg.min_lr_ratio, abs=1e-9)


def test_resumed_clock_schedule_continues_from_the_progress_reached():
    cfg = _train_cfg("train.max_steps=null", "train.max_minutes=1", "train.warmup_ratio=0.0")
    clock = FakeClock()
    opt = _opt()
    sched = build_scheduler(opt, cfg, 1000, clock=clock)
    clock.share = 0.6
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert state["progress"] == pytest.approx(0.6) and "clock" not in state and "total_steps" not in state

    clock2 = FakeClock()  # the resumed run's own clock, at its start
    opt2 = _opt()
    sched2 = build_scheduler(opt2, cfg, 1000, clock=clock2)
    sched2.load_state_dict(state)
    assert sched2.clock_start == pytest.approx(0.6)
    opt2.step()
    sched2.step()
    assert sched2.progress == pytest.approx(0.6)                  # no jump back to the step progress (6 / 1000)
    clock2.share = 0.5                                             # half of the new budget: half of what was left
    opt2.step()
    sched2.step()
    assert sched2.progress == pytest.approx(0.6 + 0.4 * 0.5)
    clock2.share = 1.0
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(cfg.min_lr_ratio, abs=1e-9)


def test_time_budget_share_is_the_deciders_reading_one_step_back():
    budget = TimeBudget(1.0, replicas=2)
    budget.t0 -= 30.0  # half of the minute already spent
    assert budget.spent_share(5) == 0.0     # nothing recorded yet
    budget.should_stop(4, decider=False)    # only the decider records
    assert budget.spent_share(5) == 0.0
    budget.should_stop(4, decider=True)
    assert 0.5 <= budget.spent_share(5) < 1.0
    assert budget.spent_share(6) == 0.0     # the reading after step 5 is not there yet
    for s in range(5, 12):
        budget.should_stop(s)
    assert budget.spent_share(12) >= 0.5 and budget.spent_share(5) == 0.0  # only recent readings are kept


def test_a_deadline_shortens_the_time_budget_and_never_lengthens_it(monkeypatch):
    from dflash_train.training import budget as budget_module

    now = 5000.0  # the budget's clock, set by the test (no real clock is read)
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: now)
    budget = TimeBudget(13.0)
    budget.start(end_by=now + 60.0)        # a minute left to the deadline: the budget is that minute
    assert budget.max_s == 60.0
    budget = TimeBudget(1.0)
    budget.start(end_by=now + 600.0)       # ten minutes left: train.max_minutes stays the ceiling
    assert budget.max_s == 60.0
    budget = TimeBudget(1.0)
    budget.start(end_by=now - 5.0)         # already past it: no time at all, not a negative budget
    assert budget.max_s == 0.0 and budget.should_stop(1) and budget.spent_share(2) == 1.0
    budget = TimeBudget(None)
    budget.start(end_by=now + 60.0)        # no train.max_minutes (a rank other than 0): no clock
    assert budget.max_s is None and not budget.should_stop(1)


@pytest.mark.parametrize("replicas", [0, 1, 2])  # 0: the single-device loop
def test_lr_follows_the_clock_and_replicas_stay_identical(tiny_llama, tmp_path, replicas):
    from dflash_train.pipeline.coordinator import train_pipeline
    from dflash_train.training.trainer import train_single_device

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "train.max_steps=null", "train.epochs=10000", "train.max_minutes=0.05",
                                   "train.warmup_ratio=0.0", "train.log_every=1",
                                   f"pipeline.drafter_devices={['cpu'] * max(1, replicas)}"])
    res = train_pipeline(cfg) if replicas else train_single_device(cfg)
    total = res.history[-1]["step"]
    if replicas:
        assert all(len(set(c)) == 1 for c in res.replica_checksums)  # the same LR on every replica at every step
    lrs = [r["lr"] for r in res.history]
    assert lrs == sorted(lrs, reverse=True)                      # decays with the time
    # Stopped by the clock far before the epochs' steps: by steps alone the LR would still be at its peak.
    assert total < 0.5 * 10000 and lrs[-1] < 0.25 * cfg.train.lr, (total, lrs[-3:])


def test_the_pipeline_ends_its_training_at_the_callers_deadline(tiny_llama, tmp_path):
    """train_pipeline(end_by=...) (the GPU demo's deadline) reaches the run's clock: a deadline already past stops
    the run after its first step, where train.max_minutes alone would train on for half a minute."""
    import time

    from dflash_train.pipeline.coordinator import train_pipeline

    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "train.max_steps=null", "train.epochs=10000", "train.max_minutes=0.5",
                                   "train.log_every=1", "pipeline.drafter_devices=['cpu']"])
    res = train_pipeline(cfg, end_by=time.monotonic() - 1.0)
    assert res.history[-1]["step"] == 1
