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

`pipeline.grad_reduce=nccl` (several CUDA replicas in one process): every replica copies its gradients into a flat
buffer of its own on its stream; replica 0's thread, once all have posted, queues one NCCL all-reduce over those
buffers on the replicas' own streams (`torch.cuda.nccl.all_reduce`, the single-process multi-GPU collective); each
replica then divides and copies back on its stream. Stream order alone keeps it safe (a replica's copy-in precedes
the collective on its stream, and its next copy-in follows its copy-back), so no thread waits for a GPU. The
result is bit-identical on every replica (NCCL's all-reduce hands every rank the same reduced chunks), but its sum
order is NCCL's, not replica order: a run is reproducible on the same GPUs, not bit-equal to the host method.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..training.budget import TimeBudget
from .devices import current_stream, record_event, sync_event
from .distributed import FAILED, INTERRUPTED, OK, DistributedSync, PeerStopped
from .worker import RunControl, Stopped

# A replica's stop-aware wait on a condition it holds (Worker.wait_for: beats, leaves when the run stops).
WaitFor = Callable[[threading.Condition, Callable[[], bool]], None]


def nccl_all_reduce(buffers: list[torch.Tensor], streams: list) -> None:
    """Sum `buffers` (one per GPU, equal shapes) in place on every GPU, queued on `streams` (one per buffer):
    NCCL's single-process multi-GPU all-reduce, the collective DataParallel's broadcasts come from."""
    from torch.cuda import nccl

    nccl.all_reduce(buffers, streams=streams)


class GradAverager:
    """control: the run's (a rank's stop or failure goes out in its status slot); budget: the run's TimeBudget, whose
    stop decision (rank 0's) travels in the all-reduce to every rank."""

    def __init__(self, num_replicas: int, control: RunControl, peers: DistributedSync | None = None,
                 method: str = "host", budget: TimeBudget | None = None):
        self.n, self.control, self.budget = num_replicas, control, budget
        self.peers = peers if peers is not None and peers.enabled else None
        self.total = self.n * (self.peers.world if self.peers else 1)  # replicas of the whole run
        self._cond = threading.Condition()
        self._posted: list[tuple | None] = [None] * num_replicas  # (grads, metrics, ready event) of this round
        self._round = 0                                           # rounds published so far
        self._flat: torch.Tensor | None = None                    # [G + M + step_slots] on replica 0's device
        self._mean: list[torch.Tensor] = []                       # views of flat, shaped like the grads
        self._metrics: dict[str, torch.Tensor] = {}               # views of flat, shaped like the metrics
        self._numel = 0                                           # G + M: what is divided by `total`
        self._mean_metrics: dict | None = None
        self.nccl = method == "nccl" and num_replicas > 1
        if self.nccl and self.peers is not None:
            raise ValueError("grad_reduce=nccl averages the replicas of one process; under torchrun run one drafter "
                             "replica per process, or grad_reduce=host")
        self._local: list[tuple | None] = [None] * num_replicas  # nccl: (flat, grad views, metric views) per replica

    @property
    def active(self) -> bool:
        return self.n > 1 or self.peers is not None

    def prepare(self, replica: int, params: list[torch.nn.Parameter], metrics: dict[str, torch.Tensor]) -> None:
        """Called by every replica after its warm-up step (`metrics` as a step returns them); replica 0 allocates the
        flat buffer (nccl: every replica its own). Before the first step, so a rank that stops early knows the
        layout the others all-reduce."""
        if self.nccl:
            self._local[replica] = self._flat_views(params, metrics)
            if replica == 0:
                self._flat, self._mean, self._metrics = self._local[0]
                self._numel = self._flat.numel()
            return
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

    @staticmethod
    def _flat_views(params: list[torch.nn.Parameter], metrics: dict[str, torch.Tensor]):
        """(flat [G + M] on the grads' device, grad-shaped views, metric-shaped views) for the nccl method."""
        grads = [p.grad for p in params if p.grad is not None]
        sizes = [g.numel() for g in grads] + [m.numel() for m in metrics.values()]
        flat = torch.zeros(sum(sizes), dtype=grads[0].dtype, device=grads[0].device)
        views = flat.split(sizes)
        return (flat, [v.view_as(g) for v, g in zip(views, grads)],
                {k: v.view(m.shape) for v, (k, m) in zip(views[len(grads):], metrics.items())})

    @property
    def step_numel(self) -> int:
        """G + M, the size every rank's step all-reduce must agree on (0 without a buffer)."""
        return self._numel

    def all_reduce(self, replica: int, params: list[torch.nn.Parameter], metrics: dict | None, wait_for: WaitFor,
                   beat: Callable[[], None]) -> dict | None:
        """Replace every replica's grads by their mean; return the mean metrics (or None when metrics is None).
        wait_for, beat: the calling replica's stop-aware wait and heartbeat (it waits here for the others)."""
        if not self.active:
            return metrics
        if self.nccl:
            return self._all_reduce_nccl(replica, params, metrics, wait_for)
        grads = [p.grad for p in params if p.grad is not None]  # same set on every replica: same graph
        ready = record_event(grads[0].device)
        self._round_trip(replica, (grads, metrics, ready), lambda posted: self._reduce(posted, beat), wait_for)
        if grads[0].device == self._flat.device:
            torch._foreach_copy_(grads, self._mean)
        else:  # peer copies on this replica's stream; the mean was completed on the host before publishing
            for g, m in zip(grads, self._mean):
                g.copy_(m, non_blocking=True)
        return self._mean_metrics if metrics is not None else None

    def _round_trip(self, replica: int, item: tuple, reduce, wait_for: WaitFor) -> None:
        """One round: every replica posts `item`; replica 0, once all have posted, runs reduce(posted items in
        replica order) and publishes the round; the others return once it is published."""
        with self._cond:
            my_round = self._round
            self._posted[replica] = item
            self._cond.notify_all()
            if replica == 0:
                wait_for(self._cond, lambda: all(p is not None for p in self._posted))
                posted, self._posted = self._posted, [None] * self.n
        if replica == 0:
            reduce(posted)
            with self._cond:
                self._round += 1
                self._cond.notify_all()
        else:
            with self._cond:
                wait_for(self._cond, lambda: self._round > my_round)

    def _all_reduce_nccl(self, replica: int, params: list[torch.nn.Parameter], metrics: dict | None,
                         wait_for: WaitFor) -> dict | None:
        """The nccl method (module docstring): copy in, one collective queued by replica 0, divide, copy back."""
        flat, grad_views, metric_views = self._local[replica]
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_copy_(grad_views, grads)
        for k, view in metric_views.items():
            view.copy_(metrics[k]) if metrics is not None else view.zero_()
        self._round_trip(replica, (current_stream(flat.device),),  # a tuple: on CPU the stream is None
                         lambda posted: nccl_all_reduce([local[0] for local in self._local], [p[0] for p in posted]),
                         wait_for)
        flat.div_(float(self.total))
        torch._foreach_copy_(grads, grad_views)
        return {k: v.clone() for k, v in metric_views.items()} if metrics is not None else None

    def _reduce(self, posted: list[tuple], beat: Callable[[], None]) -> None:
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
            self._cross_process(beat)
        self._flat[:self._numel].div_(float(self.total))
        if log_step:
            self._mean_metrics = {k: v.clone() for k, v in self._metrics.items()}
        sync_event(record_event(device))  # the mean is complete before any replica reads it

    def finish(self) -> None:
        """Replica 0 ran its last step: the processes' next collective is the end-of-training check."""
        if self.peers is not None:
            self.peers.steps_done()

    def _cross_process(self, beat: Callable[[], None]) -> None:
        """The one all-reduce of the step across processes. If this rank is stopping, its status goes out instead of
        a silent absence; if any rank stopped, the step does not count anywhere (Stopped)."""
        control = self.control
        status = OK if not control.stop.is_set() else FAILED if control.failure is not None else INTERRUPTED
        decided = self.budget.stop_after if self.budget is not None else None
        try:
            stop_after = self.peers.step(self._flat, status, decided, beat)
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
