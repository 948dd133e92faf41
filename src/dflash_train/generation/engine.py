"""Continuous-batching decoding with any HF causal LM (dataset regeneration): a finished row takes the next request.

Layout: `batch_size` rows over one static KV cache (inference/target_runner.StaticKVCache: per layer
[rows, kv_heads, max_len, head_dim]). A row holds one request at a time, at its own length: the prompt in slots
0..P-1, its i-th generated token fed at slot P+i, position id = slot (no left padding). A step feeds one token per
row at that row's own slot and row r attends to the slots <= pos[r]. Slots past a row's position hold what its
previous request or the prefill's padding left there: never visible, and overwritten before they become visible.

Cost of a step, the KV read: attention reads the first `visible` slots of every stepped row, visible = the longest
live row rounded up to WINDOW slots, and the stepped rows are the first `bucket` ones (the highest occupied row
rounded up to a power of two; requests go to the lowest free rows, so only a run's tail steps a smaller bucket).
Each (bucket, visible, sampled) step is one CUDA graph on GPU, captured on first use into one shared memory pool.
That is `decode_attention="mask"` (cuDNN's masked SDPA; the default on CPU). On CUDA the default is "flex": every row
steps and reads only its own 128-slot tiles (flex attention with a BlockMask of per-row tile counts built on the
device, none for an ended row; inference/attention.RowLengthMask), one graph per `sampled`. On an H200 it read
1.24-1.39x the K/V the rows need instead of 2.5-2.95x and ran 1.15-1.43x the masked engine's tokens/s; a flex step
that fails to build falls back to the masked one with a warning. The query heads of a K/V head enter flex as rows of
that head (q_rows = H / H_kv): torch takes grouped heads into its decoding kernel only at a power-of-two ratio
(SmolLM2 has 9 on 3), and rows need no grouping; in the demo of 2026-12-04 the answers to self-written prompts went
from 99.7k to 156.7k generated tokens/s with it (docs/BENCHMARKS.md, "Regeneration engine").

Refill: a row that ends (a stop token, kept, or its own max_new_tokens) stays frozen on the device (it rewrites its
last slot, its count stops) until the host looks, every CHECK_EVERY steps: one host sync reads which rows ended and
their tokens, the free rows are refilled at once (follow-ups first, then requests pulled ahead), the next steps are
queued, and only then, while the device runs them, the host hands the ended requests to `on_done` (which may
submit follow-ups: the next turn of a conversation, taken at the next refill) and pulls the next requests (chat
templates, tokenizing). Why not every step: a sync per step idles the GPU while the host reads the flags and
launches the next step; CHECK_EVERY = 8 costs a finished row at most 7 frozen steps (~1.4% of a 256-token reply on
average) and removes 7 of every 8 syncs. The host never needs the rows' positions: it bounds them by prompt + steps
taken.

Prefill: the refilled rows in chunks of similar prompt lengths, each one forward of a bucketed shape (rows rounded up
to a power of two, the padding rows writing to a spare cache row that no step reads; slots rounded up to a power of
two, at least MIN_PREFILL_SLOTS, right padding; at most PREFILL_TOKENS tokens), one CUDA graph per (rows, slots,
sampled) on GPU, fed through static inputs. A forward writes only its rows' slots 0..P-1 and attends over its own
prompt (plain causal attention: right padding needs no mask). Eager, SmolLM2's 30-layer prefill cost the host
40-55 ms of launches whatever its size (docs/BENCHMARKS.md, "Regeneration engine"); a graph is one launch.
With overlap_prefill (the default) a check queues the next steps of the rows still live first and the refill's
prefill behind them, so that the host's work overlaps the device's steps; a refilled row then joins at the next
check. Measured on an H200 with the eager prefill: 1.4-1.6x the generated tokens/s of refilling before the steps.

Sampling on the device: argmax at temperature 0; otherwise inverse-CDF sampling of softmax(logits / T) with the
uniform of token i of a request drawn from a counter-based hash of (request seed, i) in torch integer ops, so a
sampled answer depends on its seed only, not on the row, the batch or what ran beside it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import torch

from ..inference.attention import SDPA_NAMES, RowLengthMask, restore_sdpa, use_packed_gqa, use_row_length_flex
from ..models.cuda_graph import GraphedStep, resolve_graphs
from ..inference.decoding import device_sync
from ..inference.target_runner import StaticKVCache, cache_kwarg_name
from ..models.target import TargetInfo

log = logging.getLogger("dflash_train")

CHECK_EVERY = 8          # decoding steps between host checks for ended rows (see the module docstring)
WINDOW = 128             # attention reads the longest live row's slots rounded up to this (one graph per window)
PREFILL_TOKENS = 1 << 15  # padded prompt tokens per prefill forward (its [n, 1, P, P] mask and activations)
MIN_PREFILL_SLOTS = 16   # the smallest slot bucket of a prefill forward (prompt lengths round up to a power of two)
# The largest batch `--batch-size auto` picks: measured on an H200 with SmolLM2's shape (docs/BENCHMARKS.md,
# "Regeneration engine"), the flex engine at 1,536 rows made 1.17-1.19x the generated tokens/s of 768 rows.
MAX_AUTO_BATCH = 1536
CPU_BATCH = 8            # `--batch-size auto` on a CPU
# How a decoding step attends: "mask" (every stepped row reads the first `visible` slots, cuDNN's masked SDPA) or
# "flex" (each row reads its own 128-slot tiles; inference/attention.RowLengthMask); None = flex on CUDA, mask
# elsewhere. Measured on an H200 (docs/BENCHMARKS.md, "Regeneration engine"): flex reads 1.24-1.39x the K/V the rows
# need instead of 2.5-2.95x and, autotuned, ran the engine at 1.15-1.43x the tokens/s of the masked step.
DECODE_ATTENTION = ("mask", "flex")

_M32 = 0xFFFFFFFF


@dataclass
class Request:
    key: Any                  # the caller's handle (returned with the tokens)
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0             # sampled tokens depend on (seed, token index) only


@dataclass
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    steps: int = 0            # decoding steps
    row_steps: int = 0        # steps x rows stepped (the bucket): what the generated tokens cost
    prefill_tokens: int = 0   # prompt tokens prefilled
    prefill_padded: int = 0   # tokens the prefill forwards computed (right padding included)
    kv_slots_read: int = 0    # sum over steps of rows x visible slots: the KV the steps' attention read
    kv_slots_needed: int = 0  # sum over decoded tokens of their own context: what reading only each row's slots costs
    seconds: float = 0.0

    def add(self, other: "EngineStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values < 2^32 (odd multipliers < 2^31: no int64 overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def seeded_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """seed [n] int64 (any value), index [n] int64 -> uniforms [n] float32 in (0, 1): a pure function of both."""
    h = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ _mix32(index & _M32)))
    h = _mix32(h ^ 0x5BD1E995)
    return ((h >> 8).float() + 0.5) / float(1 << 24)


def pick_seeded(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, index: torch.Tensor,
                sampled: bool) -> torch.Tensor:
    """logits [n, V], temperature [n] (0 = greedy), seed/index [n] -> tokens [n], on the device, no host sync."""
    greedy = logits.argmax(dim=-1)
    if not sampled:
        return greedy
    probs = torch.softmax(logits.float() / temperature.clamp(min=1e-5)[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)                                                       # [n, V]
    u = seeded_uniform(seed, index) * cdf[:, -1]
    tok = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    return torch.where(temperature > 0, tok, greedy)


class RowKVCache(StaticKVCache):
    """StaticKVCache for per-row lengths: a decoding step writes row r's token at slot pos[r], over the first `rows`
    rows of the buffers; the runner's version writes one shared slot for every row."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = self.keys[0].shape[0]
        self.pos: torch.Tensor | None = None  # [rows] long: the slot of each row's token

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [rows, kv_heads, 1, d] -> views [rows, kv_heads, visible, d] of the layer's buffers."""
        k, v = self.keys[layer_idx][: self.rows], self.values[layer_idx][: self.rows]
        idx = self.pos.view(-1, 1, 1, 1).expand_as(key_states)
        k.scatter_(2, idx, key_states.to(k.dtype))
        v.scatter_(2, idx, value_states.to(v.dtype))
        return k[:, :, : self.visible], v[:, :, : self.visible]


class _PrefillWriter:
    """Duck-typed HF cache for one prefill forward: writes rows `rows` [n], slots 0..P-1, of the engine's cache and
    lets the forward attend over its own prompt only (a refilled row's earlier slots are stale)."""

    is_compileable = False

    def __init__(self, cache: StaticKVCache, rows: torch.Tensor):
        self.cache, self.rows = cache, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [n, kv_heads, P, d] -> the same (attention over the prompt itself)."""
        P = key_states.shape[2]
        for buf, new in ((self.cache.keys[layer_idx], key_states), (self.cache.values[layer_idx], value_states)):
            buf[:, :, :P].index_copy_(0, self.rows, new.to(buf.dtype))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclass
class _PrefillInputs:
    """The static inputs of one prefill shape (its CUDA graph reads them): ids [nb, P]; rows, lens, temp, seed,
    limit [nb]."""
    ids: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    temp: torch.Tensor
    seed: torch.Tensor
    limit: torch.Tensor

    @classmethod
    def empty(cls, nb: int, P: int, device: torch.device) -> "_PrefillInputs":
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(z(nb, P), z(nb), z(nb), z(nb, dtype=torch.float32), z(nb), z(nb))

    def fill(self, ids: torch.Tensor, **rows: list) -> None:
        """Copy host values in, queued on the stream from pinned memory on CUDA: a copy from pageable memory would
        first wait for every step already queued (and undo overlap_prefill)."""
        pin = self.ids.device.type == "cuda"
        hosts = [("ids", ids)] + [(k, torch.tensor(v, dtype=getattr(self, k).dtype)) for k, v in rows.items()]
        for name, host in hosts:
            getattr(self, name).copy_(host.pin_memory() if pin else host, non_blocking=pin)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class Engine:
    """Continuous batching over `batch_size` rows of `max_len` slots; every request needs prompt + max_new_tokens
    <= max_len. stop_ids end a reply (the stop token is kept). graphs None = CUDA graphs on CUDA devices.
    One engine per thread (its cache and state are its own); `run` may be called again after it returns."""

    def __init__(self, hf, batch_size: int, max_len: int, stop_ids=(), graphs: bool | None = None,
                 window: int = WINDOW, check_every: int = CHECK_EVERY, prefill_tokens: int = PREFILL_TOKENS,
                 packed_gqa: bool = True, pad_id: int = 0, overlap_prefill: bool = True,
                 prefill_graphs: bool | None = None, decode_attention: str | None = None):
        if batch_size < 1 or max_len < 2 or window < 1 or check_every < 1:
            raise ValueError(f"bad engine shape: batch_size={batch_size}, max_len={max_len}, window={window}, "
                             f"check_every={check_every}")
        if decode_attention is not None and decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r}: pick one of {', '.join(DECODE_ATTENTION)} "
                             "(or None: flex on CUDA)")
        emb = hf.get_input_embeddings().weight
        on_sdpa = getattr(hf.config, "_attn_implementation", None) in SDPA_NAMES
        # None takes flex only where it can (a model on another attention keeps its masked step)
        self.flex = decode_attention == "flex" or (decode_attention is None and emb.device.type == "cuda"
                                                   and packed_gqa and on_sdpa)
        # On packed GQA (and flex, whose prefill goes to it) the prefill passes no mask (causal SDPA, see
        # _prefill_device); other attentions get a 4D one.
        if self.flex:
            if not use_row_length_flex(hf):
                raise ValueError(f"decode_attention='flex' needs a model on 'sdpa' attention, not "
                                 f"{hf.config._attn_implementation!r}: load it with attn_implementation='sdpa'")
            self._causal_prefill = True
        elif packed_gqa:
            self._causal_prefill = use_packed_gqa(hf)
        else:
            restore_sdpa(hf)
            self._causal_prefill = False
        self.hf = hf.eval()
        self.base, self.head = getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()
        self.device = dev = emb.device
        self.graphs = resolve_graphs(graphs, dev)
        self.prefill_graphs = self.graphs if prefill_graphs is None else resolve_graphs(prefill_graphs, dev)
        info = TargetInfo.from_config(hf.config)
        self.b, self.max_len, self.window, self.check_every = batch_size, max_len, window, check_every
        self.prefill_tokens, self.pad_id, self.overlap_prefill = prefill_tokens, pad_id, overlap_prefill
        # One row more than the batch: the spare row, where a prefill's padding rows (up to its row bucket) write.
        # Decoding steps never reach it (they step rows [0, bucket), bucket <= batch_size).
        self.spare = batch_size
        self.cache = RowKVCache(info.num_layers, batch_size + 1, info.num_key_value_heads, max_len, info.head_dim,
                                emb.dtype, dev)
        self._step_kwarg = cache_kwarg_name(hf)
        self._prefill_kwarg = cache_kwarg_name(self.base)
        b = batch_size + 1  # the spare row included
        # Per-row device state ([b] each; out [b, max_len]). Ended, empty and spare rows have finished = True.
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)       # the token fed next
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)       # its slot (= its position id)
        self.count = torch.zeros(b, dtype=torch.long, device=dev)     # tokens generated so far
        self.limit = torch.ones(b, dtype=torch.long, device=dev)      # the request's max_new_tokens
        self.finished = torch.ones(b, dtype=torch.bool, device=dev)
        self.temp = torch.zeros(b, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(b, dtype=torch.long, device=dev)
        self.out = torch.zeros(b, max_len, dtype=torch.long, device=dev)  # generated tokens per row
        self.stop_ids = torch.tensor(sorted({int(t) for t in stop_ids}), dtype=torch.long, device=dev)
        self.kv_idx = torch.arange(max_len, device=dev)
        # the query heads of a K/V head as rows of that head (inference/attention.row_length_attention)
        self._rows_mask = (RowLengthMask(self.pos, self.finished, max_len,
                                         q_rows=info.num_attention_heads // info.num_key_value_heads)
                           if self.flex else None)
        # Host state per row: the request, its prompt length, its last possible slot, the step it was prefilled at.
        b = batch_size  # the host tracks the real rows only
        self._req: list[Request | None] = [None] * b
        self._plen, self._cap, self._since = [0] * b, [0] * b, [0] * b
        self._queue: deque[Request] = deque()  # submitted follow-ups
        self._ready: deque[Request] = deque()  # pulled from the run's iterator ahead of need
        self._steps: dict[tuple[int, int, bool], GraphedStep] = {}
        self._prefills: dict[tuple[int, int, bool], tuple[_PrefillInputs, GraphedStep]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._t = 0  # steps taken by this engine

    def fits(self, hf, batch_size: int, max_len: int, stop_ids, pad_id: int) -> bool:
        """Whether this engine serves what Engine(hf, batch_size, max_len, stop_ids, pad_id=pad_id) would, so that a
        later pass may reuse it (the stop ids are captured in its graphs)."""
        return (self.hf is hf and (self.b, self.max_len, self.pad_id) == (batch_size, max_len, pad_id)
                and self.stop_ids.tolist() == sorted({int(t) for t in stop_ids}))

    def submit(self, request: Request) -> None:
        """Queue a request ahead of the run's iterator (on_done's follow-ups: the next turn is due now)."""
        self._queue.append(request)

    @torch.no_grad()
    def run(self, requests: Iterable[Request], on_done: Callable[[Request, list[int]], None],
            stop=None) -> EngineStats:
        """Decode every request of `requests` (pulled lazily, at most batch_size ahead of the free rows) and of
        submit(); on_done(request, tokens) for each after it ends (at the first check that sees it ended, once
        the next steps are queued: see the module docstring). A set `stop` (anything with is_set(), e.g. a
        threading.Event) ends the run at the next check: the requests that ended get
        on_done, those in flight or pulled ahead are dropped."""
        stats = EngineStats()
        source = iter(requests)
        ended: list[tuple[Request, list[int]]] = []
        device_sync(self.device)
        t0 = time.perf_counter()
        try:
            while True:
                if not self.overlap_prefill:
                    self._refill(source, stats)
                occupied = [r for r in range(self.b) if self._req[r] is not None]
                if occupied:
                    self._launch(occupied, stats)
                if self.overlap_prefill:  # queued behind the steps: its launches overlap them
                    self._refill(source, stats)
                # Host work while the device runs the steps just queued: the previous check's ended requests
                # (their follow-ups join the next refill) and the requests that refill will take.
                for req, tokens in ended:
                    on_done(req, tokens)
                self._prefetch(source)
                if all(r is None for r in self._req) and not self._queue and not self._ready:
                    break
                ended = self._collect(stats)
                if stop is not None and stop.is_set():
                    for req, tokens in ended:  # finished: worth handing over
                        on_done(req, tokens)
                    break
        finally:
            self._reset()
        device_sync(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    # ------------------------------------------------------------------------------------------ host side

    def _launch(self, occupied: list[int], stats: EngineStats) -> None:
        """Queue check_every steps of the rows up to the highest occupied one (no host sync); with flex, of every
        row (one graph per `sampled`: an empty or ended row reads no slot)."""
        sampled = any(self._req[r].temperature > 0 for r in occupied)
        if self.flex:
            self._build_flex_step(sampled)
        bucket = self.b if self.flex else min(self.b, 1 << (max(occupied)).bit_length())
        # Slot bounds: a live row advances one slot a step up to its cap; an ended one stays put.
        start = [(self._plen[r] + self._t - self._since[r], self._cap[r]) for r in occupied]
        reach, cap = max(min(p, c) for p, c in start), max(c for _, c in start)
        for j in range(self.check_every):
            if self.flex:
                self._graphed(bucket, self.max_len, sampled)()
                stats.kv_slots_read += self._rows_mask.slots_read([min(p + j, c) for p, c in start])
            else:
                visible = min(self.max_len, -(-(min(reach + j, cap) + 1) // self.window) * self.window)
                self._graphed(bucket, visible, sampled)()
                stats.kv_slots_read += bucket * visible
            self._t += 1
        stats.steps += self.check_every
        stats.row_steps += self.check_every * bucket

    def _build_flex_step(self, sampled: bool) -> None:
        """Build (once) the flex step; if compiling or capturing it fails, decode with the masked step from now on
        (the same tokens, slower) and say so once."""
        try:
            self._graphed(self.b, self.max_len, sampled)
        except Exception as e:  # noqa: BLE001 - any build failure has the same remedy
            self.flex = False
            log.warning(f"regeneration: the flex decoding step failed to build ({type(e).__name__}: "
                        f"{str(e)[:200]}); decoding with the masked step from now on (slower, same tokens)")

    def _prefetch(self, source) -> None:
        """Pull up to batch_size requests ahead, so that building them (chat templates, tokenizing) overlaps the
        device's steps instead of holding up the next refill."""
        while len(self._ready) < self.b:
            req = next(source, None)
            if req is None:
                return
            self._ready.append(req)

    def _collect(self, stats: EngineStats) -> list[tuple[Request, list[int]]]:
        """Free the ended rows -> their (request, tokens)."""
        occupied = [r for r in range(self.b) if self._req[r] is not None]
        if not occupied:
            return []
        finished, count = torch.stack([self.finished.long(), self.count]).tolist()  # host sync, once per check
        rows = [r for r in occupied if finished[r]]
        if not rows:
            return []
        n = max(count[r] for r in rows)
        ended = []
        tokens = self.out[torch.tensor(rows, device=self.device), :n].tolist()
        for r, toks in zip(rows, tokens):
            req, self._req[r] = self._req[r], None
            out = toks[: count[r]]
            stats.requests += 1
            stats.generated_tokens += len(out)
            steps, P = len(out) - 1, self._plen[r]  # the first token came from the prefill
            stats.kv_slots_needed += steps * (P + 1) + steps * (steps - 1) // 2
            ended.append((req, out))
        return ended

    def _refill(self, source, stats: EngineStats) -> None:
        """Prefill the next requests (follow-ups first, then prefetched ones) into the free rows, lowest first."""
        free = [r for r in range(self.b) if self._req[r] is None]
        new: list[Request] = []
        while len(new) < len(free):
            req = (self._queue.popleft() if self._queue else self._ready.popleft() if self._ready
                   else next(source, None))
            if req is None:
                break
            P = len(req.prompt_ids)
            if P == 0 or req.max_new_tokens < 1 or P + req.max_new_tokens > self.max_len:
                raise ValueError(f"request {req.key!r}: prompt of {P} tokens + {req.max_new_tokens} new tokens "
                                 f"does not fit the engine's {self.max_len} slots (or is empty)")
            new.append(req)
        # Chunks of similar prompt lengths pad less; the row a request gets does not matter.
        new.sort(key=lambda r: len(r.prompt_ids))
        start = 0
        while start < len(new):  # chunks of at most prefill_tokens bucketed tokens (always at least one request)
            end, longest = start + 1, len(new[start].prompt_ids)
            while end < len(new) and (_pow2(end + 1 - start) * self._slots(max(longest, len(new[end].prompt_ids)))
                                      <= self.prefill_tokens):
                longest = max(longest, len(new[end].prompt_ids))
                end += 1
            self._prefill(free[start:end], new[start:end], stats)
            start = end

    def _slots(self, prompt_len: int) -> int:
        """The prefill's slot bucket for prompts of up to prompt_len tokens: a power of two (at least
        MIN_PREFILL_SLOTS), capped at the cache's max_len."""
        return min(self.max_len, max(MIN_PREFILL_SLOTS, _pow2(prompt_len)))

    def _prefill(self, rows: list[int], reqs: list[Request], stats: EngineStats) -> None:
        """Prefill reqs into rows and set each row's first token and state: one forward of the (row bucket, slot
        bucket, sampled) shape, a CUDA graph on GPU, fed through its static inputs (padding rows go to the spare
        row, right padding to the slot bucket)."""
        n, lens = len(reqs), [len(r.prompt_ids) for r in reqs]
        nb, P = _pow2(n), self._slots(max(lens))
        sampled = any(r.temperature > 0 for r in reqs)
        key = (nb, P, sampled)
        inputs = self._prefills[key][0] if key in self._prefills else _PrefillInputs.empty(nb, P, self.device)
        ids = torch.full((nb, P), self.pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = torch.as_tensor(r.prompt_ids, dtype=torch.long)
        pad = nb - n
        inputs.fill(ids=ids, rows=rows + [self.spare] * pad, lens=lens + [1] * pad,
                    temp=[float(r.temperature) for r in reqs] + [0.0] * pad,
                    seed=[_seed64(r.seed) for r in reqs] + [0] * pad,
                    limit=[r.max_new_tokens for r in reqs] + [1] * pad)
        if key not in self._prefills:
            # The warm-up before the capture runs the prefill for real: harmless, it is idempotent (it writes the
            # same slots and state as the replay that follows).
            fn = lambda: self._prefill_device(inputs, sampled)  # noqa: E731
            self._prefills[key] = (inputs, self._prefill_step(fn))
        self._prefills[key][1]()
        for r, req, L in zip(rows, reqs, lens):
            self._req[r], self._plen[r], self._cap[r], self._since[r] = req, L, L + req.max_new_tokens - 1, self._t
        stats.prefill_tokens += sum(lens)
        stats.prefill_padded += nb * P

    def _prefill_step(self, fn) -> GraphedStep:
        """fn as a CUDA graph, or eager when prefill graphs are off, or when a capture fails (a model whose forward
        a graph cannot hold): the prefill then runs eagerly, slower but the same, and the log says so once."""
        if self.prefill_graphs:
            try:
                return GraphedStep(fn, True, pool=self._pool)
            except RuntimeError as e:
                self.prefill_graphs = False
                log.warning(f"regeneration: the prefill could not be captured as a CUDA graph ({str(e)[:200]}); it "
                            "runs eagerly from now on (slower, same tokens)")
        return GraphedStep(fn, False)

    def _prefill_device(self, x: "_PrefillInputs", sampled: bool) -> None:
        """The prefill forward over x's static inputs. Capturable: device ops only."""
        nb, P = x.ids.shape
        kv = self.kv_idx[:P]
        pos = kv[None, :].expand(nb, P)
        if self._causal_prefill:
            # Right padding: plain causal attention already hides every row's padding keys from its real tokens
            # (they come after them), and what the padding queries compute is never read. No mask lets SDPA take
            # its fused causal kernel instead of a masked one over [n, heads, P, P].
            mask = None
        else:  # [n, 1, P, P]: causal within the prompt, padding keys hidden (a padding query still sees slot 0)
            mask = ((kv[None, :] <= kv[:, None])[None] & (kv[None, :] < x.lens[:, None])[:, None, :])[:, None]
        hidden = self.base(input_ids=x.ids, position_ids=pos, attention_mask=mask, use_cache=True,
                           **{self._prefill_kwarg: _PrefillWriter(self.cache, x.rows)}).last_hidden_state
        logits = self.head(hidden[torch.arange(nb, device=hidden.device), x.lens - 1])        # [nb, V]
        first = pick_seeded(logits, x.temp, x.seed, torch.zeros_like(x.lens), sampled)
        rows = x.rows
        self.tok[rows] = first
        self.pos[rows] = x.lens
        self.count.index_fill_(0, rows, 1)  # not count[rows] = 1: that copies a host scalar, which no graph holds
        self.limit[rows] = x.limit
        self.temp[rows], self.seed[rows] = x.temp, x.seed
        self.out[rows, 0] = first
        self.finished[rows] = (first[:, None] == self.stop_ids[None, :]).any(-1) | (x.limit <= 1)

    def _reset(self) -> None:
        """Drop whatever is in flight (a stop, an error): the engine is ready for the next run."""
        self._req = [None] * self.b
        self._queue.clear()
        self._ready.clear()
        self.finished.fill_(True)

    # ------------------------------------------------------------------------------------------ device side

    def _decode(self, bucket: int, visible: int, sampled: bool) -> None:
        """One step of rows [0, bucket): feed each row's token at its slot, pick the next, advance the live rows.
        Capturable: device ops only, on buffers whose addresses never change."""
        pos, tok, count = self.pos[:bucket], self.tok[:bucket], self.count[:bucket]
        finished = self.finished[:bucket]
        self.cache.rows, self.cache.pos, self.cache.visible = bucket, pos, visible
        if self.flex:  # a BlockMask [bucket, 1, q_rows, max_len] of per-row tile counts (visible == max_len)
            mask = self._rows_mask.block_mask(bucket)
        else:
            mask = (self.kv_idx[:visible][None, :] <= pos[:, None])[:, None, None, :]         # [bucket, 1, 1, vis]
        logits = self.hf(input_ids=tok[:, None], position_ids=pos[:, None], attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{self._step_kwarg: self.cache}).logits[:, -1]   # [bucket, V]
        live = ~finished
        new = torch.where(live, pick_seeded(logits, self.temp[:bucket], self.seed[:bucket], count, sampled), tok)
        self.out[:bucket].scatter_(1, count[:, None], new[:, None])  # an ended row writes past its end: never read
        tok.copy_(new)
        step = live.long()
        pos.add_(step)
        count.add_(step)
        ended = (new[:, None] == self.stop_ids[None, :]).any(-1) | (count >= self.limit[:bucket])
        finished.logical_or_(live & ended)

    def _graphed(self, bucket: int, visible: int, sampled: bool) -> GraphedStep:
        key = (bucket, visible, sampled)
        step = self._steps.get(key)
        if step is None:
            fn = lambda: self._decode(bucket, visible, sampled)  # noqa: E731
            # Warm-up runs the step for real (twice) before the capture: put the row state back afterwards. The
            # cache slots it wrote are rewritten by the real step (the same token at the same slot) or never seen.
            state = [t.clone() for t in (self.tok, self.pos, self.count, self.finished, self.out)] if self.graphs \
                else None
            try:
                step = GraphedStep(fn, self.graphs, pool=self._pool)
            finally:  # also when the capture fails (the caller may fall back to another step)
                if state is not None:
                    for t, saved in zip((self.tok, self.pos, self.count, self.finished, self.out), state):
                        t.copy_(saved)
            self._steps[key] = step
        return step


def _seed64(seed: int) -> int:
    """Any Python int -> a non-negative int64 (the device hash takes the rest)."""
    return int(seed) & ((1 << 63) - 1)


def auto_batch_size(kv_bytes_per_token: int, max_length: int, free_bytes: int | None) -> int:
    """`--batch-size auto`: the batch whose full KV caches (max_length slots per row) fill half the free memory
    (the other half: the prefill's activations and masks, which grow with batch x prompt length), rounded down to
    a multiple of 64 rows, between 1 and MAX_AUTO_BATCH. free_bytes None (CPU): CPU_BATCH."""
    if free_bytes is None:
        return CPU_BATCH
    rows = free_bytes // 2 // max(1, kv_bytes_per_token * max_length)
    return int(max(1, min(MAX_AUTO_BATCH, rows // 64 * 64 if rows >= 64 else rows)))


def batch_size_for(models, max_length: int) -> int:
    """auto_batch_size for the tightest of the models' devices (their KV bytes per token and free memory)."""
    sizes = []
    for hf in models:
        info = TargetInfo.from_config(hf.config)
        weight = hf.get_input_embeddings().weight
        kv = 2 * info.num_layers * info.num_key_value_heads * info.head_dim * weight.element_size()
        free = torch.cuda.mem_get_info(weight.device)[0] if weight.device.type == "cuda" else None
        sizes.append(auto_batch_size(kv, max_length, free))
    return min(sizes)
