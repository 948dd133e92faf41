"""Stage 1, the loader: the run's batch schedule -> TrainBatch objects (CPU, pinned when a GPU reads them).

Batches leave in schedule order (index = data position); each takes one slot of the in-flight semaphore, released
by the prefetcher once that batch is dispatched to a drafter, so batches between here and the drafters (including
the prefetcher's reorder buffer) are bounded whatever order the target workers finish in.

Several processes (torchrun): each loader builds only its process's shard of the one global batch sequence
(`DataShard`), so the run trains exactly the batches, anchors and replica assignment of one process holding every
replica of every process.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass

import torch

from ..data.packing import BatchSchedule, TrainBatch
from .worker import END_OF_DATA, RunControl, Worker


def dummy_batch(token_budget: int, num_anchors: int) -> TrainBatch:
    """A batch of the real shapes and dtypes (one document, all supervised) for compile warm-ups."""
    T, A = token_budget, num_anchors
    anchors = torch.arange(A, dtype=torch.long) * max(1, T - 2) // max(1, A)  # sorted, inside the row
    return TrainBatch(input_ids=torch.zeros(T, dtype=torch.long), position_ids=torch.arange(T),
                      doc_ids=torch.zeros(T, dtype=torch.long), loss_mask=torch.ones(T, dtype=torch.bool),
                      anchors=anchors, anchor_valid=torch.ones(A, dtype=torch.bool), index=-1)


@dataclass(frozen=True)
class DataShard:
    """Which batches this process trains, and on which of its replicas.

    Global replica g = rank * local_replicas + r (r: this process's replica); batch i -> global replica
    i % (world * local_replicas). One process (world 1) owns every batch: i -> replica i % local_replicas."""
    local_replicas: int
    rank: int = 0
    world: int = 1

    @property
    def global_replicas(self) -> int:
        return self.world * self.local_replicas

    def owns(self, index: int) -> bool:
        return (index % self.global_replicas) // self.local_replicas == self.rank

    def local_replica(self, index: int) -> int:
        """The replica of this process that trains batch `index` (which it must own)."""
        return index % self.global_replicas - self.rank * self.local_replicas

    def next_owned(self, index: int) -> int:
        """The first batch index >= `index` that this process owns."""
        first = self.rank * self.local_replicas  # this process's first slot in each round of global_replicas batches
        base, slot = divmod(index, self.global_replicas)
        if slot < first:
            return base * self.global_replicas + first
        if slot < first + self.local_replicas:
            return index
        return (base + 1) * self.global_replicas + first


class LoaderWorker(Worker):
    def __init__(self, control: RunControl, schedule: BatchSchedule, start_batch: int,
                 out: queue.Queue, in_flight: threading.Semaphore, num_consumers: int, pin_memory: bool,
                 shard: DataShard | None = None):
        super().__init__("loader", control)
        self.schedule, self.start_batch = schedule, start_batch
        self.out, self.in_flight, self.num_consumers, self.pin_memory = out, in_flight, num_consumers, pin_memory
        self.shard = shard  # None: every batch

    def loop(self) -> None:
        keep = self.shard.owns if self.shard is not None else None
        # closing: the packing thread ends with the loader, not whenever a failure's traceback is collected
        with contextlib.closing(self.schedule.iter_from(self.start_batch, keep, waiting=self._check_stop)) as batches:
            for n, batch in enumerate(batches):
                self.inject("step", n)
                if self.pin_memory:  # page-locked, so the prefetcher's host->device copies are truly asynchronous
                    batch = batch.pin_memory()
                self.acquire(self.in_flight)
                self.put(self.out, batch)
        for _ in range(self.num_consumers):  # one end marker per target worker
            self.put(self.out, END_OF_DATA)
