"""The servable drafter format (docs/DESIGN.md "The checkpoint contract"): config.json + model.safetensors.

The weights are the drafter's own parameters under their own names (layers.{i}.self_attn.q_proj.weight, fc.weight,
hidden_norm.weight, norm.weight, ...): no embedding, no LM head. config.json is a Qwen3 config sized like the
drafter plus the DFlash fields SGLang, vLLM and transformers read. Saved in the parameters' dtype (fp32 master
weights by default), so a reload is bit-exact; `dtype=torch.bfloat16` writes a smaller serving copy.
"""

from __future__ import annotations

from ..errors import UserError

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CheckpointError(UserError):
    """A drafter directory is missing, incomplete or inconsistent; the message names the file."""


def drafter_config_json(cfg: DrafterConfig, dtype: torch.dtype = torch.float32) -> dict:
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
    }
    d.update(cfg.extra)
    return d


def drafter_config_from_json(d: dict, source: str = "config.json") -> DrafterConfig:
    try:
        dc = d["dflash_config"]
        return DrafterConfig(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            vocab_size=d["vocab_size"], target_layer_ids=list(dc["target_layer_ids"]),
            num_target_layers=d["num_target_layers"], mask_token_id=dc["mask_token_id"],
            block_size=d.get("block_size", 16), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
        )
    except KeyError as e:
        raise CheckpointError(f"{source} is not a DFlash drafter config: missing key {e.args[0]!r}.") from None


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors into out_dir (created). Returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in drafter.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(drafter_config_json(drafter.config, dtype), indent=2) + "\n")
    return out


def load_drafter_config(path: str | Path) -> DrafterConfig:
    p = Path(path) / CONFIG_NAME
    if not p.is_file():
        raise CheckpointError(f"{p} does not exist; pass a drafter directory written by dflash-train "
                              "(config.json + model.safetensors).")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    return drafter_config_from_json(d, str(p))


def load_drafter(path: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Rebuild a drafter from a servable directory; parameters come back in the saved dtype."""
    cfg = load_drafter_config(path)
    w = Path(path) / WEIGHTS_NAME
    if not w.is_file():
        raise CheckpointError(f"{w} does not exist; the drafter directory is incomplete.")
    state = load_file(str(w), device="cpu")
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    drafter = drafter.to_empty(device="cpu").to(dtype)
    drafter.rotary.__init__(cfg.head_dim, cfg.rope_theta)  # non-persistent buffer: rebuild after to_empty
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{w} does not match its config.json: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}.")
    return drafter.to(device)
