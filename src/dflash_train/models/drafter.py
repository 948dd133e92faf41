"""The DFlash drafter: Qwen3-style decoder layers with KV injection of fused target features.

Shapes (one packed row, no batch dim; attention adds a batch dim of 1):
  feats     [S, k*H]   target layer outputs for S context tokens
  ctx       [S, H]     hidden_norm(fc(feats)), shared by every layer
  x         [N, H]     block token states (N = anchors * B in training, B at inference)
  keys      [S + N]    context keys first, then block keys; the same k_proj/v_proj project both
Queries come only from the block tokens. Who may attend to whom is decided by the `attend` callable passed in
(dense-mask SDPA, flex BlockMask, or a KV-cached inference path): the model itself is mask-agnostic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attend(q [1, h, N, d], k [1, hkv, S+N, d], v [1, hkv, S+N, d]) -> [1, h, N, d]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    extra: dict = field(default_factory=dict)  # rope_scaling etc. carried into config.json untouched

    @property
    def num_feature_layers(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        return asdict(self)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [L] -> cos, sin [L, head_dim] (computed in fp32, returned in `dtype`)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, d]; cos/sin [L, d]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [L, H] -> k, v [L, hkv, d] with k-norm and RoPE applied (context and block tokens alike)."""
        L = h.shape[0]
        k = self.k_norm(self.k_proj(h).view(L, self.num_kv_heads, self.head_dim))
        v = self.v_proj(h).view(L, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """x [N, H] (normed block states), ctx_k/ctx_v [S, hkv, d] -> [N, H]."""
        N = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(N, self.num_heads, self.head_dim)), cos, sin)
        blk_k, blk_v = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, blk_k], dim=0)  # [S+N, hkv, d]
        v = torch.cat([ctx_v, blk_v], dim=0)
        out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # [1, h, N, d]
        return self.o_proj(out[0].transpose(0, 1).reshape(N, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attend: AttendFn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names match the servable checkpoint exactly (see models/checkpoint.py)."""

    layer_class = DFlashDecoderLayer  # DFlash 2 (models/drafter2.py) wraps attention and MLP in convolutions

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H, k = cfg.hidden_size, cfg.num_feature_layers
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [S, k*H] -> fused context states [S, H]."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, feats: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [S, hkv, d] of the context. Inference caches and extends these lists."""
        ctx = self.context(feats)
        cos, sin = self.rotary(ctx_pos, ctx.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward_blocks(self, x: torch.Tensor, block_pos: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], attend: AttendFn,
                       block_size: int | None = None) -> torch.Tensor:
        """x [N, H] embedded block tokens, block_pos [N] -> final-normed hidden [N, H].
        block_size: rows per block (N = blocks * block_size). These layers see blocks only through `attend`'s mask;
        DFlash 2's convolutions (models/drafter2.py) run within each block."""
        cos, sin = self.rotary(block_pos, x.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, attend)
        return self.norm(x)

    def forward(self, x: torch.Tensor, block_pos: torch.Tensor, feats: torch.Tensor, ctx_pos: torch.Tensor,
                attend: AttendFn, block_size: int | None = None) -> torch.Tensor:
        return self.forward_blocks(x, block_pos, self.context_kv(feats, ctx_pos), attend, block_size)


def default_num_draft_layers(num_target_layers: int) -> int:
    return 5 if num_target_layers >= 24 else max(1, num_target_layers // 4)


def build_drafter_config(info, layer_ids: list[int], mask_token_id: int, block_size: int = 16,
                         num_draft_layers: int | None = None, intermediate_size: int | None = None) -> DrafterConfig:
    """Size the drafter from the target (`info`: models.target.TargetInfo)."""
    return DrafterConfig(
        hidden_size=info.hidden_size,
        intermediate_size=intermediate_size or info.intermediate_size,
        num_hidden_layers=num_draft_layers or default_num_draft_layers(info.num_layers),
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        target_layer_ids=list(layer_ids),
        num_target_layers=info.num_layers,
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta,
        max_position_embeddings=info.max_position_embeddings,
    )
