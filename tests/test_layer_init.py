"""model.drafter_layer_init=target: a new drafter's layers start as copies of the target's last layers."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dflash_train.config import ConfigError, load_config
from dflash_train.models.build import build_drafter, init_layers_from_target, source_layers
from dflash_train.models.target import target_config_info
from dflash_train.training.trainer import train_single_device

LAYER_PARAMS = ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight")


def test_source_layers_are_the_target_s_last_in_order():
    assert source_layers(30, 5) == [25, 26, 27, 28, 29]
    assert source_layers(4, 2) == [2, 3]
    assert source_layers(4, 4) == [0, 1, 2, 3]
    assert source_layers(3, 5) == [0, 1, 2, 2, 2]  # deeper than the target: the last layer repeats


def fresh_drafter(target, *overrides):
    cfg = load_config(None, [f"model.target={target}", "model.num_draft_layers=2", "model.mask_token_id=127",
                             *overrides])
    return build_drafter(cfg.model, target_config_info(target))


def test_copies_the_last_layers_the_final_norm_and_the_deepest_tap(tiny_target):
    drafter = fresh_drafter(tiny_target)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    with torch.no_grad():  # norms start at ones: make the target's distinguishable from a fresh drafter's
        for p in hf.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tiny_target + "-normed")
    target = tiny_target + "-normed"

    assert init_layers_from_target(drafter, target) == [2, 3]
    state = hf.state_dict()
    for layer, src in zip(drafter.layers, [2, 3]):
        own = dict(layer.named_parameters())
        for p in LAYER_PARAMS:
            assert torch.equal(own[p], state[f"model.layers.{src}.{p}"]), (src, p)
        q_norm = state.get(f"model.layers.{src}.self_attn.q_norm.weight")  # Qwen3 has it, Llama not
        expect = q_norm if q_norm is not None else torch.ones_like(own["self_attn.q_norm.weight"])
        assert torch.equal(own["self_attn.q_norm.weight"], expect)
    assert torch.equal(drafter.norm.weight, state["model.norm.weight"])

    # fc is the identity on the deepest tapped layer: the context is that layer's output, normed
    cfg = drafter.config
    H, k = cfg.hidden_size, cfg.num_feature_layers
    feats = torch.randn(5, k * H)
    deepest = cfg.target_layer_ids.index(max(cfg.target_layer_ids))
    with torch.no_grad():
        expect = drafter.hidden_norm(feats[:, deepest * H:(deepest + 1) * H])
        assert torch.allclose(drafter.context(feats), expect)


def test_a_drafter_sized_unlike_the_target_is_one_error(tiny_llama):
    drafter = fresh_drafter(tiny_llama, "model.intermediate_size=96")
    with pytest.raises(ConfigError, match="intermediate_size"):
        init_layers_from_target(drafter, tiny_llama)


def test_a_run_starts_from_the_copied_layers(tiny_llama, tmp_path):
    """Through the trainer: the copy reaches the first step, and the output-gain init leaves the copied norm alone
    (one step at a negligible LR, then the checkpoint's fp32 weights against the target's)."""
    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={tmp_path / 'run'}",
                                   "model.drafter_layer_init=target", "train.max_steps=1", "train.lr=1e-12",
                                   "model.num_draft_layers=2"])
    train_single_device(cfg)
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    with safe_open(str(step / "training_weights.safetensors"), "pt") as got, \
            safe_open(f"{tiny_llama}/model.safetensors", "pt") as want:
        assert torch.allclose(got.get_tensor("layers.1.mlp.down_proj.weight"),
                              want.get_tensor("model.layers.3.mlp.down_proj.weight"), atol=1e-6)
        assert torch.allclose(got.get_tensor("norm.weight"), want.get_tensor("model.norm.weight"), atol=1e-6)


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match="drafter_layer_init"):
        load_config(None, ["model.drafter_layer_init=copy"])
