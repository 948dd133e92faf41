"""The batch schedule: epochs packed ahead on a side thread, batch for batch what packing in place gives."""

from __future__ import annotations

import torch


def test_epochs_packed_ahead_give_the_batches_of_packing_in_place():
    """The schedule packs the next epoch on a side thread (no stall at epoch boundaries): the batches are exactly
    those of packing each epoch when it starts, from any start, and an abandoned iterator does not hang."""
    from dflash_train.data.packing import BatchSchedule, epoch_rows, make_batch
    from dflash_train.data.synthetic import synthetic_samples

    samples = synthetic_samples(50, period=8, seed=0, max_len=96)
    schedule = BatchSchedule(samples, 256, 16, seed=3, max_batches=70)

    def in_place(start):
        index, epoch = 0, 0
        while index < 70:
            for row in epoch_rows(samples, 256, epoch, 3):
                if start <= index < 70:
                    yield make_batch(row, 16, 3, index, epoch)
                index += 1
            epoch += 1

    for start in (0, 23, 69):
        got, want = list(schedule.iter_from(start)), list(in_place(start))
        assert [b.index for b in got] == [b.index for b in want] == list(range(start, 70))
        assert [b.epoch for b in got] == [b.epoch for b in want] and max(b.epoch for b in want) >= 2 or start == 69
        for a, b in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    it = iter(schedule.iter_from(0))
    next(it)
    it.close()  # the loader stopping mid-epoch: the side thread's epoch is dropped, nothing waits for it
