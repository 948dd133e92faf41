"""Lossless greedy speculative decoding of many prompts at once: the evaluator's acceptance on its untimed prompts.

One prompt at a time (speculative.py) a small target spends its steps launching kernels: the GPU demo decoded its
80 + 32 prompts x 256 tokens in 77 s on an H100, most of its 84-second evaluation. Prompts decoded as rows of one
batch share every launch. Each row takes exactly speculative.py's greedy steps: the drafter proposes B-1 tokens
after the row's last token, the target verifies the block in one pass, the row keeps the longest agreeing prefix plus
the target's own next token. Only the caches' bookkeeping differs, because rows keep different numbers of tokens:

- target (TargetRunner with rows): a step writes its B tokens into the same B slots of every row; a row that kept n
  of them turns the other B - n into holes, never visible again, and counts them into its position offset
  (TargetRunner.hide), so its next token sits at the position right after its kept ones. The slots advance by B a
  step whatever is kept: the cache is sized for the longest prompt + B x (max_new_tokens + 1) slots.
- drafter (BatchedDrafterRunner): each row's context K/V by position, as DrafterRunner keeps one sequence's; a
  row's block sees its own context below its own length, and its own block.

A row that is done (max_new_tokens, or a stop token) keeps none of its later blocks: its positions stop moving and
its outputs are dropped until every row is done. Greedy only (sampling would need each row's own random draws):
evaluate decodes sampled prompts one at a time. DFlash 2 drafters too: the selector walks every row's block left
to right at once (CandidateSelector.select_greedy_rows). There are no per-prompt timings here; the
evaluator times speculative decoding one prompt at a time, on the prompts it also times plain decoding on.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..devices import cuda_memory_available
from ..models.cuda_graph import GraphedStep, resolve_graphs
from ..models.drafter import DFlashDrafter
from ..models.drafter2 import DFlash2Drafter
from ..models.target import TargetModel
from .decoding import TokenSink
from .drafter_runner import serving_copy
from .target_runner import TargetRunner

log = logging.getLogger("dflash_train")


class BatchedDrafterRunner:
    """DrafterRunner for `rows` sequences: context K/V per layer in [rows * max_len, kv_heads, head_dim] (row r's
    position p at r * max_len + p), one (CUDA-graphed) forward per step for every row's block.

    begin(feats, lengths): the prompts' features; extend(feats, starts): the last verified block's features of every
    row at its positions starts[r]..; draft(last, starts) -> logits [rows, B-1, V]. As in DrafterRunner, the rows of
    a block that were not kept sit at positions the row's length hides, and the next extend overwrites them."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, rows: int, max_len: int,
                 block_size: int | None = None, graphs: bool | None = None):
        cfg = drafter.config
        self.block_size = B = block_size or cfg.block_size
        if B < 2:
            raise ValueError("block_size must be at least 2")
        self.rows, self.max_len = rows, max_len
        self.device, self.dtype = target.device, target.embed_tokens.weight.dtype
        self.drafter = serving_copy(drafter, self.device, self.dtype)
        self.embed_w, self.lm_head = target.embed_tokens.weight, target.lm_head
        kv = (rows * max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.ctx_k = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        self.ctx_v = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.drafter.layers]
        dev = dict(device=self.device)
        self.kv_idx = torch.arange(max_len, **dev)
        self.arange_b = torch.arange(B, **dev)
        self.row_base = (torch.arange(rows, **dev) * max_len)[:, None]                   # [rows, 1]
        # Static inputs of the graphed step.
        self.pend_feats = torch.zeros(rows, B, cfg.num_feature_layers * cfg.hidden_size, dtype=self.dtype, **dev)
        self.pend_pos = self.arange_b.repeat(rows, 1)                                    # [rows, B] positions
        self.ctx_len = torch.zeros(rows, dtype=torch.long, **dev)      # row r's context positions < ctx_len[r] are real
        self.block_ids = torch.full((rows, B), cfg.mask_token_id, dtype=torch.long, **dev)
        self.own_block = torch.ones(rows, 1, B, B, dtype=torch.bool, **dev)  # a block sees all of itself
        self.block_pos = self.arange_b.repeat(rows, 1)
        self._step = GraphedStep(self._append_and_draft, resolve_graphs(graphs, self.device))

    def _write_context(self, feats: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """feats [n, k*H] at positions pos [n], stored at flat slots [n] -> the per-layer context K/V buffers."""
        for (k, v), K, V in zip(self.drafter.context_kv(feats, pos), self.ctx_k, self.ctx_v):
            K.index_copy_(0, slots, k.to(K.dtype))
            V.index_copy_(0, slots, v.to(V.dtype))

    def _attend(self, mask: torch.Tensor):
        """The drafter layers' attend over [every row's context, every row's block] as one batch of rows: each
        block's queries see their own row's context (mask [rows, 1, B, L + B]) and their own block."""
        R, L, B = self.rows, self.max_len, self.block_size

        def attend(q, k, v):  # q [1, h, R*B, d], k/v [1, hkv, R*L + R*B, d] (the layer's cat of context and blocks)
            def rows_of(t):
                h, d = t.shape[1], t.shape[-1]
                ctx = t[0, :, : R * L].view(h, R, L, d).transpose(0, 1)
                blk = t[0, :, R * L:].view(h, R, B, d).transpose(0, 1)
                return torch.cat([ctx, blk], dim=2)                                       # [R, h, L + B, d]

            qr = q[0].view(q.shape[1], R, B, q.shape[-1]).transpose(0, 1)                 # [R, h, B, d]
            out = F.scaled_dot_product_attention(qr, rows_of(k), rows_of(v), attn_mask=mask, enable_gqa=True)
            return out.transpose(0, 1).reshape(q.shape)
        return attend

    def _block_hidden(self) -> torch.Tensor:
        """Append every row's pending context, run every row's block -> hidden [rows * B, H]."""
        R, B = self.rows, self.block_size
        self._write_context(self.pend_feats.view(R * B, -1), self.pend_pos.view(-1),
                            (self.pend_pos + self.row_base).view(-1))
        ctx = (self.kv_idx[None, :] < self.ctx_len[:, None])[:, None, None, :].expand(R, 1, B, self.max_len)
        mask = torch.cat([ctx, self.own_block], dim=-1)                                   # [R, 1, B, L + B]
        x = F.embedding(self.block_ids.view(-1), self.embed_w)                            # [R*B, H]
        return self.drafter.forward_blocks(x, self.block_pos.view(-1), list(zip(self.ctx_k, self.ctx_v)),
                                           self._attend(mask), B)

    def _append_and_draft(self) -> torch.Tensor:
        """The captured step -> draft logits [rows, B-1, V]."""
        return self.lm_head(self._block_hidden().view(self.rows, self.block_size, -1)[:, 1:])

    @torch.no_grad()
    def begin(self, prompt_feats: torch.Tensor, lengths: list[int]) -> None:
        """Row r's prompt: prompt_feats[r, -lengths[r]:] ([rows, P, k*H], left-padded) at positions
        0..lengths[r]-1 (eager: the lengths vary)."""
        for r, n in enumerate(lengths):
            if n + self.block_size > self.max_len:
                raise ValueError(f"prompt of {n} tokens leaves no room for a block in {self.max_len} slots")
            pos = torch.arange(n, device=self.device)
            self._write_context(prompt_feats[r, prompt_feats.shape[1] - n:].to(self.dtype), pos,
                                pos + r * self.max_len)
        # nothing pending: the first step rewrites slots each row's length hides
        self.pend_pos.copy_(self.arange_b[None, :] + torch.tensor(lengths, device=self.device)[:, None])

    @torch.no_grad()
    def extend(self, block_feats: torch.Tensor, starts: torch.Tensor) -> None:
        """Features [rows, B, k*H] of the last verified blocks at positions starts[r].. (only kept rows count)."""
        self.pend_feats.copy_(block_feats)
        torch.add(self.arange_b[None, :], starts[:, None], out=self.pend_pos)

    @torch.no_grad()
    def draft(self, last: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """last [rows] on the device, row r's at position starts[r] ([rows] long, on the device); its context is
        positions 0..starts[r]-1. -> draft logits [rows, B-1, V] (overwritten by the next call)."""
        self.block_ids[:, 0].copy_(last)
        torch.add(self.arange_b[None, :], starts[:, None], out=self.block_pos)
        self.ctx_len.copy_(starts)
        return self._step()

    @torch.no_grad()
    def propose_rows(self, last: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [rows, B-1]: each row's argmax."""
        return self.draft(last, starts).argmax(-1)


class BatchedDrafter2Runner(BatchedDrafterRunner):
    """A DFlash 2 drafter (models/drafter2.py), as Drafter2Runner for one sequence: the captured step also returns
    the hidden states, and the candidate selector picks every row's drafts left to right after it (greedy)."""

    def _append_and_draft(self):
        """The captured step -> (hidden [rows, B-1, H], logits [rows, B-1, V]) of block positions 1..B-1."""
        R, B = self.rows, self.block_size
        h = self._block_hidden().view(R, B, -1)[:, 1:]
        return h, self.lm_head(h)

    @torch.no_grad()
    def propose_rows(self, last: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        h, logits = self.draft(last, starts)
        return self.drafter.candidate_selector.select_greedy_rows(h, logits, last)


@torch.no_grad()
def speculative_generate_batch(target: TargetRunner, drafter, prompts: list[list[int]], max_new_tokens: int,
                               stop_ids=()) -> list[tuple[list[int], list[int]]]:
    """Greedy speculative decoding of len(prompts) <= the runners' rows prompts at once -> per prompt (tokens,
    acceptance length of each verification step), each what speculative_generate gives for that prompt alone (up
    to the rounding of batched kernels). target: TargetRunner.for_target with batch_size rows and a step of B
    tokens, at least max(len(prompt)) + B * (max_new_tokens + 1) slots; drafter: a BatchedDrafterRunner of the same
    rows (or a test double with its begin / extend / propose_rows), at least max(len(prompt)) + max_new_tokens + 2B:
    a row's last step may keep up to B - 1 tokens past max_new_tokens, and while other rows decode on, every step
    appends its B block rows at the position where that row stopped."""
    R, B = target.batch_size, drafter.block_size
    n = len(prompts)
    if not 0 < n <= R:
        raise ValueError(f"{n} prompts for {R} rows")
    lengths = [len(p) for p in prompts] + [1] * (R - n)          # spare rows decode a one-token prompt, unread
    P = max(lengths)
    if P + B * (max_new_tokens + 1) > target.max_len:
        raise ValueError(f"{P} prompt tokens and {max_new_tokens} new ones need {P + B * (max_new_tokens + 1)} "
                         f"target slots; the runner has {target.max_len}")
    rows = [[0] * (P - len(p)) + list(p) for p in prompts] + [[0] * P] * (R - n)
    logits, feats = target.prefill(torch.tensor(rows), [P - m for m in lengths])     # [R, 1, V], [R, P, k*H]
    drafter.begin(feats, lengths)
    last = logits[:, -1].argmax(-1)                                                   # [R]
    sinks = [TokenSink(max_new_tokens, stop_ids) for _ in range(R)]
    for sink, tok in zip(sinks, last.tolist()):
        sink.add([tok])
    for sink in sinks[n:]:
        sink.done = True
    accept: list[list[int]] = [[] for _ in range(n)]
    starts = torch.tensor(lengths, device=target.device)                             # position of each row's `last`
    slot = P                                                                          # the slot of every row's `last`
    done = [s.done for s in sinks]
    active = torch.tensor([not d for d in done], device=target.device)              # rebuilt only when a row ends
    while not all(done):
        drafts = drafter.propose_rows(last, starts)                                   # [R, B-1]
        t_logits, t_feats = target.step(torch.cat([last[:, None], drafts], dim=1), slot)   # [R, B, V], [R, B, k*H]
        choice = t_logits.argmax(-1)                                                  # [R, B]
        agreed = agreed_drafts(drafts, choice)                                        # [R] drafts kept
        keep = torch.where(active, agreed + 1, 0)                                     # a done row keeps nothing
        drafter.extend(t_feats, starts)
        target.hide(slot, B, keep)
        bonus = choice.gather(1, agreed[:, None])[:, 0]
        host = torch.cat([agreed[:, None], drafts, bonus[:, None]], dim=1).tolist()  # the step's one host sync
        for r in range(n):
            if not sinks[r].done:
                a = host[r][0]
                accept[r].append(a + 1)
                sinks[r].add(host[r][1:1 + a] + [host[r][B]])
        starts += keep
        slot += B
        last = bonus
        if any(s.done != d for s, d in zip(sinks, done)):
            done = [s.done for s in sinks]
            active = torch.tensor([not d for d in done], device=target.device)
    return [(sinks[r].tokens, accept[r]) for r in range(n)]


def agreed_drafts(drafts: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """drafts [R, B-1], the target's choices [R, B] (choice j: its next token after block token j) -> [R] the drafts
    each row keeps: the longest prefix the target agrees with (speculative.accept_greedy's n, per row)."""
    return torch.cumprod((drafts == choice[:, :-1]).long(), dim=1).sum(1)


def rows_that_fit(target: TargetModel, slots: int, wanted: int) -> int:
    """How many rows of `slots` target cache slots to decode at once: `wanted`, fewer where their K/V would take more
    than half the memory the device has left (cuda_memory_available: after a training in the same process, as in
    the demo, what its allocator keeps reserved counts as left; a CPU: 4 GiB)."""
    info = target.info
    per_row = slots * info.num_layers * 2 * info.num_key_value_heads * info.head_dim * \
        target.embed_tokens.weight.element_size()
    if target.device.type == "cuda":
        budget = cuda_memory_available(target.device) // 2
    else:
        budget = 4 << 30
    return max(1, min(wanted, budget // per_row))


def decode_batched(target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
                   block_size: int, stop_ids=(), graphs: bool | None = None,
                   rows: int = 32) -> list[tuple[list[int], list[int]]]:
    """speculative_generate_batch over any number of prompts, up to `rows` at a time (fewer where memory is short:
    rows_that_fit) -> per prompt (tokens, acceptance lengths), in the prompts' order."""
    B, P = block_size, max(len(p) for p in prompts)
    slots = P + B * (max_new_tokens + 1)
    R = rows_that_fit(target, slots, min(rows, len(prompts)))
    if R < min(rows, len(prompts)):
        log.info(f"speculative decoding {R} prompts at a time, not {rows}: the caches of more would take over half "
                 "the free memory")
    t_run = TargetRunner.for_target(target, slots, step_lens=(B,), graphs=graphs, batch_size=R)
    runner = BatchedDrafter2Runner if isinstance(drafter, DFlash2Drafter) else BatchedDrafterRunner
    d_run = runner(drafter, target, R, P + max_new_tokens + 2 * B, B, graphs)  # speculative_generate_batch: why 2B
    out: list[tuple[list[int], list[int]]] = []
    for i in range(0, len(prompts), R):
        out += speculative_generate_batch(t_run, d_run, prompts[i:i + R], max_new_tokens, stop_ids)
    return out
