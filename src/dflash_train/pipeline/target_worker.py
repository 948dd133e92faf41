"""Stage 2, a target worker: one thread per target device, each with its own frozen TargetModel.

  TrainBatch (CPU) -> FeatureForward (target.features, eager or compiled, optionally one CUDA graph)
                   -> FeatureItem(batch, feats [T, k*H] on the target device, ready event)

Several target workers share one input queue, so they may finish out of order; the prefetcher restores the order.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import torch

from ..data.packing import TrainBatch
from ..models.feature_cache import RowFeatures
from ..models.target import FeatureForward, TargetModel
from .devices import new_stream, record_event
from .faults import poison_
from .worker import END_OF_DATA, RunControl, Worker

log = logging.getLogger("dflash_train")


@dataclass
class FeatureItem:
    batch: TrainBatch     # still on the host (pinned on CUDA runs); the prefetcher copies it to the drafter
    feats: torch.Tensor   # [T, k*H], target dtype, on the target device
    ready: object = None  # CUDA event recorded after the features were computed (None on CPU)


class TargetWorker(Worker):
    def __init__(self, index: int, control: RunControl, target: TargetModel,
                 device: torch.device, inbox: queue.Queue, out: queue.Queue, warmup: TrainBatch,
                 graphs: bool = False, compile: str = "eager", compile_layers: bool = False,
                 row_of=lambda index: index, feature_cache_bytes: float = 0, feature_cache_host_bytes: float = 0):
        super().__init__(f"target{index}", control, device)
        # a row's batches share one forward (train.steps_per_row); kept rows every epoch's (train.feature_cache_gb)
        self.rows = RowFeatures(row_of, feature_cache_bytes, self.name, feature_cache_host_bytes)
        self.target, self.inbox, self.out, self.warmup = target, inbox, out, warmup
        self.graphs = graphs  # model.target_graphs: one CUDA graph per row instead of a Python forward
        self.compile = compile  # model.target_compile: eager | a torch.compile mode
        self.compile_layers = compile_layers  # model.target_compile_layers: each layer compiled, not the forward
        self.stream = new_stream(device)  # its own stream: overlaps a drafter sharing the GPU
        self.forward: FeatureForward | None = None  # built in setup(), in this thread

    def _features(self, batch: TrainBatch) -> torch.Tensor:
        b = batch.to(self.device, non_blocking=True)
        return self.forward(b.input_ids, b.position_ids, b.doc_ids)  # [T, k*H]

    def setup(self) -> None:
        # Built, captured and compiled here: in this thread, on this worker's stream and device.
        t0 = time.perf_counter()
        self.forward = FeatureForward(self.target, self.warmup.input_ids.shape[0], self.compile, self.graphs,
                                      layers=self.compile_layers)
        # One forward of the real shapes: compiling and lazy CUDA/library initialisation happen here, not in the
        # first step (and before the recompile guard is armed).
        self._features(self.warmup)
        scope = ", each layer" if self.compile_layers and self.compile != "eager" else ""
        log.info(f"{self.name}: feature forward ready in {time.perf_counter() - t0:.1f} s (compile {self.compile}"
                 f"{scope}, CUDA graph {'on' if self.graphs else 'off'})")

    def loop(self) -> None:
        n = 0
        while True:
            batch = self.get(self.inbox)
            if batch is END_OF_DATA:
                self.put(self.out, END_OF_DATA)
                return
            fault = self.inject("step", n)
            with self.clock.busy():
                feats = self.rows(batch.index, lambda: self._features(batch))
            if fault:  # injected nan/inf: the features, so the drafter's loss and gradients (of this batch only)
                feats = feats.clone()
                poison_(fault, feats)
            self.put(self.out, FeatureItem(batch, feats, record_event(self.device)))
            n += 1
