"""Size a drafter for a target and pick its mask token (the documented rule)."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError, ModelConfig
from .drafter import DFlashDrafter, build_drafter_config
from .drafter2 import DFlash2Drafter, Drafter2Config
from .target import TargetInfo, default_layer_ids, load_causal_lm, resolve_target_path

log = logging.getLogger("dflash_train")
_RESERVED_HINTS = ("mask", "reserved", "unused")


def choose_mask_token_id(tokenizer, configured: int | None, vocab_size: int) -> int:
    """The mask token, by rule:
    1. the tokenizer's own mask token, if it has one;
    2. else `model.mask_token_id` from the config;
    3. else a special token whose text says mask / reserved / unused (the lowest such id);
    4. else an id the tokenizer never produces: vocab_size - 1 when the embedding table has padding rows;
    5. else the highest special token id that is not bos / eos / pad / unk or the chat template's markers.
    """
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if configured is not None:
        if not 0 <= configured < vocab_size:
            raise ConfigError(f"model.mask_token_id {configured} is outside the target vocabulary 0..{vocab_size - 1}.")
        return configured
    if tokenizer is None:
        return vocab_size - 1
    specials = {int(i): str(t) for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for i, tok in added.items():
        specials.setdefault(int(i), str(getattr(tok, "content", tok)))
    hinted = sorted(i for i, t in specials.items() if any(h in t.lower() for h in _RESERVED_HINTS) and i < vocab_size)
    if hinted:
        return hinted[0]
    if len(tokenizer) < vocab_size:
        return vocab_size - 1
    used = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    template = getattr(tokenizer, "chat_template", None) or ""
    free = sorted(i for i, t in specials.items() if i not in used and t not in template and i < vocab_size)
    if free:
        return free[-1]
    raise ConfigError("Could not find an unused token to use as the mask token; set model.mask_token_id.")


def resolve_layer_ids(cfg: ModelConfig, info: TargetInfo) -> list[int]:
    """The tapped target layers: model.target_layer_ids as given, else the default rule (models/target.py).

    Serving engines capture each layer's output once and never the last layer's (they read it after the final
    norm), so a repeated layer or one outside 0..L-2 would train a drafter no engine can feed."""
    L = info.num_layers
    if not cfg.target_layer_ids:
        ids = default_layer_ids(L, cfg.num_feature_layers)
        if len(ids) < cfg.num_feature_layers:
            log.info(f"taps: the {L}-layer target has room for {len(ids)} distinct layer(s) before its last two, "
                     f"not model.num_feature_layers={cfg.num_feature_layers}: tapping layers {ids}")
        return ids
    ids = list(cfg.target_layer_ids)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"model.target_layer_ids {ids} repeats layer(s) {repeated}; list each layer once "
                          "(serving engines capture a layer's output only once).")
    bad = [i for i in ids if not 0 <= i <= L - 2]
    if bad:
        raise ConfigError(f"model.target_layer_ids {ids} must lie within 0..{L - 2} for this {L}-layer target "
                          f"(got {bad}; serving engines never tap the last layer, {L - 1}).")
    return ids


def build_drafter(cfg: ModelConfig, info: TargetInfo, tokenizer=None) -> DFlashDrafter:
    mask_id = choose_mask_token_id(tokenizer, cfg.mask_token_id, info.vocab_size)
    dcfg = build_drafter_config(info, resolve_layer_ids(cfg, info), mask_id, cfg.block_size,
                                cfg.num_draft_layers, cfg.intermediate_size)
    mask_token = tokenizer.convert_ids_to_tokens(mask_id) if tokenizer is not None and mask_id < len(tokenizer) else None
    if mask_token is not None:  # exported as dflash_config.mask_token (models/checkpoint.py)
        dcfg.extra["mask_token"] = str(mask_token)
    if cfg.architecture == "dflash2":
        return DFlash2Drafter(dflash2_config(cfg, dcfg))
    return DFlashDrafter(dcfg)


def dflash2_config(cfg: ModelConfig, dcfg) -> Drafter2Config:
    """The DFlash drafter's sizes plus DFlash 2's, checked against the target's."""
    if dcfg.hidden_size % cfg.conv_group_size:
        raise ConfigError(f"model.conv_group_size {cfg.conv_group_size} does not divide the target's hidden size "
                          f"{dcfg.hidden_size}; pick a divisor of it (16 divides most).")
    if cfg.selector_top_k > dcfg.vocab_size:
        raise ConfigError(f"model.selector_top_k {cfg.selector_top_k} exceeds the target vocabulary "
                          f"({dcfg.vocab_size}); pick at most that many candidates.")
    return Drafter2Config(**dcfg.to_dict(), conv_kernel_size=cfg.conv_kernel_size,
                          conv_group_size=cfg.conv_group_size, selector_top_k=cfg.selector_top_k,
                          selector_rank=cfg.selector_rank)


@torch.no_grad()
def init_output_norm(drafter: DFlashDrafter, head_w: torch.Tensor) -> float:
    """Scale a fresh drafter's final-norm gain to the frozen LM head: gain = 1 / mean row norm of the head, so a
    unit-RMS output state gives logits of standard deviation ~1 (near-uniform predictions).

    Why: at gain 1 a fresh drafter's output is dominated by the MASK embedding, which the head scores with large,
    confidently wrong logits: its first losses sit far above ln V and the first steps are spent undoing that
    (figures: docs/dev-log.md, 'Two observations'). The gain is a parameter and keeps training; resumed or
    `model.drafter_init` drafters are left alone."""
    gain = 1.0 / head_w.float().norm(dim=1).mean().clamp_min(1e-6).item()
    drafter.norm.weight.fill_(gain)
    return gain


# A target decoder layer's parameters that a drafter layer has under the same name (Llama, Qwen2/3, Mistral names;
# q_norm/k_norm only where the target has them: a Llama target leaves the drafter's at ones).
_LAYER_PARAMS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")


FINAL_NORM = "model.norm.weight"


def source_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a drafter's layers start from: the last ones, in order (they already turn hidden states
    into what the final norm and the LM head read); every target layer, repeating the last, if the drafter is
    deeper than the target."""
    first = max(0, num_target_layers - num_draft_layers)
    return [min(first + i, num_target_layers - 1) for i in range(num_draft_layers)]


def _target_layer_tensors(target: str | None, layers: list[int]) -> dict[str, torch.Tensor]:
    """`model.layers.<i>.<param>` tensors of the target for the layers wanted, fp32 on the CPU: read from the
    directory's safetensors files alone where it has them (a large target is never loaded whole), else (a GGUF file,
    .bin weights) from the model loaded on the CPU."""
    path = resolve_target_path(target)
    wanted = {f"model.layers.{i}.{p}" for i in set(layers) for p in _LAYER_PARAMS} | {FINAL_NORM}
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        from safetensors import safe_open

        out = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k).float() for k in st.keys() if k in wanted})
        return out
    state = load_causal_lm(target, "cpu", torch.float32).state_dict()
    return {k: v for k, v in state.items() if k in wanted}


@torch.no_grad()
def init_layers_from_target(drafter: DFlashDrafter, target: str | None) -> list[int]:
    """model.drafter_layer_init=target: start each drafter layer from one of the target's last layers
    (source_layers), its final norm from the target's, and the context projection `fc` from the identity on the
    deepest tapped layer, so that the copied attention first reads the context much as the target's own layer read
    its hidden states (init_output_norm is then not applied: the copied norm already suits the LM head). Parameters the
    target lacks (q_norm/k_norm of a Llama target) keep their fresh values. Returns the target layers copied.

    Raises ConfigError when a copied tensor's shape differs (a drafter sized unlike its target, e.g. by
    model.intermediate_size) or when the target's weights carry no layer parameters under the usual names."""
    cfg = drafter.config
    layers = source_layers(cfg.num_target_layers, cfg.num_hidden_layers)
    tensors = _target_layer_tensors(target, layers)
    copied = 0
    for layer, src in zip(drafter.layers, layers):
        own = dict(layer.named_parameters())
        for p in _LAYER_PARAMS:
            t = tensors.get(f"model.layers.{src}.{p}")
            if t is None or p not in own:
                continue
            if t.shape != own[p].shape:
                raise ConfigError(f"model.drafter_layer_init=target: the target's layer {src} {p} is "
                                  f"{tuple(t.shape)}, the drafter's {tuple(own[p].shape)}; size the drafter like "
                                  "the target (leave model.intermediate_size empty) or set "
                                  "model.drafter_layer_init=random.")
            own[p].copy_(t)
            copied += 1
    if copied == 0:
        raise ConfigError("model.drafter_layer_init=target: the target's weights have no decoder-layer parameters "
                          "under the usual names (model.layers.<i>.self_attn.q_proj.weight, ...); set "
                          "model.drafter_layer_init=random.")
    if FINAL_NORM in tensors and tensors[FINAL_NORM].shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(tensors[FINAL_NORM])
    H, k = cfg.hidden_size, cfg.num_feature_layers
    deepest = max(range(k), key=lambda j: cfg.target_layer_ids[j])  # fc's input is the taps, in target_layer_ids order
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * H:(deepest + 1) * H] = torch.eye(H)
    return layers
