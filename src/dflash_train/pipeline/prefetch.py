"""Stage 3, the prefetcher: restore batch order, pick the replica, copy batch + features to its device.

Dispatch is a pure function of the batch index (batch i -> replica i % N, in increasing i; with several processes
this process's own batches, see loader.DataShard), so which replica trains which batch never depends on thread
timing. Target workers may finish out of order: items wait in
`pending` until their turn (bounded by the loader's in-flight semaphore).

On CUDA the copies run on one side stream per drafter device, after the target's `ready` event; a new `ready`
event marks the copy done and the drafter's stream waits on it (no host sync). Each drafter inbox holds one item:
the drafter trains on one batch while the next sits on its device (double-buffered). On CPU nothing moves.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from ..data.packing import TrainBatch
from .devices import new_stream, record_event
from .loader import DataShard
from .target_worker import FeatureItem
from .worker import END_OF_DATA, RunControl, Worker


@dataclass
class DrafterInput:
    batch: TrainBatch     # on the drafter device
    feats: torch.Tensor   # [T, k*H] on the drafter device
    ready: object = None  # CUDA event: the copies above are done (None on CPU)


class Prefetcher(Worker):
    def __init__(self, control: RunControl, inbox: queue.Queue, outboxes: list[queue.Queue],
                 drafter_devices: list[torch.device], drafter_streams: list, num_targets: int, first_index: int,
                 in_flight: threading.Semaphore, shard: DataShard | None = None):
        super().__init__("prefetch", control)
        self.inbox, self.outboxes, self.devices, self.drafter_streams = inbox, outboxes, drafter_devices, drafter_streams
        self.shard = shard or DataShard(len(outboxes))
        self.num_targets, self.next_index, self.in_flight = num_targets, self.shard.next_owned(first_index), in_flight
        self.copy_streams = {d: new_stream(d) for d in set(drafter_devices)}

    def loop(self) -> None:
        pending: dict[int, FeatureItem] = {}  # batch index -> item that arrived before its turn
        ended = 0
        while ended < self.num_targets:
            item = self.get(self.inbox)
            if item is END_OF_DATA:
                ended += 1
                continue
            pending[item.batch.index] = item
            while self.next_index in pending:
                self.inject("step", self.next_index)  # fault injection (pipeline/faults.py): by batch index
                replica = self.shard.local_replica(self.next_index)
                self.put(self.outboxes[replica], self._to_drafter(pending.pop(self.next_index), replica))
                self.in_flight.release()
                self.next_index = self.shard.next_owned(self.next_index + 1)
        if pending:
            raise RuntimeError(f"batches {sorted(pending)[:8]} arrived but batch {self.next_index} never did")
        for box in self.outboxes:
            self.put(box, END_OF_DATA)

    def _to_drafter(self, item: FeatureItem, replica: int) -> DrafterInput:
        device = self.devices[replica]
        if device.type != "cuda":
            return DrafterInput(item.batch.to(device), item.feats.to(device), item.ready)
        src = item.feats
        with torch.cuda.device(device), torch.cuda.stream(self.copy_streams[device]):
            if item.ready is not None:
                torch.cuda.current_stream(device).wait_event(item.ready)  # features computed
            batch = item.batch.to(device, non_blocking=True)  # pinned host -> device
            feats = src.to(device, non_blocking=True)         # peer copy, or the same tensor on a shared GPU
            if src.device != device:
                # A cross-device copy runs on the source device's current stream of this thread; tell the
                # allocator so the target's memory is not reused before that copy is done.
                src.record_stream(torch.cuda.current_stream(src.device))
            for t in (feats, *batch.tensors().values()):  # read later on the drafter's stream
                t.record_stream(self.drafter_streams[replica])
            return DrafterInput(batch, feats, record_event(device))
