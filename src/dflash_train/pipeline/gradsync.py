"""Gradient averaging across drafter replicas (threads), every step, in a fixed order.

A barrier-style all-reduce: each replica posts its gradients; replica 0's thread sums them in replica order
(0, 1, ..., N-1) into persistent buffers on its device and divides by N; every replica then copies the mean back
into its own `.grad`. All replicas receive the very same bits, so identical clip + AdamW + schedule keep them
bit-identical, and the fixed order makes a run reproducible whatever the thread timing. With one replica it is a
no-op, which is what makes the 1-drafter pipeline equal the single-device trainer exactly.

Sync points (CUDA): each replica records an event after its backward; replica 0 waits for all of them on the host,
and finishes its sum on the host before publishing, so the cross-device reads on either side see complete data.
A replica posts round k+1 only after its round-k copy was queued on its stream, so the buffers are never
overwritten while being read. Metrics are averaged the same way, only on log steps.
"""

from __future__ import annotations

import threading

import torch

from .devices import record_event, sync_event
from .worker import Worker


class GradAverager:
    def __init__(self, num_replicas: int):
        self.n = num_replicas
        self._cond = threading.Condition()
        self._posted: list[tuple | None] = [None] * num_replicas  # (grads, metrics, ready event) of this round
        self._round = 0                                           # rounds published so far
        self._mean: list[torch.Tensor] | None = None              # persistent buffers on replica 0's device
        self._mean_metrics: dict | None = None

    def all_reduce(self, worker: Worker, replica: int, params: list[torch.nn.Parameter],
                   metrics: dict | None) -> dict | None:
        """Replace every replica's grads by their mean; return the mean metrics (or None when metrics is None)."""
        if self.n == 1:
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
            self._reduce(posted)
            with self._cond:
                self._round += 1
                self._cond.notify_all()
        else:
            with self._cond:
                worker.wait_for(self._cond, lambda: self._round > my_round)
        if grads[0].device == self._mean[0].device:
            torch._foreach_copy_(grads, self._mean)
        else:  # peer copies on this replica's stream; the mean was completed on the host before publishing
            for g, m in zip(grads, self._mean):
                g.copy_(m, non_blocking=True)
        return self._mean_metrics if metrics is not None else None

    def _reduce(self, posted: list[tuple]) -> None:
        """On replica 0's thread and device: mean = (g_0 + g_1 + ... + g_{N-1}) / N, in that order."""
        grads0 = posted[0][0]
        device = grads0[0].device
        for _, _, ready in posted:
            sync_event(ready)  # host waits: every replica's backward is complete
        if self._mean is None:
            self._mean = [torch.empty_like(g) for g in grads0]
        torch._foreach_copy_(self._mean, grads0)
        for grads, _, _ in posted[1:]:
            if len(grads) != len(grads0):
                raise RuntimeError("replicas produced gradients for different parameter sets")
            torch._foreach_add_(self._mean, [g.to(device, non_blocking=True) for g in grads])
        torch._foreach_div_(self._mean, float(self.n))
        metrics = [m for _, m, _ in posted]
        if metrics[0] is not None:
            self._mean_metrics = {k: torch.stack([m[k].to(device).float() for m in metrics]).mean(0)
                                  for k in metrics[0]}
        sync_event(record_event(device))  # the mean is complete before any replica reads it
