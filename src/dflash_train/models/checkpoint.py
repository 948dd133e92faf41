"""The servable drafter format (docs/DESIGN.md "The checkpoint contract", docs/SERVING.md).

  config.json          a Qwen3 config sized like the drafter plus the DFlash fields SGLang, vLLM and transformers
                       read; torch_dtype / dtype name the weights' dtype; auto_map points AutoModel at the file below
  model.safetensors    the drafter's own parameters under their own names (layers.{i}.self_attn.q_proj.weight,
                       fc.weight, hidden_norm.weight, norm.weight, ...): no embedding, no LM head. bf16 by default
                       (SERVE_DTYPE): an fp32 config would make SGLang's dtype rule run the drafter in fp16
  modeling_dflash.py   a copy of models/hf_modeling_dflash.py: AutoModel.from_pretrained(dir, trust_remote_code=True)
                       gives a drafter with a greedy, lossless spec_generate(target, ...)
  serve.txt            the SGLang and vLLM commands for this drafter (serve_commands)
A DFlash 2 drafter (models/drafter2.py) is written the same way with "architectures": ["DFlash2DraftModel"], its
sizes in dflash_config (conv_kernel_size, conv_group_size, selector_top_k, selector_rank), "is_causal": false, the
convolution and selector weights under the reference's names, and no modeling_dflash.py (it implements v1 only).
Every layer is full attention (layer_types, use_sliding_window: false); reading a config.json refuses one whose layers
the reference would run with a sliding window or causally (check_full_attention).

What a reload into dflash-train is exact for: load_drafter gives back the bf16 values bit for bit. Training keeps
fp32 master weights: a step checkpoint also holds them, unrounded, in training_weights.safetensors
(save_training_weights), and resume loads those (training/checkpointing.py), so a resumed run is bit-exact.
"""

from __future__ import annotations

from ..errors import UserError

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from .drafter import DFlashDrafter, DrafterConfig
from .drafter2 import DFlash2Drafter, Drafter2Config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TRAINING_WEIGHTS_NAME = "training_weights.safetensors"  # fp32 master weights, step checkpoints only
MODELING_NAME = "modeling_dflash.py"
SERVE_NAME = "serve.txt"
SERVE_DTYPE = torch.bfloat16
_MODELING_SOURCE = Path(__file__).with_name("hf_modeling_dflash.py")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
# serve.txt's extra line for a DFlash 2 drafter: engines without these changes do not know DFlash2DraftModel.
DFLASH2_ENGINES = ("# DFlash 2: an SGLang with sgl-project/sglang#35371 and a vLLM with vllm-project/vllm#52816 "
                   "(docs/SERVING.md).\n")


class CheckpointError(UserError):
    """A drafter directory is missing, incomplete or inconsistent; the message names the file."""


@dataclass(frozen=True)
class DrafterSnapshot:
    """A drafter's config and a copy of its parameters, without the module: all that save_drafter and
    save_training_weights read of a drafter (.config, .state_dict()). A step checkpoint saves one, so the training
    thread that takes the snapshot builds no module."""
    config: DrafterConfig
    weights: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


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
        "torch_dtype": _DTYPE_NAMES[dtype],  # transformers < 5 and the engines read torch_dtype, transformers 5 dtype
        "dtype": _DTYPE_NAMES[dtype],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        # block_size again inside dflash_config: newer loaders read it there first
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
        "auto_map": {"AutoModel": f"{MODELING_NAME.removesuffix('.py')}.DFlashDraftModel"},
    }
    if isinstance(cfg, Drafter2Config):  # what DFlash2DraftModel reads (dflash_config first, top-level fallback)
        d["architectures"] = ["DFlash2DraftModel"]
        d["is_causal"] = False  # explicit: bidirectional within the block, as the training mask
        d["dflash_config"] |= {k: getattr(cfg, k) for k in _DFLASH2_KEYS}
        del d["auto_map"]  # modeling_dflash.py implements DFlash v1 only
    extra = dict(cfg.extra)
    if "mask_token" in extra:  # the mask token's text: engines that resolve the token by name read it here
        d["dflash_config"]["mask_token"] = extra.pop("mask_token")
    d.update(extra)
    return d


def check_full_attention(d: dict, source: str = "config.json") -> None:
    """Refuse a drafter config that the reference runs with a sliding window or causally in some layer. It reads
    layer_types through Qwen3Config (given, or derived from use_sliding_window / max_window_layers), a sliding layer's
    window is sliding_window (None unless use_sliding_window), and a layer is causal if is_causal says so or, when
    is_causal is absent, if it is a sliding layer. dflash-train's drafters attend to the whole context and, within the
    block, bidirectionally in every layer: such a drafter would be trained or evaluated as something it is not."""
    try:
        ref = Qwen3Config.from_dict(d)
    except Exception as e:  # noqa: BLE001 - transformers' checks of a malformed file; their error types vary
        raise CheckpointError(f"{source} is not a valid Qwen3 drafter config "
                              f"({str(e).strip().splitlines()[-1].strip()}).") from None
    odd = []
    for i, kind in enumerate(ref.layer_types):
        sliding = kind == "sliding_attention"
        causal = sliding if d.get("is_causal") is None else bool(d["is_causal"])
        if causal or (sliding and ref.sliding_window is not None):
            odd.append(i)
    if odd:
        raise CheckpointError(
            f"{source} gives layer(s) {odd} sliding-window or causal attention (layer_types {ref.layer_types}, "
            f"sliding_window {ref.sliding_window}, is_causal {d.get('is_causal')}), which dflash-train's drafters "
            "do not support; serve such a drafter with SGLang or vLLM, or train one of full_attention layers here.")


def check_plain_rope(d: dict, source: str = "config.json") -> None:
    """Refuse a drafter config whose RoPE the reference scales (rope_scaling / rope_parameters of a rope_type other
    than default: llama3, yarn, linear, ...): dflash-train's drafters rotate by rope_theta alone, so such a drafter
    would be trained or evaluated as something it is not."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if kind not in (None, "default"):
            raise CheckpointError(
                f"{source} scales RoPE ({key} {rope}), which dflash-train's drafters do not support (they rotate by "
                "rope_theta alone); serve such a drafter with SGLang or vLLM, or train one without rope scaling here.")


# What the reference scales a drafter's input embeddings and logits by (a Gemma-like target's settings), read from
# dflash_config or the top level, and the value that leaves them as dflash-train computes them.
_REFERENCE_SCALES = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def check_unscaled(d: dict, source: str = "config.json") -> None:
    """Refuse a drafter config that asks the reference to scale its input embeddings or logits (_REFERENCE_SCALES):
    dflash-train neither trains nor decodes with those, so such a drafter would be evaluated as something it is not."""
    inner = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    for key, neutral in _REFERENCE_SCALES.items():
        value = inner.get(key, d.get(key, neutral))
        if value != neutral and not (neutral is None and value == 0):
            raise CheckpointError(f"{source} sets {key}={value}, which dflash-train's drafters do not apply; serve "
                                  "such a drafter with the reference dflash package, SGLang or vLLM.")


def drafter_config_from_json(d: dict, source: str = "config.json") -> DrafterConfig:
    check_full_attention(d, source)
    check_plain_rope(d, source)
    check_unscaled(d, source)
    try:
        dc = d["dflash_config"]
        v2 = "DFlash2DraftModel" in d.get("architectures", [])
        sizes = {k: dc.get(k, d.get(k)) for k in _DFLASH2_KEYS} if v2 else {}
        missing = [k for k, v in sizes.items() if v is None]
        if missing:
            raise KeyError(missing[0])
        return (Drafter2Config if v2 else DrafterConfig)(
            **sizes,
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            vocab_size=d["vocab_size"], target_layer_ids=list(dc["target_layer_ids"]),
            num_target_layers=d["num_target_layers"], mask_token_id=dc["mask_token_id"],
            block_size=d.get("block_size", 16), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            extra={"mask_token": dc["mask_token"]} if "mask_token" in dc else {},
        )
    except KeyError as e:
        raise CheckpointError(f"{source} is not a DFlash drafter config: missing key {e.args[0]!r}.") from None


def serve_commands(cfg: DrafterConfig, drafter: str = "DRAFTER", target: str = "TARGET",
                   dtype: torch.dtype = SERVE_DTYPE) -> str:
    """The SGLang and vLLM commands that serve `drafter` (a directory) with `target`: two lines.
    num_speculative_tokens is block_size - 1 (the drafted tokens of one block).

    A DFlash 2 drafter is served under the same names (SGLang's DFLASH algorithm, vLLM's "dflash" method): both
    engines pick DFlash 2 from config.json's architectures and dflash_config (docs/SERVING.md says where). Its
    convolutions run within blocks of exactly block_size tokens, so SGLang is given the block size too (vLLM derives
    it as num_speculative_tokens + 1)."""
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": cfg.block_size - 1})
    d = _DTYPE_NAMES[dtype]
    block = f" --speculative-num-draft-tokens {cfg.block_size}" if isinstance(cfg, Drafter2Config) else ""
    return (f"python -m sglang.launch_server --model-path {target} --dtype {d} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {drafter}{block}\n"
            f"vllm serve {target} --dtype {d} --speculative-config '{spec}'\n")


def save_drafter(drafter: DFlashDrafter | DrafterSnapshot, out_dir: str | Path,
                 dtype: torch.dtype = SERVE_DTYPE) -> Path:
    """Write the servable drafter (module docstring) into out_dir (created), weights in `dtype`. Returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    v2 = isinstance(cfg, Drafter2Config)  # the config decides the class, as in load_drafter
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(drafter_config_json(cfg, dtype), indent=2) + "\n")
    if not v2:  # the trust_remote_code file is DFlash v1's
        shutil.copyfile(_MODELING_SOURCE, out / MODELING_NAME)
    (out / SERVE_NAME).write_text(
        f"# Serve this drafter ({_DTYPE_NAMES[dtype]} weights) with the target it was trained for "
        f"({cfg.num_target_layers} layers, vocabulary {cfg.vocab_size}): replace TARGET with "
        "the target's path and DRAFTER with this directory's.\n"
        + (DFLASH2_ENGINES if v2 else "")
        + serve_commands(cfg, dtype=dtype))
    return out


def save_training_weights(drafter: DFlashDrafter | DrafterSnapshot, out_dir: str | Path) -> Path:
    """The parameters in their own dtype (fp32 master weights), unrounded, as out_dir/training_weights.safetensors:
    what resume loads (load_drafter(dir, weights=TRAINING_WEIGHTS_NAME)). Returns the file."""
    path = Path(out_dir) / TRAINING_WEIGHTS_NAME
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def load_drafter_config(path: str | Path) -> DrafterConfig:
    p = Path(path) / CONFIG_NAME
    if not p.is_file():
        if (Path(path) / "drafter" / CONFIG_NAME).is_file():  # a training run's directory, not its drafter
            raise CheckpointError(f"{path} is a training run; pass its drafter, {Path(path) / 'drafter'} (the best "
                                  "validation step), or drafter_last/ (the final one).")
        raise CheckpointError(f"{p} does not exist; pass a drafter directory written by dflash-train "
                              "(config.json + model.safetensors).")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    return drafter_config_from_json(d, str(p))


def drafter_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The module a drafter config builds: DFlash 2 for a Drafter2Config, else DFlash v1."""
    return DFlash2Drafter if isinstance(cfg, Drafter2Config) else DFlashDrafter


def load_drafter(path: str | Path, device: str | torch.device = "cpu", weights: str = WEIGHTS_NAME) -> DFlashDrafter:
    """Rebuild a drafter from a drafter directory; parameters come back in the saved dtype, bit for bit.
    weights: the file to read, model.safetensors (the servable copy) or training_weights.safetensors (fp32)."""
    cfg = load_drafter_config(path)
    w = Path(path) / weights
    if not w.is_file():
        raise CheckpointError(f"{w} does not exist; the drafter directory is incomplete.")
    state = load_file(str(w), device="cpu")
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        drafter = drafter_class(cfg)(cfg)
    drafter = drafter.to_empty(device="cpu").to(dtype)
    drafter.rotary.__init__(cfg.head_dim, cfg.rope_theta)  # non-persistent buffer: rebuild (fp32) after to_empty
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{w} does not match its config.json: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}.")
    return drafter.to(device)
