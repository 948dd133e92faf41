"""The feature cache: a row's target features kept for the batches and epochs that train on it again.

`RowFeatures` sits between a target worker (or the single-device trainer) and the target's forward. It returns the
last row's features to every batch of that row (train.steps_per_row), and, over a schedule whose rows recur each
epoch, keeps the first rows it computes for the rest of the run: on the device up to train.feature_cache_gb, then
in host memory up to train.feature_cache_host_gb (`host_memory_available`, cgroup limits included), so that from
the second epoch on those rows cost no target forward. What each tier buys is measured in docs/BENCHMARKS.md
("Feature cache").
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..devices import cuda_memory_available

log = logging.getLogger("dflash_train")


# cgroup memory controllers: (the hierarchy's directory under the cgroup mount, limit, usage, the memory.stat key of
# the reclaimable page cache that usage counts), v2 then v1.
_CGROUP_MEMORY = (("", "memory.max", "memory.current", "inactive_file"),
                  ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def host_memory_available(meminfo: str = "/proc/meminfo", cgroup_mount: str = "/sys/fs/cgroup",
                          self_cgroup: str = "/proc/self/cgroup") -> float:
    """Bytes of host memory this process may still take: the OS's MemAvailable, and at most what the memory limit of
    its cgroup, or of any ancestor, leaves (limit less usage, the reclaimable page cache not counted as used): a
    container's /proc/meminfo shows the whole machine, and passing the cgroup's limit gets the process killed.
    Infinity where none of them can be read."""
    available = float("inf")
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = float(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for group, limit_file, usage_file, cache_key in _cgroup_memory_dirs(cgroup_mount, self_cgroup):
        try:
            limit = (group / limit_file).read_text().strip()
            if limit == "max":
                continue
            used = float((group / usage_file).read_text())
        except (OSError, ValueError):
            continue
        try:
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            used -= float(stat.get(cache_key, 0))
        except (OSError, ValueError):
            pass
        available = min(available, max(0.0, float(limit) - used))
    return available


def _cgroup_memory_dirs(cgroup_mount: str, self_cgroup: str) -> list[tuple]:
    """(directory, limit file, usage file, page-cache key) for this process's cgroup and each ancestor up to the
    mount, under every memory hierarchy /proc/self/cgroup names (v2: "0::/path"; v1: "N:memory:/path")."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        named = controllers.split(",") if controllers else [""]   # v2's line names no controller
        for sub, *files in _CGROUP_MEMORY:
            if sub in named:
                root = Path(cgroup_mount, sub)
                leaf = root / path.strip().lstrip("/")
                dirs += [(d, *files) for d in [leaf, *leaf.parents] if d == root or root in d.parents]
    return dirs


class RowFeatures:
    """A row's target features, computed once for all the batches that train on it.

    Always the last row (train.steps_per_row > 1: the batches of one row, `row_of(batch.index)`, are consecutive).
    With budget_bytes (train.feature_cache_gb, over a schedule with fixed rows: BatchSchedule.row_of then names the
    same row in every epoch) also the rows first seen, as many as fit, for the rest of the run: from the second epoch
    on their batches cost no target forward. The kept rows are the first ones computed and never change: the rows
    recur in a fresh random order each epoch, where no eviction policy would do better. On CUDA the budget is capped
    at the device's free memory (the driver's, plus what this process's allocator holds unused) less CUDA_HEADROOM
    when the first row is known. A returned tensor is never written after it is computed (FeatureForward returns a
    fresh one), so one tensor serves every batch of its row.

    With host_budget_bytes (train.feature_cache_host_gb) the rows past the device's share are kept in host memory,
    as many as that holds and the host can spare (host_memory_available, cgroup limits included, less HOST_HEADROOM
    and the shares of this process's other tiers): plain (pageable) memory, copied out by a background thread on a
    stream of its own and back to the device in the calling thread (the target worker, which waits for room in its
    queue most of the time while the drafter trains). Timed on an H100 (docs/BENCHMARKS.md, "Feature cache"): rows
    served from host memory train as fast as rows kept on the device; the copy out, when the worker made it itself
    (~40 ms a 45 MiB row), halved the first epoch's speed, hence the thread (at most MAX_PENDING_COPIES rows on their
    way out, each holding its device tensor until copied); with it a first epoch that copies every row out runs at
    0.87x one that keeps none (H200, 2026-12-07) while the copier's zero_() ran on every core, and as fast as one
    that keeps none with the whole process on 2 or 4 intra-op threads (H100, 2026-12-07), and so does the copier's
    own team of COPY_THREADS (_copier_pool: 280.7k tokens/s against 224.6-237.8k with its default team of 16, H100,
    2026-12-07); the later epochs' rows cost no target forward."""

    CUDA_HEADROOM = 8 * 2**30
    HOST_HEADROOM = 8 * 2**30  # host memory left to the rest of the process and the machine
    MAX_PENDING_COPIES = 4     # rows being copied out to host memory at once; past that the worker waits
    COPY_THREADS = 4           # the copier's intra-op threads (_copier_pool)
    # The host tiers of this process (one per target device) that hold a share of host memory: each worker sizes
    # its tier when its first row is known, at about the same moment as the others and before any has filled its
    # own, so what the OS reports available is shared out, not promised to each in full. A tier's share ends with
    # release() or with the tier itself (a failed run that never released it).
    _host_lock = threading.Lock()
    _host_tiers: "weakref.WeakSet[RowFeatures]" = weakref.WeakSet()

    def __init__(self, row_of, budget_bytes: float = 0, name: str = "target", host_budget_bytes: float = 0):
        self.row_of, self.budget_bytes, self.name = row_of, budget_bytes, name
        self.host_budget_bytes = host_budget_bytes
        self._row: int | None = None
        self._feats: torch.Tensor | None = None
        self.kept: dict[int, torch.Tensor] = {}
        self.kept_host: dict[int, Future] = {}  # rows past the device's share: their host copies (_copy_out)
        self._copier: ThreadPoolExecutor | None = None
        self._copy_stream = None                  # CUDA: the copier's stream
        self._pending: deque[Future] = deque()    # copies out not yet known to be done, oldest first
        self._device: torch.device | None = None  # where the rows are computed (and host rows go back to)
        self.capacity: int | None = None  # rows that may be kept on the device; decided by the first row's size
        self.host_capacity = 0            # rows that may be kept in host memory; decided with capacity
        self._host_promise = 0            # bytes of host memory this tier's capacity counts on (until release)
        self.computed = 0     # forwards run (tests count them)
        self.served = 0       # batches served from a kept row without a forward (either memory)
        self.served_host = 0  # of which from host memory

    def __call__(self, index: int, compute) -> torch.Tensor:
        row = self.row_of(index)
        if row == self._row:
            return self._feats
        feats = self.kept.get(row)
        if feats is not None:
            self.served += 1
        elif (host := self.kept_host.get(row)) is not None:
            self._row, self._feats = None, None
            feats = host.result().to(self._device)  # a fresh device tensor (a CPU run: the copy; rows are never written)
            self.served += 1
            self.served_host += 1
        else:
            self._row, self._feats = None, None  # the last row's tensor is not kept alive during the forward
            feats = compute()
            self.computed += 1
            self._device = feats.device
            if self.budget_bytes or self.host_budget_bytes:
                if len(self.kept) < self._capacity_for(feats):
                    self.kept[row] = feats
                elif len(self.kept_host) < self.host_capacity:
                    self.kept_host[row] = self._copy_out(feats)
        self._row, self._feats = row, feats
        return feats

    def _copy_out(self, feats: torch.Tensor) -> Future:
        """A host copy of feats, made by the copier thread once the work that computed feats (on the calling
        thread's stream) is done; the caller goes on at once unless MAX_PENDING_COPIES copies are still running."""
        if self._copier is None:
            self._copier = _copier_pool(f"{self.name}-copy-out", self.COPY_THREADS)
            if feats.device.type == "cuda":
                self._copy_stream = torch.cuda.Stream(feats.device)
        ready = None
        if self._copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(feats.device))
        copy = self._copier.submit(_host_copy, feats, ready, self._copy_stream)
        self._pending.append(copy)
        while self._pending and (self._pending[0].done() or len(self._pending) > self.MAX_PENDING_COPIES):
            self._pending.popleft().result()  # waits only past the limit; a failed copy raises here
        return copy

    def _capacity_for(self, feats: torch.Tensor) -> int:
        if self.capacity is None:
            row_bytes = feats.numel() * feats.element_size()
            budget = self.budget_bytes
            if feats.device.type == "cuda":  # the driver's free memory and what this process's allocator holds idle
                budget = min(budget, max(0, cuda_memory_available(feats.device) - self.CUDA_HEADROOM))
            self.capacity = int(budget // row_bytes)
            with RowFeatures._host_lock:
                promised = sum(tier._host_promise for tier in RowFeatures._host_tiers)
                spare = host_memory_available() - self.HOST_HEADROOM - promised
                self.host_capacity = int(max(0, min(self.host_budget_bytes, spare)) // row_bytes)
                self._host_promise = self.host_capacity * row_bytes
                RowFeatures._host_tiers.add(self)
            where = (f" and {self.host_capacity} in host memory ({self._host_promise / 2**30:.1f} GiB: "
                     f"{self.host_budget_bytes / 2**30:g} asked, {max(0, spare) / 2**30:.1f} the host could spare)"
                     if self.host_budget_bytes else "")
            what = ("their later epochs run no target forward" if self.capacity + self.host_capacity else
                    "not one row fits, every row is computed every epoch")
            log.info(f"{self.name}: feature cache of {self.capacity} rows ({self.capacity * row_bytes / 2**30:.1f} "
                     f"GiB, {row_bytes / 2**20:.1f} MiB a row) on {feats.device}{where}: {what}")
        return self.capacity

    def release(self) -> None:
        """Drop every kept row (the end of training): what runs next in the process, the demo's measurement, gets the
        memory back even while something still refers to this object."""
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier, self._pending = None, deque()
        self.kept.clear()
        self.kept_host.clear()
        self._row, self._feats = None, None
        with RowFeatures._host_lock:
            self._host_promise = 0

    def summary(self) -> str:
        """One line for the end of the run: what the cache kept and saved."""
        kept = sum(t.numel() * t.element_size() for t in self.kept.values())
        host = sum(t.numel() * t.element_size() for t in (f.result() for f in self.kept_host.values()))
        in_host = (f" + {len(self.kept_host)} in host memory ({host / 2**30:.1f} GiB; {self.served_host} rows served "
                   "from there)" if self.host_budget_bytes else "")
        return (f"{self.name}: feature cache kept {len(self.kept)} rows ({kept / 2**30:.1f} GiB){in_host}; "
                f"{self.computed} target forwards, {self.served} rows served from the cache")


def _copier_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """One thread for the copies out, whose intra-op work (_host_copy's zero_()) runs on at most `threads` threads.

    Under OpenMP each thread that runs parallel work leads a team of its own, by default as large as the machine.
    On a 16-core H100 host the copier's 16, faulting pages in and spinning between rows, took the cores the training
    threads launch their kernels from: a first epoch that copied every row out ran at 225-238k tokens/s against 280k
    for one that kept nothing, and at 280k with the whole process on 2 or 4 intra-op threads (OMP_NUM_THREADS;
    `benchmarks/gpu_demo.sh cache_speed`, docs/BENCHMARKS.md "Feature cache"). One thread alone (numpy's fill) was
    too slow to keep up (43 ms a 45 MiB row against a 29 ms step).

    torch.set_num_threads in the copier sets its team, but also the size every thread not yet started with torch
    takes; the caller sets that back at once (a thread that starts torch in between gets the copier's size). Other
    parallel backends have one pool for the process: the copier keeps it."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ThreadPoolExecutor(1, thread_name_prefix=name)
    default = torch.get_num_threads()

    def small_team():
        torch.get_num_threads()  # this thread's first use of torch takes the default; the line below then sticks
        torch.set_num_threads(min(threads, default))

    pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=small_team)
    pool.submit(int).result()       # the initializer has run
    torch.set_num_threads(default)  # the default for threads yet to start, and the caller's own (unchanged)
    return pool


def _host_copy(feats: torch.Tensor, ready, stream) -> torch.Tensor:
    """feats -> a copy in (pageable) host memory, on `stream` after the `ready` event on CUDA: returns when done.

    The fresh buffer's pages are faulted in first by zero_(), which runs on the copier's intra-op threads: inside a
    device-to-host copy the driver's one thread would fault them in one at a time, and faulting, not copying, is
    most of a row's cost (a 45 MiB row on the 2-core dev box, `benchmarks/host_copy_cpu.py`: into a buffer already
    faulted in 6.7-8.2 ms on one thread, into a fresh one 25.7-30.8 ms on one thread, 15-18 ms on two)."""
    host = torch.empty(feats.shape, dtype=feats.dtype).zero_()
    if stream is None:
        return host.copy_(feats)
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        return host.copy_(feats)
