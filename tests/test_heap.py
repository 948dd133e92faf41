"""The garbage collector during training (training/heap.py): the heap frozen for the loop and unfrozen after it, every
collection counted per log window, and a training run that reports both."""

from __future__ import annotations

import gc
import json
import logging
import weakref

import pytest

from dflash_train.training.heap import GcWatch, frozen_heap, leave_gc_to_caller
from dflash_train.training.metrics import MetricsLogger


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _unfrozen(thawed_heap):
    """A thawed heap that frozen_heap manages, for each test (conftest's thawed_heap freezes it again and hands it
    back to the suite after this undoes a test's freeze)."""
    enabled = gc.isenabled()
    gc.disable()   # only the collections a test asks for: an automatic one would change the counts
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_frozen_heap_collects_first_then_freezes_until_the_end():
    dead = _Node()
    dead_ref = weakref.ref(dead)
    del dead
    assert dead_ref() is not None  # a cycle outlives its last name until a collection
    alive = _Node()
    alive_ref = weakref.ref(alive)
    with frozen_heap():
        assert dead_ref() is None, "the garbage cycle was frozen instead of collected"
        assert gc.get_freeze_count() > 0
        del alive  # now garbage, but frozen: a collection inside must leave it where it is
        gc.collect()
        assert alive_ref() is not None, "a collection inside the frozen heap freed a frozen object"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive_ref() is None  # unfrozen, it is collectable again


def test_frozen_heap_unfreezes_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_heap_left_to_the_caller_stays_frozen_and_uncollected():
    dead = _Node()
    ref = weakref.ref(dead)
    gc.freeze()  # the caller's freeze, e.g. a service after its imports
    frozen = gc.get_freeze_count()
    del dead
    leave_gc_to_caller()
    try:
        with frozen_heap():
            assert ref() is not None, "frozen_heap collected the caller's frozen heap"
            # No more frozen objects than the caller froze (some may die meanwhile: another thread can drop the
            # last reference to an object frozen with the rest, which leaves the permanent generation)
            assert gc.get_freeze_count() <= frozen, "frozen_heap froze on top of the caller's policy"
        gc.collect()
        assert ref() is not None, "frozen_heap undid the caller's freeze"  # unfrozen, the dead cycle is collected
    finally:
        leave_gc_to_caller(False)


def test_objects_frozen_before_training_do_not_switch_the_freeze_off():
    """The GPU demo of 2026-12-03 met a few hundred objects frozen by something else before training: without a
    declaration from the caller, frozen_heap still collects and freezes the whole heap."""
    gc.freeze()  # a few objects frozen by a library
    early = gc.get_freeze_count()
    dead = _Node()
    ref = weakref.ref(dead)
    del dead
    with frozen_heap():
        assert ref() is None, "the garbage cycle was left in the heap"
        assert gc.get_freeze_count() > early, "the heap was not frozen"
    assert gc.get_freeze_count() == 0


def test_gc_watch_counts_collections_per_window_and_stops():
    watch = GcWatch()
    watch.start()
    try:
        gc.collect()
        gc.collect(0)
        _, collections = watch.take()
        assert collections == 2 and watch.count == 2
        assert watch.take() == (0.0, 0)  # a window holds only its own collections
    finally:
        watch.stop()
    gc.collect()
    assert watch.count == 2 and watch.take() == (0.0, 0)
    assert watch._callback not in gc.callbacks
    watch.stop()  # twice is harmless


def test_log_record_carries_the_window_collections(tmp_path, caplog):
    import torch

    logger = MetricsLogger(tmp_path, total_steps=4, tokens_per_step=8, log_every=2, tensorboard=False)
    metrics = {"loss": torch.tensor(1.0), "counts": torch.tensor([[3.0, 1.0], [4.0, 4.0], [3.0, 1.0], [4.0, 3.0]]),
               "num_labels": torch.tensor(4.0)}
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        with logger.watch_gc():
            gc.collect()
            rec = logger.log(2, metrics, lr=1e-3)
            quiet = logger.log(4, metrics, lr=1e-3)
    logger.close()
    assert rec["gc_s"] > 0 and quiet["gc_s"] == 0.0
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["gc_s"] > 0 for r in records] == [True, False]
    assert any(m.startswith("garbage collections during training: 1,") for m in caplog.messages)
    assert gc.callbacks.count(logger.gc._callback) == 0
