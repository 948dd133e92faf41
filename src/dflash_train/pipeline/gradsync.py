"""Gradient averaging across drafter replicas (threads, and processes under torchrun), every step, in a fixed order.

A barrier-style all-reduce: each replica posts its gradients; replica 0's thread sums them in replica order
(0, 1, ..., N-1) into one persistent flat buffer on its device, then (several processes) all-reduces that buffer
once across processes (pipeline/distributed.py), and divides by the number of replicas of the whole run; every
replica then copies the mean back into its own `.grad`. All replicas receive the very same bits, so identical
clip + AdamW + schedule keep them bit-identical, and the fixed order makes a run reproducible whatever the thread
timing. With one replica in one process it is a no-op, which is what makes the 1-drafter pipeline equal the
single-device trainer exactly.

  flat: [G grads | M metrics | 1 stop step + W statuses (several processes only)]   dtype of the grads (fp32)

Sync points (CUDA): each replica records an event after its backward; replica 0 waits for all of them on the host,
and finishes its sum on the host before publishing, so the cross-device reads on either side see complete data.
A replica posts round k+1 only after its round-k copy was queued on its stream, so the buffers are never
overwritten while being read. Metrics are summed the same way, only on log steps (zeros otherwise).
"""

from __future__ import annotations

import threading

import torch

from .devices import record_event, sync_event
from .distributed import FAILED, INTERRUPTED, OK, DistributedSync, PeerStopped
from .worker import Stopped, Worker


class GradAverager:
    def __init__(self, num_replicas: int, peers: DistributedSync | None = None):
        self.n = num_replicas
        self.peers = peers if peers is not None and peers.enabled else None
        self.total = self.n * (self.peers.world if self.peers else 1)  # replicas of the whole run
        self.budget = None  # the run's TimeBudget: rank 0's stop decision travels in the all-reduce
        self._cond = threading.Condition()
        self._posted: list[tuple | None] = [None] * num_replicas  # (grads, metrics, ready event) of this round
        self._round = 0                                           # rounds published so far
        self._flat: torch.Tensor | None = None                    # [G + M + step_slots] on replica 0's device
        self._mean: list[torch.Tensor] = []                       # views of flat, shaped like the grads
        self._metrics: dict[str, torch.Tensor] = {}               # views of flat, shaped like the metrics
        self._numel = 0                                           # G + M: what is divided by `total`
        self._mean_metrics: dict | None = None

    @property
    def active(self) -> bool:
        return self.n > 1 or self.peers is not None

    def prepare(self, replica: int, params: list[torch.nn.Parameter], metrics: dict[str, torch.Tensor]) -> None:
        """Called by every replica after its warm-up step (`metrics` as a step returns them); replica 0 allocates the
        flat buffer. Before the first step, so a rank that stops early knows the layout the others all-reduce."""
        if replica != 0 or not self.active:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if len({g.dtype for g in grads}) != 1:
            raise RuntimeError(f"gradients of mixed dtypes {sorted({str(g.dtype) for g in grads})}: the flat "
                               "all-reduce buffer needs one")
        sizes = [g.numel() for g in grads] + [m.numel() for m in metrics.values()]
        self._numel = sum(sizes)
        extra = self.peers.step_slots if self.peers else 0
        self._flat = torch.zeros(self._numel + extra, dtype=grads[0].dtype, device=grads[0].device)
        views = self._flat[:self._numel].split(sizes)
        self._mean = [v.view_as(g) for v, g in zip(views, grads)]
        self._metrics = {k: v.view(m.shape) for v, (k, m) in zip(views[len(grads):], metrics.items())}
        if self.peers:
            self.peers.register_step_buffer(self._flat)

    @property
    def step_numel(self) -> int:
        """G + M, the size every rank's step all-reduce must agree on (0 without a buffer)."""
        return self._numel

    def all_reduce(self, worker: Worker, replica: int, params: list[torch.nn.Parameter],
                   metrics: dict | None) -> dict | None:
        """Replace every replica's grads by their mean; return the mean metrics (or None when metrics is None)."""
        if not self.active:
            return metrics
        grads = [p.grad for p in params if p.grad is not None]  # same set on every replica: same graph
        ready = record_event(grads[0].device)
        with self._cond:
            my_round = self._round
            self._posted[replica] = (grads, metrics, ready)
            self._cond.notify_all()
            if replica == 0:
                worker.wait_for(self._cond, lambda: all(p is not None for p in self._posted))
                posted, self._posted = self._posted, [None] * self.n
        if replica == 0:
            self._reduce(worker, posted)
            with self._cond:
                self._round += 1
                self._cond.notify_all()
        else:
            with self._cond:
                worker.wait_for(self._cond, lambda: self._round > my_round)
        if grads[0].device == self._flat.device:
            torch._foreach_copy_(grads, self._mean)
        else:  # peer copies on this replica's stream; the mean was completed on the host before publishing
            for g, m in zip(grads, self._mean):
                g.copy_(m, non_blocking=True)
        return self._mean_metrics if metrics is not None else None

    def _reduce(self, worker: Worker, posted: list[tuple]) -> None:
        """On replica 0's thread and device: mean = (g_0 + g_1 + ... + g_{N-1}) [+ other ranks] / total."""
        grads0 = posted[0][0]
        device = self._flat.device
        for _, _, ready in posted:
            sync_event(ready)  # host waits: every replica's backward is complete
        torch._foreach_copy_(self._mean, grads0)
        for grads, _, _ in posted[1:]:
            if len(grads) != len(grads0):
                raise RuntimeError("replicas produced gradients for different parameter sets")
            torch._foreach_add_(self._mean, [g.to(device, non_blocking=True) for g in grads])
        metrics = [m for _, m, _ in posted]
        log_step = metrics[0] is not None
        for k, view in self._metrics.items():
            if log_step:
                view.copy_(metrics[0][k])
                for m in metrics[1:]:
                    view.add_(m[k].to(device))
            else:
                view.zero_()
        if self.peers is not None:
            self._cross_process(worker)
        self._flat[:self._numel].div_(float(self.total))
        if log_step:
            self._mean_metrics = {k: v.clone() for k, v in self._metrics.items()}
        sync_event(record_event(device))  # the mean is complete before any replica reads it

    def finish(self) -> None:
        """Replica 0 ran its last step: the processes' next collective is the end-of-training check."""
        if self.peers is not None:
            self.peers.steps_done()

    def _cross_process(self, worker: Worker) -> None:
        """The one all-reduce of the step across processes. If this rank is stopping, its status goes out instead of
        a silent absence; if any rank stopped, the step does not count anywhere (Stopped)."""
        control = worker.control
        status = OK if not control.stop.is_set() else FAILED if control.failure is not None else INTERRUPTED
        decided = self.budget.stop_after if self.budget is not None else None
        try:
            stop_after = self.peers.step(self._flat, status, decided, worker.beat)
        except PeerStopped as e:
            if e.interrupted:
                control.interrupt(str(e))
            else:
                control.fail("peers", str(e))  # the message names the rank
            raise Stopped from None
        if status != OK:
            raise Stopped  # this rank told the others; its own failure or signal is reported by the coordinator
        if stop_after is not None and self.budget is not None and self.budget.stop_after is None:
            self.budget.stop_after = stop_after  # rank 0's decision, read by every replica after this step
