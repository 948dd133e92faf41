"""DFlash 2 drafters: the export loads into the reference DFlash2DraftModel (PyPI `dflash`, a test dependency) key for
key and computes what ours does in fp32; the reference's dflash_generate with our drafter is the target's greedy
output; the block-causal convolution against a naive per-position loop; config checks.
"""

from __future__ import annotations

import json
import time

import dflash.model as ref_dflash  # installed by .ci/run (pip install --no-deps dflash==0.1.0): never skipped
import pytest
import torch

from conftest import make_tiny_target
from dflash_train.config import ConfigError, load_config
from dflash_train.models.build import build_drafter
from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.models.drafter2 import DFlash2Drafter, DynamicCausalConv
from dflash_train.models.target import target_config_info
from dflash_train.training.objective import sdpa_attend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread

B = 4          # block size of the test drafters
N_NEW = 40     # tokens generated in the generation tests
H, V = 64, 128


def make_drafter2(target, *over, seed: int = 0, jitter: float = 0.1) -> DFlash2Drafter:
    """A DFlash 2 drafter for `target` whose convolutions and selector are not at their identity / small init
    (jitter added to every parameter), so that every new parameter matters in a comparison."""
    cfg = load_config(None, [f"model.target={target}", "model.num_draft_layers=2", "model.mask_token_id=127",
                             f"model.block_size={B}", "model.target_layer_ids=[1,2]", "model.architecture=dflash2",
                             "model.selector_top_k=8", "model.selector_rank=12", "model.conv_kernel_size=3",
                             *over])
    torch.manual_seed(seed)
    drafter = build_drafter(cfg.model, target_config_info(target))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * jitter)
    return drafter


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A tiny Llama whose greedy choice is token 0 or 1 (by the sign of one hidden unit), as in test_export.py."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_target(tmp_path_factory.mktemp("biased2"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        hf.model.norm.weight.zero_()
        hf.model.norm.weight[0] = 1.0
        hf.lm_head.weight[:, 0] = 0.0
        hf.lm_head.weight[0, 0], hf.lm_head.weight[1, 0] = 10.0, -10.0
    hf.save_pretrained(path)
    return path


def coin_drafter(drafter: DFlash2Drafter) -> DFlash2Drafter:
    """Final norm gain on hidden unit 0 only: with the biased target's head the drafter's top candidate is token 0 or
    1 (the sign of that unit), far above the rest; drafts are then sometimes accepted, sometimes not."""
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
    return drafter


# ------------------------------------------------------------------------------------------ the model itself

def naive_conv(x, dyn, base, group_size):
    """y[t] = sum_o (base[o] + dyn[t, o, group]) * x[t - o], per position and channel, one block: obviously right."""
    T, Hs = x.shape
    y = torch.zeros_like(x)
    for t in range(T):
        for o in range(base.shape[0]):
            if t - o >= 0:
                for c in range(Hs):
                    y[t, c] += (base[o, c] + dyn[t, o, c // group_size]) * x[t - o, c]
    return y


def test_block_causal_convolution_equals_per_position_loop():
    torch.manual_seed(0)
    conv = DynamicCausalConv(32, kernel_size=3, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_()
    x, dyn = torch.randn(3 * 5, 32), torch.randn(3 * 5, 3, 4)
    got = conv._convolve(x, dyn, conv.base_kernel[0], block_size=5)
    for b in range(3):  # each block alone: nothing crosses a block boundary
        rows = slice(5 * b, 5 * b + 5)
        torch.testing.assert_close(got[rows], naive_conv(x[rows], dyn[rows], conv.base_kernel[0], 8))


def test_fresh_dflash2_layers_compute_what_dflash_layers_do(tiny_llama):
    """Identity init of the convolutions: a fresh DFlash 2 drafter with the v1 drafter's weights is the v1 drafter."""
    from dflash_train.models.drafter import DFlashDrafter

    fresh = make_drafter2(tiny_llama, jitter=0.0)
    v1 = DFlashDrafter(fresh.config)
    missing, unexpected = v1.load_state_dict(fresh.state_dict(), strict=False)
    assert not missing and unexpected and all("conv" in k or "selector" in k for k in unexpected)
    S = 6
    feats, x = torch.randn(S, 2 * H), torch.randn(2 * B, H)
    attend = sdpa_attend(torch.ones(2 * B, S + 2 * B, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, torch.arange(S, S + 2 * B), feats, torch.arange(S), attend),
                                   v1(x, torch.arange(S, S + 2 * B), feats, torch.arange(S), attend))


# ------------------------------------------------------------------------------------------ export vs the reference

def test_export_loads_into_reference_key_for_key_and_matches_fp32(tiny_qwen3, tmp_path):
    drafter = make_drafter2(tiny_qwen3)
    out = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["is_causal"] is False
    assert conf["dflash_config"] | {} == {"target_layer_ids": [1, 2], "mask_token_id": 127, "block_size": B,
                                         "conv_kernel_size": 3, "conv_group_size": 16, "selector_top_k": 8,
                                         "selector_rank": 12}
    ref, info = ref_dflash.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref_state = ref.state_dict()
    ours = drafter.state_dict()
    for k, v in ours.items():  # every value arrived (the codebooks through the reference's key mapping)
        rk = k + ".weight" if k.endswith("_codebook") else k
        assert torch.equal(ref_state[rk], v), k
    assert len(ref_state) == len(ours)
    # The same function: one block after S context tokens.
    S = 7
    feats, x, pos = torch.randn(1, S, 2 * H), torch.randn(1, B, H), torch.arange(S + B)[None]
    with torch.no_grad():
        want = drafter(x[0], pos[0, S:], feats[0], pos[0, :S], sdpa_attend(torch.ones(B, S + B, dtype=torch.bool)))
        got = ref(position_ids=pos, noise_embedding=x, target_hidden=feats)[0]
        torch.testing.assert_close(got, want)
        # The same drafts: the selector's left-to-right choice among the top-k of the same logits.
        logits = torch.randn(B - 1, V) * 3
        anchor = torch.tensor([11])
        ours_drafts, ours_cand, _ = drafter.candidate_selector.select(want[1:], logits, anchor)
        ref_drafts, _, _ = ref.candidate_selector.select(want[None, 1:], logits[None], anchor, 0.0)
        assert ours_drafts.tolist() == ref_drafts[0].tolist()
        # At a temperature: the same distribution over the same candidates, given the same earlier drafts.
        torch.manual_seed(3)
        d_t, cand_t, q_t = drafter.candidate_selector.select(want[1:], logits, anchor, temperature=0.7)
        prev = torch.cat([anchor, d_t[:-1]])
        for k in range(B - 1):
            s = ref.candidate_selector
            unary = logits[k, cand_t[k]]
            ref_scores = unary + torch.einsum("r,kr->k", s.predecessor_codebook(prev[k]) * s.hidden_projection(want[k + 1]),
                                              s.successor_codebook(cand_t[k]))
            torch.testing.assert_close(q_t[k], torch.softmax(ref_scores / 0.7, -1))
    back = load_drafter(out)  # and the project reads its own export back
    assert isinstance(back, DFlash2Drafter) and back.config == drafter.config
    for k, v in ours.items():
        assert torch.equal(back.state_dict()[k], v), k


def test_reference_dflash_generate_with_our_drafter_is_target_greedy(biased_llama, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = save_drafter(coin_drafter(make_drafter2(biased_llama)), tmp_path / "d", dtype=torch.float32)
    ref = ref_dflash.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    monkeypatch.setattr(ref_dflash, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA; this is CPU
    steps = []
    for prompt in ([[5, 9, 17, 33, 2, 8]], [[3]], [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]):
        prompt = torch.tensor(prompt)
        greedy = target.generate(prompt, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        spec = ref_dflash.dflash_generate(ref, target, prompt, N_NEW, None, block_size=B, return_stats=True)
        assert spec.output_ids.tolist() == greedy.tolist()
        steps += spec.acceptance_lengths
    assert max(steps) > 1 and min(steps) < B  # drafts accepted and rejected: the cache crops ran


# ------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("over, needle", [
    (["model.architecture=dflash3"], "model.architecture"),
    (["model.conv_kernel_size=5"], "model.conv_kernel_size"),          # > block_size 4
    (["model.selector_top_k=0"], "model.selector_top_k"),
])
def test_bad_dflash2_sizes_are_one_config_error(tiny_llama, over, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [f"model.target={tiny_llama}", "model.block_size=4", "model.architecture=dflash2", *over])


@pytest.mark.parametrize("over, needle", [
    (["model.conv_group_size=24"], "does not divide the target's hidden size 64"),
    (["model.selector_top_k=129"], "exceeds the target vocabulary"),
])
def test_dflash2_sizes_that_do_not_fit_the_target_are_refused(tiny_llama, over, needle):
    with pytest.raises(ConfigError, match=needle):
        make_drafter2(tiny_llama, *over)
