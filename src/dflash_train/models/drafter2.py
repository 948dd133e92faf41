"""The DFlash 2 drafter: the DFlash drafter (models/drafter.py) plus local convolutions and a candidate selector.

Two additions, with the parameter names of the released `DFlash2DraftModel` checkpoints:
- Each decoder layer wraps attention and MLP in grouped dynamic causal convolutions (`attention_conv`, `mlp_conv`).
  One projection of the sublayer's normed input gives two per-token kernels, each of K = conv_kernel_size taps per
  group of conv_group_size channels; a learned per-channel base kernel is added to each. The first convolves the
  sublayer's input, the second its output:
      y[t] = sum_{o < K} (base[o] + dyn[t, o]) * x[t - o]      (within the block; x before the block start = 0)
  The convolution runs along the block only: position t sees its own block's positions t-K+1..t, never context
  nor another block. In training (A blocks of B flattened to A*B rows) each block is convolved on its own.
- `candidate_selector` re-ranks the top selector_top_k LM-head candidates of each block position with low-rank
  (selector_rank) predecessor / successor codebooks over the vocabulary, decoding the block left to right:
      score(c | prev, h_k) = logit_k(c) + <P[prev] * W h_k, S[c]>,    c in top-K(logit_k), prev = the token chosen
  at k-1 (the block's anchor token at k = 1). The drafts are the selector's choices (argmax, or a sample of
  softmax(score / T) at temperature T), not the LM head's argmax.
Attention is the DFlash drafter's (full, bidirectional within the block; no sliding window).

Shapes (as in models/drafter.py): x [N, H] block rows, N = A * B (training) or B (inference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .drafter import AttendFn, DFlashDecoderLayer, DFlashDrafter, DrafterConfig


@dataclass
class Drafter2Config(DrafterConfig):
    conv_kernel_size: int = 2       # taps of each causal convolution (offsets 0..K-1 within the block)
    conv_group_size: int = 16       # channels sharing one dynamic kernel weight (hidden_size must divide by it)
    selector_top_k: int = 16        # LM-head candidates the selector re-ranks per block position
    selector_rank: int = 256        # rank of the predecessor / successor codebooks


class DynamicCausalConv(nn.Module):
    """The pair of grouped dynamic causal convolutions around one sublayer (module docstring)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))        # [in/out, K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.0):
        """Identity: tap 0 of the base kernel is 1, the rest and the projection 0, so a fresh DFlash 2 layer computes
        what a DFlash layer does and training starts from the v1 architecture's function."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
        """x [N, H], dyn [N, K, G], base [K, H] -> [N, H], each block of `block_size` rows convolved on its own."""
        N, H = x.shape
        K, G, g = self.kernel_size, self.groups, self.group_size
        xb = x.view(N // block_size, block_size, G, g)
        padded = F.pad(xb, (0, 0, 0, 0, K - 1, 0))                 # K-1 zero rows before each block
        kernel = base.to(x.dtype).view(1, K, G, g) + dyn.view(N, K, G, 1)   # [N, K, G, g]
        kernel = kernel.view(N // block_size, block_size, K, G, g)
        out = torch.zeros_like(xb)
        for o in range(K):  # tap o reads row t - o of the same block
            out = out + kernel[:, :, o] * padded[:, K - 1 - o: K - 1 - o + block_size]
        return out.view(N, H)

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (normed sublayer input) -> (convolved input [N, H], the output kernel [N, K, G] for `finish`)."""
        dyn = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[:, 0], self.base_kernel[0], block_size), dyn[:, 1]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, block_size: int) -> torch.Tensor:
        """y [N, H] (sublayer output), dyn from `prepare` -> [N, H]."""
        return self._convolve(y, dyn, self.base_kernel[1], block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg: Drafter2Config):
        super().__init__(cfg)
        self.attention_conv = DynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attend: AttendFn, block_size: int):
        h, out_kernel = self.attention_conv.prepare(self.input_layernorm(x), block_size)
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, ctx_k, ctx_v, attend), out_kernel, block_size)
        h, out_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_size)
        return x + self.mlp_conv.finish(self.mlp(h), out_kernel, block_size)


class CandidateSelector(nn.Module):
    """Low-rank re-ranking of the LM head's top-K candidates (module docstring). The codebooks are plain
    parameters: the checkpoint stores them under their bare names (candidate_selector.predecessor_codebook)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=std)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessor: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], unary / candidates [..., K] (the candidates' logits and ids), predecessor [...] ids
        -> scores [..., K] = unary + <P[predecessor] * W hidden, S[candidate]>."""
        ctx = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden)          # [..., r]
        pair = (self.successor_codebook[candidates] * ctx[..., None, :].to(self.successor_codebook.dtype)).sum(-1)
        return unary + pair.to(unary.dtype)

    def candidate_table(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor):
        """R blocks at inference: hidden [R, n, H], logits [R, n, V] of block positions 1..n, anchors [R] (each
        block's first token) -> (candidates [R, n, K], table [R, n, K, K]): table[r, k, i, j] scores position k's
        candidate j after predecessor i, position 0's predecessor being the anchor (every i), position k's one of
        position k-1's candidates. Scored in one batched call, so that a walk costs two small ops a position
        (launch-bound at decoding's batch of one block, where scoring position by position was ~10 a position)."""
        R = logits.shape[0]
        unary, candidates = logits.topk(self.top_k, dim=-1)                                   # [R, n, K]
        predecessors = torch.cat([anchors[:, None, None].expand(R, 1, self.top_k), candidates[:, :-1]], dim=1)
        return candidates, self.scores(hidden[:, :, None, :], unary[:, :, None, :], candidates[:, :, None, :],
                                       predecessors)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
               generator: torch.Generator | None = None):
        """One block at inference: hidden [n, H] and logits [n, V] of block positions 1..n, anchor [1] (the block's
        first token) -> (drafts [n], candidates [n, K], q [n, K] fp32 or None at temperature 0: the distribution
        each draft was sampled from, given the drafts before it). Left to right: each choice is the next
        position's predecessor."""
        candidates, table = self.candidate_table(hidden[None], logits[None], anchor.reshape(1))
        candidates, table = candidates[0], table[0]                                           # [n, K], [n, K, K]
        prev = torch.zeros((), dtype=torch.long, device=logits.device)  # row 0 of table[0]: the anchor
        picks, qs = [], []
        for k in range(hidden.shape[0]):
            s = table[k, prev]                                                                 # [K]
            if temperature > 0:
                q = torch.softmax(s.float() / temperature, dim=-1)
                prev = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(q)
            else:
                prev = s.argmax()
            picks.append(prev)
        drafts = candidates.gather(1, torch.stack(picks)[:, None])[:, 0]
        return drafts, candidates, torch.stack(qs) if qs else None

    def select_greedy_rows(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """select at temperature 0 for R blocks at once (batched decoding, inference/batched.py): hidden [R, n, H],
        logits [R, n, V], anchors [R] -> drafts [R, n], each row what select gives for its block alone."""
        candidates, table = self.candidate_table(hidden, logits, anchors)
        rows = torch.arange(logits.shape[0], device=logits.device)
        prev = torch.zeros_like(rows)  # row 0 of table[:, 0]: each block's anchor
        picks = []
        for k in range(logits.shape[1]):
            prev = table[rows, k, prev].argmax(-1)                                           # [R]
            picks.append(prev)
        return candidates.gather(2, torch.stack(picks, dim=1)[..., None])[..., 0]


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: Drafter2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)
        for m in self.modules():  # (the selector does not exist yet when DFlashDrafter.__init__ calls this)
            if isinstance(m, (DynamicCausalConv, CandidateSelector)):
                m.reset_parameters()

    def forward_blocks(self, x: torch.Tensor, block_pos: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], attend: AttendFn,
                       block_size: int | None = None) -> torch.Tensor:
        """x [N, H] embedded block tokens in blocks of `block_size` rows (default: the config's), block_pos [N]
        -> final-normed hidden [N, H]."""
        B = block_size or self.config.block_size
        cos, sin = self.rotary(block_pos, x.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, attend, B)
        return self.norm(x)
