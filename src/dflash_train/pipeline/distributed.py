"""Past one process: the threaded pipeline in every process of a torchrun launch, kept in lockstep.

  torchrun --nnodes N --nproc-per-node P -m dflash_train.cli train ...

Every process runs the whole pipeline over its own devices (`pipeline.*_devices` are per process; 'auto' is
cuda:LOCAL_RANK). Three things tie the processes together:
  data    batch i -> global replica i % (world * n), global replica g = rank * n + r (`loader.DataShard`): exactly the
          batch sequence, anchors and assignment of one process holding all world * n replicas, cut into disjoint shards.
  grads   gradsync sums the n local replicas in order, then ONE all-reduce per step (NCCL on CUDA, gloo on CPU) of
          [grads | metrics | stop step | one status per rank], divided by world * n. Every replica of every rank gets
          the same bits, so the same clip + AdamW keep them all bit-identical.
  health  the status slots: a rank that stops (an error, a signal) says so in the collective the others wait in
          instead of vanishing, and they stop within one step with "rank r failed; see its log". A rank that dies
          hard: gloo fails at once (connection reset); every wait here has a deadline of pipeline.stall_timeout_s,
          which is also the process group's timeout (NCCL's watchdog).

Collectives, the same sequence on every rank: `gate` (after startup: statuses and what must agree), `step` once per
training step, `bye` (weight checksums). `leave` sends a stopping rank's status in the NEXT collective of that
sequence, so sizes always match and nobody waits for a collective that will never come. Collectives are issued from
one thread at a time (the lock): the main thread (gate, bye, leave) or drafter replica 0's thread (step).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..config import Config, ConfigError

log = logging.getLogger("dflash_train")

OK, FAILED, INTERRUPTED = 0, 1, 2  # what a rank says in its status slot
# What must agree between ranks, checked once at the gate (one float64 each, exact for integers below 2**53).
GATE_KEYS = ("local replicas", "start step", "total steps", "gradient + metric size", "run config")
_POLL_MAX_S = 0.001  # longest pause between two polls of a pending collective (its delay on every step)


class PeerStopped(RuntimeError):
    """Another rank stopped: it failed (`interrupted` False) or was interrupted by a signal."""

    def __init__(self, message: str, interrupted: bool):
        super().__init__(message)
        self.interrupted = interrupted


def local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def config_fingerprint(cfg: Config) -> int:
    """crc32 of what every rank must train with (model, data, train; paths and devices may differ per node)."""
    d = cfg.to_dict()
    d["model"].pop("target", None)
    for key in ("source", "cache_dir"):
        d["data"].pop(key, None)
    text = json.dumps({k: d[k] for k in ("model", "data", "train")}, sort_keys=True, default=str)
    return zlib.crc32(text.encode())


class DistributedSync:
    """This process's link to the other processes of the run; with world 1 (no torchrun) every method is a no-op.

    A context manager: leaving it with an exception sends this rank's status (`leave`), then the process group is
    destroyed."""

    def __init__(self, rank: int = 0, world: int = 1, local_world: int = 1, timeout_s: float = 600.0):
        self.rank, self.world, self.local_world, self.timeout_s = rank, world, local_world, timeout_s
        self.device = torch.device("cpu")  # where collective buffers live: drafter replica 0's device
        self.phase = "gate"                # the next collective: gate | step | bye | done
        self._lock = threading.Lock()
        self._step_buffer: torch.Tensor | None = None
        self._broken = False               # a collective failed or timed out: abort instead of a clean destroy

    @classmethod
    def from_env(cls, timeout_s: float) -> "DistributedSync":
        """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...); world 1 joins nothing.
        Called first, before anything that can fail, so a failing rank can always tell the others."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls(timeout_s=timeout_s)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised; dflash-train initialises it itself.")
        rank = int(os.environ["RANK"])
        # Both backends: tensors on CUDA go through NCCL, on CPU through gloo (the collective device decides).
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(local_rank())  # the main thread's device: no stray context on cuda:0 per process
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        sync = cls(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), timeout_s)
        log.info(f"rank {rank} of {world} ({backend}, local rank {local_rank()} of {sync.local_world})")
        return sync

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def step_slots(self) -> int:
        """Extra elements at the end of the step buffer: the stop step, then one status per rank."""
        return 1 + self.world if self.enabled else 0

    def use_device(self, device: torch.device) -> None:
        self.device = device

    def register_step_buffer(self, flat: torch.Tensor) -> None:
        """The flat step buffer (gradsync's), so that `leave` can send a status in the step phase."""
        self._step_buffer = flat

    # ------------------------------------------------------------------ the collectives
    def gate(self, values: dict[str, int], beat: Callable[[], None] | None = None) -> None:
        """After startup, before the first step: every rank is ready, and all agree on `values` (GATE_KEYS).
        `beat` is called while waiting for slower ranks (e.g. a watchdog's heartbeat)."""
        if not self.enabled:
            return
        with self._lock:
            rows = self._exchange_rows(OK, [float(values[k]) for k in GATE_KEYS], "the start gate", beat)
            self.phase = "step"
        for i, key in enumerate(GATE_KEYS, start=1):
            seen = [int(v) for v in rows[:, i].tolist()]
            if len(set(seen)) > 1:  # every rank sees the same rows, so every rank raises the same error
                self.phase = "done"
                where = "resume from the same checkpoints: run.out_dir on a filesystem every node shares" \
                    if key == "start step" else "the same config, overrides, data and number of drafter devices"
                raise ConfigError(f"the ranks disagree on the {key} (rank 0..{self.world - 1}: {seen}); launch every "
                                  f"rank with {where}.")

    def step(self, flat: torch.Tensor, status: int, stop_after: int | None, beat: Callable[[], None]) -> int | None:
        """Sum `flat` over ranks in place (its last `step_slots` elements are written here). Returns the stop step
        decided by rank 0's time budget, if any. Raises PeerStopped when another rank stopped; returns normally
        after sending this rank's own non-OK status (the caller stops)."""
        with self._lock:
            if self.phase != "step":
                raise PeerStopped(f"rank {self.rank}: no step all-reduce after the run stopped", interrupted=False)
            tail = flat[-self.step_slots:]
            tail.zero_()
            if self.is_rank0 and stop_after is not None:
                tail[0] = stop_after + 1  # 0 means no decision
            tail[1 + self.rank] = status
            self._all_reduce(flat, "a step's gradient all-reduce", beat)
            values = tail.tolist()  # host sync: the flags decide whether this step counts
            self._check([int(v) for v in values[1:]], status)
        return int(values[0]) - 1 if values[0] > 0 else None

    def steps_done(self) -> None:
        """This rank's last step all-reduce is done: the next collective is `bye`, so a rank that stops from now on
        says so in bye's shape (every rank trains the same number of steps)."""
        with self._lock:
            if self.phase == "step":
                self.phase = "bye"

    def bye(self, checksums: list[float], beat: Callable[[], None] | None = None) -> None:
        """After the last step: every rank finished, and all replicas everywhere hold the same weights.
        `checksums`: [final weights checksum, sum of the per-step checksums] of replica 0."""
        if not self.enabled:
            return
        with self._lock:
            rows = self._exchange_rows(OK, checksums, "the end of training", beat)
            self.phase = "done"
        for r, row in enumerate(rows[:, 1:].tolist()):
            if row != rows[self.rank, 1:].tolist():
                raise RuntimeError(f"rank {r}'s weights differ from rank {self.rank}'s after training (checksums "
                                   f"{row} vs {rows[self.rank, 1:].tolist()}): a gradient-sync bug.")
        log.info(f"replicas identical on all {self.world} ranks after every step (weights checksum {checksums[0]:.6f})")

    def leave(self, status: int) -> None:
        """Tell the other ranks that this one stops (FAILED or INTERRUPTED), in the collective they wait in next.
        Never raises: the caller is already on its way out with its own error."""
        if not self.enabled or status == OK:
            return
        if not self._lock.acquire(timeout=self.timeout_s):  # a collective in progress finishes or times out first
            return
        try:
            if self.phase == "gate":
                self._exchange_rows(status, [0.0] * len(GATE_KEYS), "the start gate")
            elif self.phase == "step" and self._step_buffer is not None:
                tail = self._step_buffer[-self.step_slots:]
                tail.zero_()
                tail[1 + self.rank] = status
                self._all_reduce(self._step_buffer, "a step's gradient all-reduce", None)
            elif self.phase == "bye":
                self._exchange_rows(status, [0.0, 0.0], "the end of training")
        except Exception as e:  # noqa: BLE001 - the other ranks may be gone already; this rank's error comes first
            log.warning(f"rank {self.rank} could not tell the other ranks it stops: {e}")
        finally:
            self.phase = "done"
            self._lock.release()

    def close(self) -> None:
        if not self.enabled or not dist.is_initialized():
            return
        if self._broken and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()  # a pending NCCL kernel would make destroy wait for it
        else:
            dist.destroy_process_group()

    def __enter__(self) -> "DistributedSync":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is not None:
                self.leave(INTERRUPTED if issubclass(exc_type, KeyboardInterrupt) else FAILED)
        finally:
            self.close()
        return False

    # ------------------------------------------------------------------ internals
    def _exchange_rows(self, status: int, values: list[float], what: str,
                       beat: Callable[[], None] | None = None) -> torch.Tensor:
        """All-gather one float64 row [status, *values] per rank (a sum where each rank fills its own row)."""
        rows = torch.zeros(self.world, 1 + len(values), dtype=torch.float64)
        rows[self.rank] = torch.tensor([float(status), *values], dtype=torch.float64)
        rows = rows.to(self.device)
        self._all_reduce(rows, what, beat)
        rows = rows.cpu()
        self._check([int(s) for s in rows[:, 0].tolist()], status)
        return rows

    def _all_reduce(self, buf: torch.Tensor, what: str, beat: Callable[[], None] | None) -> None:
        """SUM-all-reduce `buf` in place; polls (beating `beat`, so a rank waiting for a slower one is not reported
        as stalled) until done, failed, or pipeline.stall_timeout_s passed."""
        work = dist.all_reduce(buf, async_op=True)
        deadline, pause = time.monotonic() + self.timeout_s, 1e-4
        while not work.is_completed():
            if beat is not None:
                beat()
            if time.monotonic() > deadline:
                self._broken, self.phase = True, "done"
                raise RuntimeError(f"rank {self.rank} waited {self.timeout_s:g} s for the other ranks at {what} "
                                   "(pipeline.stall_timeout_s): a rank hangs or died; see the other ranks' logs.")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        try:
            work.wait()  # raises what the backend saw; on CUDA it also orders this thread's stream after the result
        except Exception as e:
            self._broken, self.phase = True, "done"
            raise RuntimeError(f"rank {self.rank}: {what} failed: another rank's process ended without saying why "
                               f"(killed, out of memory, a crash); see its log. ({e})") from e

    def _check(self, statuses: list[int], own: int) -> None:
        """After a collective: if any rank stopped, the run ends here on every rank (no collective follows)."""
        if not any(statuses):
            return
        self.phase = "done"
        if own != OK:
            return  # this rank's own stop is what its caller reports
        failed = [r for r, s in enumerate(statuses) if s == FAILED]
        if failed:
            raise PeerStopped(f"rank {failed[0]} failed; see its log", interrupted=False)
        stopped = [r for r, s in enumerate(statuses) if s == INTERRUPTED]
        raise PeerStopped(f"a signal on rank {stopped[0]}", interrupted=True)
