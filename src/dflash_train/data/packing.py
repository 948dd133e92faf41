"""Pack tokenized documents into rows of exactly `token_budget` tokens, and turn rows into training batches.

A row carries, per token: input id, position (restarting at 0 for each document), document id (0, 1, ... within
the row; -1 for padding) and the loss mask. Positions and document ids are what keep packing exact: the target and
the drafter never attend across documents, so a document's features are the same packed or alone.
"""

from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

PACK_POLL_S = 0.05  # how often a wait for an epoch being packed calls back (BatchSchedule.iter_from)


def valid_anchor_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] bool: a is a valid anchor iff tokens a and a+1 are supervised and in the same document."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:-1] = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:])
    return ok


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct valid anchors (CPU, seeded) -> anchors [A] (sorted), valid [A].

    Rows with fewer valid positions are padded with anchor 0 marked invalid, so A is always the same."""
    candidates = valid_anchor_positions(loss_mask, doc_ids).nonzero().flatten()
    n = min(num_anchors, candidates.numel())
    pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:n]].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:n], valid[:n] = pick, True
    return anchors, valid


@dataclass
class Sample:
    """One tokenized conversation: ids and the assistant-only loss mask, same length."""
    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self):
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("input_ids and loss_mask must have the same length")


@dataclass
class DatasetSplit:
    train: list[Sample]
    heldout: list[Sample]
    # held-out conversations as chat messages (prompts for evaluation); empty for the synthetic source
    heldout_messages: list[list[dict]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    # a data.mix's held-out conversations: the source each came from (its file's stem), for validation by source
    heldout_sources: list[str] = field(default_factory=list)
    # each held-out conversation's key (its record's id), to pair validation's replies with measured prompts
    heldout_keys: list[str] = field(default_factory=list)


@dataclass
class PackedRow:
    input_ids: torch.Tensor     # [T] long
    position_ids: torch.Tensor  # [T] long, restart per document
    doc_ids: torch.Tensor       # [T] long, -1 for padding
    loss_mask: torch.Tensor     # [T] bool


ANCHOR_FLOOR = 0.1  # train.anchor_sampling=decoding: the weight of an anchor whose token the target was sure of


def decoding_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, token_probs: torch.Tensor, num_anchors: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors drawn as speculative decoding starts its blocks (train.anchor_sampling=decoding), on any device and
    without a host sync -> anchors [A] (sorted, padded with anchor 0 marked invalid, as sample_anchors), valid [A].

    Decoding starts a block after the drafter's first miss, and misses fall where the target itself was unsure: on
    held-out ShareGPT replies (SmolLM2, demo-m's drafter) the 28% of tokens the target gave p < 0.5 held 58% of the
    walk's anchors. So each valid anchor a is drawn with weight ANCHOR_FLOOR + (1 - p[a]), token_probs [T] being
    the target's probability of each token given the ones before it (TargetModel.own_token_probs); A of them
    without replacement, by the Gumbel top-k trick (log weight + Gumbel noise, the A largest)."""
    valid_pos = valid_anchor_positions(loss_mask, doc_ids)
    weight = ANCHOR_FLOOR + (1 - token_probs.float()).clamp(0, 1)
    u = torch.rand(weight.shape, generator=generator, device=weight.device).clamp_min(1e-20)
    keys = torch.where(valid_pos, weight.log() - (-u.log()).log(), float("-inf"))
    top = keys.topk(num_anchors)
    valid = top.values > float("-inf")
    order = torch.where(valid, top.indices, keys.shape[0]).argsort()  # the chosen ones in order, then the padding
    valid = valid[order]
    return torch.where(valid, top.indices[order], 0), valid


@dataclass
class TrainBatch:
    """Everything one drafter step needs except the target features. All shapes fixed: T and A."""
    input_ids: torch.Tensor     # [T]
    position_ids: torch.Tensor  # [T]
    doc_ids: torch.Tensor       # [T]
    loss_mask: torch.Tensor     # [T] bool
    anchors: torch.Tensor       # [A] long (sorted)
    anchor_valid: torch.Tensor  # [A] bool
    index: int = -1             # global batch index within the run (data position), for logs and resume
    epoch: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device, non_blocking: bool = False) -> "TrainBatch":
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return TrainBatch(**moved, index=self.index, epoch=self.epoch)

    def pin_memory(self) -> "TrainBatch":
        return TrainBatch(**{k: v.pin_memory() for k, v in self.tensors().items()}, index=self.index, epoch=self.epoch)


class FlatSamples:
    """Every sample's ids and loss mask in two flat arrays (made once): packing a row is then a few array slices
    instead of Python lists per token, so an epoch of millions of tokens packs in a fraction of a second."""

    def __init__(self, samples: Sequence[Sample]):
        self.lens = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=len(samples))
        self.starts = np.concatenate([[0], np.cumsum(self.lens)[:-1]]).astype(np.int64)
        total = int(self.lens.sum())
        self.ids = np.fromiter(itertools.chain.from_iterable(s.input_ids for s in samples), np.int64, count=total)
        self.mask = np.fromiter(itertools.chain.from_iterable(s.loss_mask for s in samples), np.bool_, count=total)

    def __len__(self) -> int:
        return len(self.lens)


RowPlan = list[tuple[int, int]]  # one row's documents: (start in FlatSamples' arrays, length), in row order


def plan_rows(flat: FlatSamples, token_budget: int, order: Sequence[int] | None = None) -> list[RowPlan]:
    """Greedy packing in `order` (default: as given), decided on lengths alone: documents fill a row until the next
    one does not fit, then a new row starts. Documents longer than the budget are truncated to it. No token is
    copied here (make_row does that, a row at a time), so planning an epoch of 76k documents takes milliseconds."""
    lens, starts = flat.lens.tolist(), flat.starts.tolist()
    plans: list[RowPlan] = []
    cur: RowPlan = []
    used = 0
    for i in (range(len(lens)) if order is None else order):
        n = min(lens[i], token_budget)
        if n == 0:
            continue
        if used + n > token_budget:
            plans.append(cur)
            cur, used = [], 0
        cur.append((starts[i], n))
        used += n
    if cur:
        plans.append(cur)
    return plans


def pack_samples(samples: Sequence[Sample] | FlatSamples, token_budget: int, pad_id: int = 0,
                 order: Sequence[int] | None = None) -> list[PackedRow]:
    """plan_rows, every row built (make_row). The last, partial row is padded."""
    flat = samples if isinstance(samples, FlatSamples) else FlatSamples(samples)
    return [make_row(flat, plan, token_budget, pad_id) for plan in plan_rows(flat, token_budget, order)]


def make_row(flat: FlatSamples, docs: RowPlan, token_budget: int, pad_id: int) -> PackedRow:
    """One planned row's tensors: its documents' tokens back to back, then padding to token_budget."""
    lens = np.array([n for _, n in docs] + [token_budget - sum(n for _, n in docs)], dtype=np.int64)  # last: pad
    pad = int(lens[-1])
    ids = np.concatenate([flat.ids[s:s + n] for s, n in docs] + [np.full(pad, pad_id, dtype=np.int64)])
    mask = np.concatenate([flat.mask[s:s + n] for s, n in docs] + [np.zeros(pad, dtype=np.bool_)])
    # positions restart at 0 for every document, padding included (it continues from 0 as its own span)
    pos = np.arange(token_budget, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    doc = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    doc[token_budget - pad:] = -1
    return PackedRow(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(doc), torch.from_numpy(mask))


def epoch_plan(flat: FlatSamples, token_budget: int, epoch: int, seed: int) -> list[RowPlan]:
    """The rows of one epoch, planned: documents shuffled with (seed, epoch), then plan_rows. Deterministic."""
    order = list(range(len(flat)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return plan_rows(flat, token_budget, order)


def epoch_rows(samples: Sequence[Sample] | FlatSamples, token_budget: int, epoch: int, seed: int,
               pad_id: int = 0) -> list[PackedRow]:
    """The rows of one epoch, built: epoch_plan, then make_row for each."""
    flat = samples if isinstance(samples, FlatSamples) else FlatSamples(samples)
    return [make_row(flat, plan, token_budget, pad_id) for plan in epoch_plan(flat, token_budget, epoch, seed)]


def make_batch(row: PackedRow, num_anchors: int, seed: int, index: int, epoch: int = 0) -> TrainBatch:
    """Attach anchors sampled with a generator seeded by (seed, index): the same batch index always gets the same
    anchors, whichever thread builds it and whether or not the run was resumed."""
    g = torch.Generator().manual_seed(hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF)
    anchors, valid = sample_anchors(row.loss_mask, row.doc_ids, num_anchors, g)
    return TrainBatch(row.input_ids, row.position_ids, row.doc_ids, row.loss_mask, anchors, valid, index, epoch)


class BatchSchedule:
    """The run's whole batch sequence: epoch e's rows in order, batch index i = running count.

    Iterating from `start` skips straight to batch `start` (resume). `max_batches` bounds the total.

    fixed_rows (train.feature_cache_gb): every epoch trains epoch 0's rows, in an order shuffled per epoch, instead
    of packing freshly shuffled documents, so a row recurs and its target features can be kept (RowFeatures);
    row_of then names a row by its place in epoch 0."""

    def __init__(self, samples: Sequence[Sample], token_budget: int, num_anchors: int, seed: int,
                 max_batches: int, pad_id: int = 0, repeats: int = 1, fixed_rows: bool = False,
                 flat: FlatSamples | None = None):
        if not samples:
            raise ValueError("no training samples")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.samples, self.token_budget, self.num_anchors = samples, token_budget, num_anchors
        self.seed, self.max_batches, self.pad_id = seed, max_batches, pad_id
        # train.steps_per_row: each row is `repeats` consecutive batches, each with its own anchors (seeded by its
        # index); the target computes the row's features once for all of them (row_of)
        self.repeats = repeats
        self.fixed_rows = fixed_rows
        self._rows_per_epoch: int | None = None
        self._flat: FlatSamples | None = flat  # another schedule's of the same samples (flat_samples()), or built once
        self._plans0: list[RowPlan] | None = None  # epoch 0's plan, with fixed_rows every epoch's rows
        self._orders: dict[int, list[int]] = {}     # with fixed_rows: recent epochs' row orders (_row_order)
        self._lock = threading.Lock()                # _orders and _plans0: the target workers and the packing thread

    @property
    def rows_per_epoch(self) -> int:
        if self._rows_per_epoch is None:
            self._rows_per_epoch = len(self._epoch(0))
        return self._rows_per_epoch

    def __len__(self) -> int:
        return self.max_batches

    def row_of(self, index: int) -> int:
        """The row that batch `index` trains on: batches with the same row share its target features. Rows are
        counted over the whole run, or with fixed_rows named by their place in epoch 0 (the same in every epoch)."""
        row = index // self.repeats
        if not self.fixed_rows:
            return row
        epoch, place = divmod(row, self.rows_per_epoch)
        return self._row_order(epoch)[place]

    def _row_order(self, epoch: int) -> list[int]:
        """With fixed_rows: epoch `epoch`'s rows as places in epoch 0 (epoch 0 itself in order; later epochs
        `spread_order`). The last few are kept: the target workers ask for the current epoch's, the packing thread
        for the next one's."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                n = len(self._epoch0())
                order = (list(range(n)) if epoch == 0 else
                         spread_order(n, SPREAD_BLOCK, random.Random(f"{self.seed}:rows:{epoch}")))
                if len(self._orders) >= 4:
                    del self._orders[min(self._orders)]
                self._orders[epoch] = order
            return order

    def _epoch0(self) -> list[RowPlan]:
        """With fixed_rows: epoch 0's plan, made once (under _lock); every epoch trains these rows."""
        if self._plans0 is None:
            self._plans0 = epoch_plan(self.flat_samples(), self.token_budget, 0, self.seed)
        return self._plans0

    def flat_samples(self) -> FlatSamples:
        """The samples' flat arrays, built once: every epoch plans from them (1.3 s for 27 M tokens on the dev box,
        `benchmarks/cache_load_cpu.py`), and a schedule of the same samples may take them (`flat`)."""
        if self._flat is None:
            self._flat = FlatSamples(self.samples)
        return self._flat

    def iter_from(self, start: int = 0, keep: Callable[[int], bool] | None = None,
                  waiting: Callable[[], None] | None = None) -> Iterable[TrainBatch]:
        """Batches `start`, `start + 1`, ...; with `keep`, only those whose index it accepts are built (a process's
        shard of a multi-process run: rows are still packed per epoch, but anchors are sampled for its own only).

        Every epoch is shuffled and planned on a side thread, the next one while this one is consumed, and each row
        is built (make_row: its tokens copied into tensors) only when its first batch is made. Building a whole
        epoch's rows at once took 0.7-1.7 s of Python on the 2-core box for the GPU demo's 76k conversations, and
        while it held the GIL every pipeline thread slowed: the demo of 2026-12-03 (demo-j) read 3-11% slow log
        windows at five of its eight epoch boundaries. A plan is lengths only (tens of milliseconds); a row costs
        ~0.3 ms, spread over the steps. epoch_plan is a pure function of its arguments, so the batches are the same
        either way. waiting: called every PACK_POLL_S while an epoch is still being planned (the loader's heartbeat
        and stop check: a slow plan is not a stalled loader; planning is finite work over a list, so waiting for it
        counts as progress)."""
        index, epoch = 0, 0
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-pack")
        ahead = pool.submit(self._epoch, 0)  # the next epoch's plan, being made
        try:
            while index < self.max_batches:
                plans = wait_for_result(ahead, waiting)
                batches = len(plans) * self.repeats
                ahead = pool.submit(self._epoch, epoch + 1) if index + batches < self.max_batches else None
                if index + batches <= start:  # whole epoch before the resume point: skip without building batches
                    index += batches
                    epoch += 1
                    continue
                for plan in plans:
                    row = None  # built for the row's first batch this process keeps, shared by its repeats
                    for _ in range(self.repeats):
                        if index >= self.max_batches:
                            return
                        if index >= start and (keep is None or keep(index)):
                            if row is None:
                                row = make_row(self._flat, plan, self.token_budget, self.pad_id)
                            yield make_batch(row, self.num_anchors, self.seed, index, epoch)
                        index += 1
                epoch += 1
        finally:  # a closed iterator leaves no thread behind: it waits for an epoch being planned (bounded work)
            pool.shutdown(wait=True, cancel_futures=True)

    def _epoch(self, epoch: int) -> list[RowPlan]:
        if not self.fixed_rows:
            return epoch_plan(self.flat_samples(), self.token_budget, epoch, self.seed)
        order = self._row_order(epoch)  # makes epoch 0's plan first if needed
        return [self._plans0[i] for i in order]

    def __iter__(self):
        return iter(self.iter_from(0))


SPREAD_BLOCK = 32  # spread_order's block: every 32 consecutive rows of a later epoch span epoch 0's whole order


def spread_order(n: int, block: int, rng: random.Random) -> list[int]:
    """A random permutation of range(n) in which every run of `block` consecutive places (a block) holds one id of
    each of `block` strata, stratum k = the ids in [k n / block, (k+1) n / block): ids, shuffled within their
    stratum, are dealt out one per stratum per block, each block in a random order.

    Why (train.feature_cache_gb): the cache keeps the first rows of epoch 0, ids below some c, and computes the rest
    every epoch. In a plain shuffle the rows past c cluster by chance, and on one shared GPU a 100-step window then
    carries a few more target forwards than the next: the GPU demo of 2026-12-04 (85% of rows kept) read windows
    -4.0% to +3.8% around the median with nothing else in them, what a binomial count of ~15 forwards a window
    (standard deviation ~3.6, each ~10 ms of ~2 s) gives. Here every block holds the same share of ids past any c,
    give or take one, whatever c turns out to be."""
    strata: list[list[int]] = [[] for _ in range(min(block, n))]
    for i in range(n):
        strata[i * len(strata) // n].append(i)
    for ids in strata:
        rng.shuffle(ids)
    order: list[int] = []
    for b in range(max(len(ids) for ids in strata)):
        dealt = [ids[b] for ids in strata if b < len(ids)]
        rng.shuffle(dealt)
        order += dealt
    return order


def wait_for_result(future: Future, waiting: Callable[[], None] | None):
    """future.result(), calling waiting() every PACK_POLL_S until it is done (it may raise to stop waiting)."""
    if waiting is None:
        return future.result()
    while True:
        try:
            return future.result(timeout=PACK_POLL_S)
        except FutureTimeout:
            waiting()
