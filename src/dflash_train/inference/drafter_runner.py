"""The drafter at inference: its own static cache of context K/V, one (CUDA-graphed) forward per block.

Context = target features of every token whose features are known (positions 0..start-1); the block is
[last token, MASK x (B-1)] at positions start..start+B-1 and attends to all cached context plus its whole block
(bidirectional). Per layer the context keys/values live in [max_len, kv_heads, head_dim] buffers indexed by
position; block keys are never cached.

New context arrives as the B feature rows of the last verification pass (`extend`). Only the rows of accepted
tokens are real context; the others sit at positions >= start, are masked out, and the next `extend` overwrites
them. Appending all B rows keeps the step's shapes fixed (one CUDA graph) and needs no host sync to slice them.
The append runs inside the next `draft` call, so a decoding step is exactly one drafter launch.

Any object with `block_size`, `begin`, `extend` and `draft` can stand in for the drafter in the speculative loop
(the tests use an oracle that copies the target's own continuation).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..models.drafter import DFlashDrafter, RotaryEmbedding
from ..models.target import TargetModel
from ..training.objective import sdpa_attend
from ..models.cuda_graph import GraphedStep, resolve_graphs


def serving_copy(drafter: DFlashDrafter, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """A private copy in the target's dtype (as serving engines run it), for inference; the caller's drafter stays
    untouched. RoPE frequencies stay fp32: .to(bf16) would round them and shift every rotary angle."""
    cfg = drafter.config
    copied = copy.deepcopy(drafter).to(device, dtype).eval().requires_grad_(False)
    copied.rotary.inv_freq = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).inv_freq.to(device)
    return copied


class DrafterRunner:
    def __init__(self, drafter: DFlashDrafter, target: TargetModel, max_len: int, block_size: int | None = None,
                 graphs: bool | None = None):
        cfg = drafter.config
        self.block_size = B = block_size or cfg.block_size
        if B < 2:
            raise ValueError("block_size must be at least 2")
        self.device, self.dtype = target.device, target.embed_tokens.weight.dtype
        self.max_len = max_len
        self.drafter = serving_copy(drafter, self.device, self.dtype)
        self.embed_w = target.embed_tokens.weight
        self.lm_head = target.lm_head
        self.mask_token_id = cfg.mask_token_id
        kv = (max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.ctx_k = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        self.ctx_v = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        dev = dict(device=self.device)
        self.kv_idx = torch.arange(max_len, **dev)
        self.arange_b = torch.arange(B, **dev)
        self.block_visible = torch.ones(B, dtype=torch.bool, **dev)
        # Static inputs of the graphed step.
        self.pend_feats = torch.zeros(B, cfg.num_feature_layers * cfg.hidden_size, dtype=self.dtype, **dev)
        self.pend_pos = torch.arange(B, **dev)                            # positions of the pending rows
        self.ctx_len = torch.zeros((), dtype=torch.long, **dev)           # context positions < ctx_len are real
        self.block_ids = torch.full((B,), cfg.mask_token_id, dtype=torch.long, **dev)
        self.block_pos = torch.arange(B, **dev)
        self._step = GraphedStep(self._append_and_draft, resolve_graphs(graphs, self.device))

    def _write_context(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """feats [n, k*H] at positions pos [n] -> the per-layer context K/V buffers."""
        for (k, v), K, V in zip(self.drafter.context_kv(feats, pos), self.ctx_k, self.ctx_v):
            K.index_copy_(0, pos, k.to(K.dtype))
            V.index_copy_(0, pos, v.to(V.dtype))

    def _block_hidden(self) -> torch.Tensor:
        """Append pending context rows, run the block -> hidden [B, H]."""
        self._write_context(self.pend_feats, self.pend_pos)
        visible = torch.cat([self.kv_idx < self.ctx_len, self.block_visible])          # [L + B]
        mask = visible[None, :].expand(self.block_size, -1)                            # [B, L + B]
        x = F.embedding(self.block_ids, self.embed_w)                                  # [B, H]
        return self.drafter.forward_blocks(x, self.block_pos, list(zip(self.ctx_k, self.ctx_v)), sdpa_attend(mask),
                                           self.block_size)

    def _append_and_draft(self):
        """The captured step -> draft logits [B-1, V]."""
        return self.lm_head(self._block_hidden()[1:])

    @torch.no_grad()
    def begin(self, prompt_feats: torch.Tensor) -> None:
        """A new sequence whose context is the prompt: feats [P, k*H] at positions 0..P-1 (eager: P varies)."""
        P = prompt_feats.shape[0]
        if P + self.block_size > self.max_len:
            raise ValueError(f"prompt of {P} tokens leaves no room for a block in {self.max_len} slots")
        self._write_context(prompt_feats.to(self.dtype), torch.arange(P, device=self.device))
        self.pend_pos.copy_(self.arange_b + P)  # nothing pending: the step rewrites masked slots P..P+B-1

    @torch.no_grad()
    def extend(self, block_feats: torch.Tensor, block_start: int) -> None:
        """Features [B, k*H] of the last verified block at positions block_start.. (only accepted rows count)."""
        self.pend_feats.copy_(block_feats)
        torch.add(self.arange_b, block_start, out=self.pend_pos)

    @torch.no_grad()
    def draft(self, last_token: torch.Tensor, start: int) -> torch.Tensor:
        """last_token: [1] on the device, at position `start`; context = positions 0..start-1.
        -> draft logits [B-1, V] for positions start+1..start+B-1 (overwritten by the next call)."""
        if start + self.block_size > self.max_len:
            raise ValueError(f"block at {start} exceeds the drafter cache of {self.max_len} slots")
        self.block_ids[:1].copy_(last_token)
        torch.add(self.arange_b, start, out=self.block_pos)
        self.ctx_len.fill_(start)
        return self._step()


class Drafter2Runner(DrafterRunner):
    """A DFlash 2 drafter (models/drafter2.py): the captured step also returns the hidden states, and the candidate
    selector picks the drafts left to right after it (B-1 small eager steps; at temperature T > 0 each pick is a
    sample of the selector's softmax over its candidates)."""

    def _append_and_draft(self):
        """The captured step -> (hidden [B-1, H], logits [B-1, V]) of block positions 1..B-1."""
        h = self._block_hidden()[1:]
        return h, self.lm_head(h)

    @torch.no_grad()
    def propose(self, last_token: torch.Tensor, start: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (drafts [B-1], q [B-1, V] fp32 or None at temperature 0): q_k is the selector's distribution over its
        candidates given drafts 1..k-1, zero elsewhere, which is what speculative sampling needs (speculative.py)."""
        h, logits = self.draft(last_token, start)
        drafts, candidates, q = self.drafter.candidate_selector.select(h, logits, last_token, temperature, generator)
        if q is None:
            return drafts, None
        return drafts, torch.zeros(logits.shape, dtype=q.dtype, device=q.device).scatter_(1, candidates, q)
