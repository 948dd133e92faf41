"""The target on a static KV cache: eager prefill, fixed-shape steps (CUDA-graphed on GPU), optional batch rows.

Cache layout: per layer [b, kv_heads, max_len, head_dim], one slot per sequence position (left padding in batches
takes slots too). A step writes its q tokens to explicit slots and a query in slot i sees slot j iff j <= i and j
is not padding. That makes "crop the cache to the accepted length" free: slots past the accepted tokens are never
visible to later queries and the next block overwrites them before it attends. The same runner serves the
speculative verifier (q = B), the plain decoding baseline (q = 1) and batched generation, so every path shares one
harness and one set of kernels.

Grouped-query attention: steps attend with the query heads of each K/V head packed as extra query rows
(inference/attention.py), so a step reads the cache once instead of copying it per query head.

Attention window (`kv_window=W`, batched generation): by default every step attends over all max_len slots, most of
them still empty early in a generation. With a window, a forward whose tokens end at slot e attends over the first
ceil(e / W) * W slots only (prefill: exactly its P slots): the same visible slots, so the same result, at a cost
that follows the sequence instead of the cache size. Each (q, window) step is its own CUDA graph, captured on first
use: up to max_len / W graphs per step length.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ..models.target import TargetInfo, TargetModel
from .attention import restore_sdpa, use_packed_gqa
from ..models.cuda_graph import GraphedStep, resolve_graphs

# model_fn(ids [b, q], pos [b, q], mask [b, 1, q, L], cache_kwargs, keep) -> (logits [b, keep, V], feats or None)
ModelFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class StaticKVCache:
    """A duck-typed HF cache. When the caller passes position ids and a 4D mask, HF decoder layers (transformers
    5.x: Llama, Qwen2/3, Mistral, ...) only ever call `update(k, v, layer_idx, ...)` on it; `slots` ([q] long, on
    the device) says where this forward's q tokens go and is pointed at by the runner before each call."""

    is_compileable = True

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots: torch.Tensor | None = None
        self.visible = max_len  # attention reads slots [0, visible); set by the runner before each forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [b, kv_heads, q, d] -> views [b, kv_heads, visible, d] of the layer's buffers."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, : self.visible], v[:, :, : self.visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never consulted: positions and the mask are always passed explicitly


def cache_kwarg_name(hf) -> str:
    """transformers 5.24 renamed the forward argument `past_key_values` to `cache` (5.17 still has the old name)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _target_fn(target: TargetModel) -> ModelFn:
    def fn(ids, pos, mask, cache_kwargs, keep):
        return target.forward_with_cache(ids, pos, mask, cache_kwargs, keep)
    return fn


def _hf_fn(hf) -> ModelFn:
    def fn(ids, pos, mask, cache_kwargs, keep):
        out = hf(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, logits_to_keep=keep,
                 **cache_kwargs)
        return out.logits, None
    return fn


class TargetRunner:
    """Prefill + fixed-length steps over a static cache of `max_len` slots for `batch_size` rows.

    step_lens: the query lengths that get a static step (1 for decoding, B for verification); each is captured as
    its own CUDA graph when graphs are on (at construction without kv_window; per window on first use with one).
    Outputs of `step` are overwritten by the next call of the same length."""

    def __init__(self, model_fn: ModelFn, hf, max_len: int, batch_size: int = 1, step_lens: tuple[int, ...] = (1,),
                 graphs: bool | None = None, kv_window: int | None = None, packed_gqa: bool = True):
        # Steps read each cached K/V head once instead of a copy per query head (inference/attention.py); off = HF's
        # own SDPA (benchmarks compare both).
        use_packed_gqa(hf) if packed_gqa else restore_sdpa(hf)
        emb = hf.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        self.graphs = resolve_graphs(graphs, self.device)
        info = TargetInfo.from_config(hf.config)
        self.vocab_size = info.vocab_size
        self.model_fn, self.max_len, self.batch_size, self.kv_window = model_fn, max_len, batch_size, kv_window
        self.cache = StaticKVCache(info.num_layers, batch_size, info.num_key_value_heads, max_len, info.head_dim,
                                   self.dtype, self.device)
        self.cache_kwargs = {cache_kwarg_name(hf): self.cache}
        self.kv_idx = torch.arange(max_len, device=self.device)            # [L]
        self.valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=self.device)  # False = left padding
        self.pad_len = torch.zeros(batch_size, dtype=torch.long, device=self.device)       # [b]
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}          # per step length: the static inputs
        self._steps: dict[tuple[int, int], GraphedStep] = {}         # per (step length, visible slots)
        for q in step_lens:
            self._bufs[q] = {"ids": torch.zeros(batch_size, q, dtype=torch.long, device=self.device),
                             "slots": torch.arange(q, device=self.device),
                             "pos": torch.zeros(batch_size, q, dtype=torch.long, device=self.device),
                             "arange": torch.arange(q, device=self.device)}
            if kv_window is None:
                self._graphed_step(q, max_len)

    @classmethod
    def for_target(cls, target: TargetModel, max_len: int, step_lens=(1,), graphs: bool | None = None,
                   batch_size: int = 1):
        """A runner that also returns the tapped features (target loaded with truncate=False): one sequence, or
        batch_size rows (batched speculative decoding, inference/batched.py)."""
        return cls(_target_fn(target), target.hf, max_len, batch_size, tuple(step_lens), graphs)

    @classmethod
    def for_hf(cls, hf, max_len: int, batch_size: int = 1, step_lens=(1,), graphs: bool | None = None,
               kv_window: int | None = None, packed_gqa: bool = True):
        """Logits only, any HF causal LM (batched generation for dataset regeneration)."""
        return cls(_hf_fn(hf.eval()), hf, max_len, batch_size, tuple(step_lens), graphs, kv_window, packed_gqa)

    def _graphed_step(self, q: int, visible: int) -> GraphedStep:
        """The (q, visible) step, captured now if new. Its warm-up runs on what the buffers hold: at construction
        garbage into slots that are overwritten before use, later the real step's own (idempotent) cache writes."""
        run = self._steps.get((q, visible))
        if run is None:
            b = self._bufs[q]
            run = GraphedStep(lambda: self._forward(b["ids"], b["pos"], b["slots"], q, visible), self.graphs)
            self._steps[(q, visible)] = run
        return run

    def _visible(self, end: int) -> int:
        """Slots attention reads for a forward whose tokens end before slot `end`."""
        if self.kv_window is None:
            return self.max_len
        return min(self.max_len, -(-end // self.kv_window) * self.kv_window)

    def _mask(self, slots: torch.Tensor, visible: int) -> torch.Tensor:
        """slots [q] -> bool [b, 1, q, visible]. Every query also sees its own slot, so a padding query never has an
        empty row (softmax over nothing is NaN, and NaN values in the cache would poison real rows through 0 * NaN)."""
        kv_idx = self.kv_idx[:visible]
        causal = kv_idx[None, :] <= slots[:, None]                                          # [q, visible]
        own = kv_idx[None, :] == slots[:, None]
        return ((causal[None] & self.valid[:, None, :visible]) | own[None])[:, None]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, keep: int, visible: int):
        self.cache.slots, self.cache.visible = slots, visible
        return self.model_fn(ids, pos, self._mask(slots, visible), self.cache_kwargs, keep)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, pad_len: list[int] | None = None):
        """ids [b, P] (left-padded by pad_len[r] per row) into slots 0..P-1, eagerly (P varies per prompt).
        -> logits [b, 1, V] of the last slot, feats [b, P, k*H] or None."""
        b, P = ids.shape
        if P > self.max_len:
            raise ValueError(f"prefill of {P} tokens exceeds the cache of {self.max_len} slots")
        pad = torch.tensor(pad_len or [0] * b, dtype=torch.long, device=self.device)
        self.pad_len.copy_(pad)
        self.valid.copy_(self.kv_idx[None, :] >= pad[:, None])
        slots = torch.arange(P, device=self.device)
        pos = (slots[None, :] - pad[:, None]).clamp_(min=0)
        return self._forward(ids.to(self.device), pos, slots, 1, P if self.kv_window else self.max_len)

    @torch.no_grad()
    def hide(self, start: int, q: int, keep: torch.Tensor) -> None:
        """After a step of q tokens at slots start..start+q-1: row r keeps its first keep[r] of them ([b] long, on the
        device) and the rest become holes, never visible again; its later tokens take the positions right after the
        kept ones (the holes count into the row's offset, as left padding does). Rows that accept different numbers
        of drafted tokens thus share one slot counter (inference/batched.py). No host sync."""
        hidden = self.kv_idx[None, start:start + q] >= keep[:, None] + start             # [b, q]
        self.valid[:, start:start + q] &= ~hidden
        self.pad_len += q - keep

    @torch.no_grad()
    def step(self, ids: torch.Tensor, start: int):
        """ids [b, q] (device tensor) into slots start..start+q-1 -> logits [b, q, V], feats [b, q, k*H] or None.
        The outputs are static buffers when graphs are on: the next step of the same length overwrites them."""
        q = ids.shape[-1]
        if start + q > self.max_len:
            raise ValueError(f"step at slots {start}..{start + q - 1} exceeds the cache of {self.max_len} slots")
        bufs = self._bufs[q]
        bufs["ids"].copy_(ids.view(self.batch_size, q))
        torch.add(bufs["arange"], start, out=bufs["slots"])                 # a kernel launch, no host sync
        torch.sub(bufs["slots"][None, :], self.pad_len[:, None], out=bufs["pos"])
        return self._graphed_step(q, self._visible(start + q))()
