"""A DFlash drafter for transformers, copied by dflash-train into every drafter it exports (modeling_dflash.py).

Self-contained: torch and transformers only (dflash-train need not be installed to use it).

    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16)
    drafter = AutoModel.from_pretrained(DRAFTER, trust_remote_code=True, dtype=torch.bfloat16)
    out = drafter.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[tokenizer.eos_token_id])

spec_generate is greedy speculative decoding: the output equals the target's own greedy output (lossless), whatever
the drafter proposes. The weights and config.json are the DFlash format SGLang and vLLM load (DFlashDraftModel).

Shapes (b = batch, S context tokens, N block tokens, k tapped layers, H hidden):
  target_hidden  [b, S, k*H]  the tapped target layers' outputs, concatenated
  ctx            [b, S, H]    hidden_norm(fc(target_hidden)), shared by every layer
  noise_embedding[b, N, H]    the block [last token, MASK, ...] embedded by the target's embedding table
Queries come from the block only; keys and values are [context ; block], projected by the same k_proj / v_proj.
The block attends to the whole context and to itself (bidirectionally).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _dflash_value(config, name, default=None):
    """A DFlash field: dflash_config first (newer loaders read it there), then the top level of config.json."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)  # transformers 5 moves it into rope_parameters
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1_000_000.0)
    return float(theta)


def _crop(cache, length: int) -> None:
    """Cut a transformers cache to its first `length` positions. A negative argument removes that many tokens in
    every transformers version (a positive one means "keep" in older ones and is refused by newer ones)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, d]; cos/sin [L, d]."""
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.num_heads
        d = self.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [b, L, H] -> k, v [b, hkv, L, d], k normed and rotated (context and block tokens alike)."""
        b, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(b, L, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v):
        """x [b, N, H] (normed block states), ctx_k/ctx_v [b, hkv, S, d] -> [b, N, H]."""
        b, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, N, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rope(q, cos, sin)
        blk_k, blk_v = self.project_kv(x, cos, sin)
        rep = self.num_heads // self.num_kv_heads  # grouped-query attention: kv head j serves q heads j*rep..
        k = torch.cat([ctx_k, blk_k], dim=2).repeat_interleave(rep, dim=1)
        v = torch.cat([ctx_v, blk_v], dim=2).repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: the block sees all its context and itself
        return self.o_proj(out.transpose(1, 2).reshape(b, N, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter: no embedding and no LM head of its own (it borrows the target's)."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.post_init()

    # ------------------------------------------------------------------ the model
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [L] -> cos, sin [L, d]. Computed in fp32 on every call (no buffer: a bf16 buffer would round
        the frequencies and shift every rotary angle)."""
        d = self.layers[0].self_attn.head_dim
        inv_freq = 1.0 / (_rope_theta(self.config) ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                                    device=positions.device) / d))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor):
        """target_hidden [b, S, k*H] at positions [S] -> per layer (k, v) [b, hkv, S, d]."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward_block(self, noise_embedding: torch.Tensor, positions: torch.Tensor, ctx_kv) -> torch.Tensor:
        """noise_embedding [b, N, H] at positions [N], ctx_kv from context_kv -> final-normed hidden [b, N, H]."""
        x = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self._rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v)
        return self.norm(x)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                position_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """noise_embedding [b, N, H], target_hidden [b, S, k*H], position_ids [b, S+N] or [S+N] (context positions
        then block positions, as the reference DFlash model takes them) -> hidden [b, N, H]. No cache."""
        pos = position_ids if position_ids.dim() == 1 else position_ids[0]
        S = target_hidden.shape[1]
        return self.forward_block(noise_embedding, pos[S:], self.context_kv(target_hidden, pos[:S]))

    # ------------------------------------------------------------------ speculative decoding
    def _features(self, hidden_states) -> torch.Tensor:
        """A target's output_hidden_states tuple -> [b, T, k*H]; entry i+1 is the output of layer i."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, block_size: int | None = None,
                      return_acceptance: bool = False):
        """Greedy DFlash speculative decoding with a Hugging Face causal LM `target` (the one this drafter was
        trained for), one prompt at a time: input_ids [1, P] -> [1, P + n], n <= max_new_tokens, stopping after
        the first token in stop_token_ids. Lossless: the output equals the target's own greedy output.

        Each step drafts a block [last token, MASK x (B-1)] in one drafter forward, the target verifies it in one
        forward, and the longest agreeing prefix plus the target's next token is kept. return_acceptance: also
        return the acceptance length of every step (1..B; its mean is tau)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate takes one prompt, input_ids of shape [1, P] (got {list(input_ids.shape)})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        B = block_size or self.block_size
        if B < 2:
            raise ValueError("block_size must be at least 2 (the last token plus at least one drafted token)")
        embed_w = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        stops = set(stop_token_ids or [])
        dev, P = input_ids.device, input_ids.shape[1]

        out = target(input_ids, use_cache=True, output_hidden_states=True)
        cache = out.past_key_values                               # the target's cache: positions 0..P-1
        # transformers renames forward's past_key_values to cache (deprecated from 5.2x): pass what it takes
        cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        new = [int(out.logits[0, -1].argmax())]
        ctx_kv = self.context_kv(self._features(out.hidden_states), torch.arange(P, device=dev))
        acceptance = []
        while len(new) < max_new_tokens and new[-1] not in stops:
            start = P + len(new) - 1                              # position of the last token: not yet verified
            pos = torch.arange(start, start + B, device=dev)
            block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = new[-1]
            h = self.forward_block(F.embedding(block, embed_w), pos, ctx_kv)        # [1, B, H]
            block[0, 1:] = head(h[:, 1:].to(embed_w.dtype)).argmax(-1)[0]           # the draft, B-1 tokens
            out = target(block, position_ids=pos[None], use_cache=True, output_hidden_states=True,
                         **{cache_arg: cache})
            choice = out.logits[0].argmax(-1)                                       # [B] the target's own tokens
            n = int((block[0, 1:] == choice[:-1]).long().cumprod(0).sum())          # drafts accepted
            _crop(cache, start + n + 1)                           # keep the last token and the accepted drafts
            kv = self.context_kv(self._features(out.hidden_states)[:, : n + 1], pos[: n + 1])
            ctx_kv = [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(ctx_kv, kv)]
            acceptance.append(n + 1)
            for t in block[0, 1: n + 1].tolist() + [int(choice[n])]:
                new.append(t)
                if t in stops or len(new) >= max_new_tokens:
                    break
        ids = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=dev)], dim=1)
        return (ids, acceptance) if return_acceptance else ids
