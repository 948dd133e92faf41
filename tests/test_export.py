"""Serve-ready drafters: the checkpoint contract (config keys, weight names, shapes, dtypes), exact fp32 resume beside
the bf16 export, the transformers trust_remote_code path in a process that cannot import the project, the reference
DFlash package as an oracle, and the tap rule every engine can capture."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import RUN_HANG_GUARD_S
from dflash_train.config import ConfigError, load_config
from dflash_train.models.build import build_drafter, resolve_layer_ids
from dflash_train.models.checkpoint import (TRAINING_WEIGHTS_NAME, CheckpointError, load_drafter, save_drafter)
from dflash_train.models.target import TargetInfo, default_layer_ids, target_config_info
from dflash_train.training.checkpointing import CheckpointManager
from dflash_train.training.objective import sdpa_attend

B = 4          # block size of the test drafters
N_NEW = 40     # tokens generated in the generation tests


def make_drafter(target, *over):
    cfg = load_config(None, [f"model.target={target}", "model.num_draft_layers=2", "model.mask_token_id=127",
                             f"model.block_size={B}", "model.target_layer_ids=[1,2]", *over])
    return build_drafter(cfg.model, target_config_info(target))


def always_zero(drafter):
    """The same drafter with a zero final norm: its hidden is 0, every logit 0, argmax token 0."""
    with torch.no_grad():
        drafter.norm.weight.zero_()
    return drafter


def test_export_contract(tiny_qwen3, tmp_path):
    drafter = make_drafter(tiny_qwen3)
    out = save_drafter(drafter, tmp_path / "d")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["torch_dtype"] == conf["dtype"] == "bfloat16"
    assert conf["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert conf["block_size"] == B and conf["num_target_layers"] == 4
    assert conf["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 127, "block_size": B}
    assert conf["layer_types"] == ["full_attention"] * 2 and conf["num_hidden_layers"] == 2
    H, d, h, hkv, I = 64, 16, 4, 2, 128
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h * d, H), p + "self_attn.k_proj.weight": (hkv * d, H),
                   p + "self_attn.v_proj.weight": (hkv * d, H), p + "self_attn.o_proj.weight": (H, h * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I),
                   p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in got.items()} == shapes
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    # A reload gives back exactly the bf16 values: the fp32 weights rounded once.
    back = load_drafter(out)
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16)), k
    serve = (out / "serve.txt").read_text()
    assert f'"num_speculative_tokens": {B - 1}' in serve and "--speculative-algorithm DFLASH" in serve
    assert (out / "modeling_dflash.py").is_file()


class _Opt:
    """Stands in for an optimizer / scheduler: CheckpointManager only calls state_dict()."""

    def state_dict(self):
        return {}


def test_step_checkpoint_resumes_the_fp32_weights_bit_for_bit(tiny_llama, tmp_path):
    drafter = make_drafter(tiny_llama)
    with torch.no_grad():  # values bf16 cannot hold: a resume from the servable copy would differ
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    ckpt = CheckpointManager(tmp_path, run_id="r")
    path = ckpt.save(3, drafter, _Opt(), _Opt(), data_position=6)
    assert ckpt.wait() == path  # written in the background: complete once wait() returns
    assert load_file(str(path / TRAINING_WEIGHTS_NAME))["fc.weight"].dtype == torch.float32
    back, state, found = ckpt.load_latest()
    assert found == path and state["step"] == 3
    for k, v in drafter.state_dict().items():
        assert back.state_dict()[k].dtype == torch.float32 and torch.equal(back.state_dict()[k], v), k
    # A servable copy that is not the rounding of the training weights marks a damaged checkpoint.
    w = load_file(str(path / "model.safetensors"))
    w["norm.weight"] = w["norm.weight"] + 1
    save_file(w, str(path / "model.safetensors"))
    assert ckpt.load_latest() is None
    with pytest.raises(CheckpointError, match="is not the rounding of"):
        from dflash_train.training.checkpointing import load_training_weights
        load_training_weights(path)


def test_reference_dflash_package_loads_the_export_and_generates_greedy(biased_llama, tmp_path, monkeypatch):
    """The reference DFlash model (PyPI `dflash`) as an oracle: no missing or unexpected keys, the same output as
    ours in fp32, and its dflash_generate with our drafter equals the target's greedy output."""
    dflash = pytest.importorskip("dflash.model")
    from transformers import AutoModelForCausalLM

    out = save_drafter(always_zero(make_drafter(biased_llama)), tmp_path / "d")
    ref, info = dflash.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = load_drafter(out).float()
    S, N, H = 7, B, 64
    feats, x, pos = torch.randn(1, S, 2 * H), torch.randn(1, N, H), torch.arange(S + N)[None]
    with torch.no_grad():
        want = ours(x[0], pos[0, S:], feats[0], pos[0, :S], sdpa_attend(torch.ones(N, S + N, dtype=torch.bool)))
        got = ref(position_ids=pos, noise_embedding=x, target_hidden=feats)[0]
    torch.testing.assert_close(got, want)
    target = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 9, 17, 33, 2, 8]])
    greedy = target.generate(prompt, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA; this is CPU
    spec = dflash.dflash_generate(ref, target, prompt, N_NEW, None, block_size=B, return_stats=True)
    assert spec.output_ids.tolist() == greedy.tolist()
    assert max(spec.acceptance_lengths) > 1  # the drafts were accepted at times: not a trivially rejecting drafter


CLEAN_SCRIPT = r'''
import sys

class Refuse:  # the project and the reference package cannot be imported here, however they are installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dflash_train", "dflash"):
            raise ImportError(f"{name} is refused in this process")

sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModel, AutoModelForCausalLM

drafter_dir, zero_dir, target_dir, io = sys.argv[1:5]
inp = torch.load(io + "/in.pt")
drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True, dtype=torch.float32)
zero = AutoModel.from_pretrained(zero_dir, trust_remote_code=True, dtype=torch.float32)
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
prompt = inp["prompt"]
with torch.no_grad():
    out = {"hidden": drafter(noise_embedding=inp["x"], target_hidden=inp["feats"], position_ids=inp["pos"]),
           "class": type(drafter).__module__ + "." + type(drafter).__name__}
    ids = prompt
    for _ in range(inp["n"]):  # the target's own greedy output, the plain way
        ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
out["greedy"] = ids


def cache_error(model, result):
    """Largest gap between the context K the drafter saw at each step and a from-scratch K over the final
    sequence (the target's features of every position before the block)."""
    ids = result[0]
    with torch.no_grad():
        feats = model._features(target(ids, output_hidden_states=True).hidden_states)
        full_k = model.context_kv(feats, torch.arange(ids.shape[1]))[0][0]
    assert all(k.shape[2] == start for start, k in seen) and seen
    return max(float((k - full_k[:, :, :start]).abs().max()) for start, k in seen)


seen = []
for m in (drafter, zero):
    block = m.forward_block
    m.forward_block = lambda emb, pos, kv, block=block: seen.append((int(pos[0]), kv[0][0])) or block(emb, pos, kv)
out["random"] = drafter.spec_generate(target, prompt, inp["n"], return_acceptance=True)
out["random_cache_error"] = cache_error(drafter, out["random"])
seen.clear()
out["zero"] = zero.spec_generate(target, prompt, inp["n"], return_acceptance=True)
out["zero_cache_error"] = cache_error(zero, out["zero"])
out["random"], out["random_acc"] = out["random"]
out["zero"], out["zero_acc"] = out["zero"]
out["stopped"] = zero.spec_generate(target, prompt, inp["n"], stop_token_ids=[1])
torch.save(out, io + "/out.pt")
'''


def test_trust_remote_code_drafter_in_a_process_that_cannot_import_the_project(biased_llama, tmp_path):
    drafter = make_drafter(biased_llama)
    d = save_drafter(drafter, tmp_path / "drafter")
    z = save_drafter(always_zero(make_drafter(biased_llama)), tmp_path / "zero")
    io = tmp_path / "io"
    io.mkdir()
    S, H = 9, 64
    inp = {"x": torch.randn(1, B, H), "feats": torch.randn(1, S, 2 * H), "pos": torch.arange(S + B)[None],
           "prompt": torch.tensor([[5, 9, 17, 33, 2, 8]]), "n": N_NEW}
    torch.save(inp, io / "in.pt")
    (tmp_path / "clean.py").write_text(CLEAN_SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-I", str(tmp_path / "clean.py"), str(d), str(z), biased_llama, str(io)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_HANG_GUARD_S)
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(io / "out.pt")
    assert out["class"].endswith("modeling_dflash.DFlashDraftModel")
    ours = load_drafter(d).float()  # the bf16 export, as the subprocess loaded it
    with torch.no_grad():
        want = ours(inp["x"][0], inp["pos"][0, S:], inp["feats"][0], inp["pos"][0, :S],
                    sdpa_attend(torch.ones(B, S + B, dtype=torch.bool)))
    torch.testing.assert_close(out["hidden"][0], want)
    greedy = out["greedy"].tolist()
    assert out["random"].tolist() == greedy and out["zero"].tolist() == greedy
    assert max(out["zero_acc"]) == B and min(out["zero_acc"]) == 1  # full blocks and rejections both ran
    assert len(set(out["zero_acc"])) > 2                             # and partial acceptances
    # The drafter's cached context (extended by the accepted tokens only) is what a from-scratch pass computes.
    assert out["random_cache_error"] < 1e-4 and out["zero_cache_error"] < 1e-4
    new = greedy[0][6:]
    assert 1 in new, "the biased target should produce token 1 within the test's tokens"
    assert out["stopped"].tolist()[0] == greedy[0][: 6 + new.index(1) + 1]


# ---------------------------------------------------------------------------------------------------------- taps
def _info(L: int) -> TargetInfo:
    return TargetInfo(hidden_size=64, intermediate_size=128, num_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=512, model_type="llama")


def test_default_taps_never_repeat_and_never_reach_the_last_layer():
    for L in range(2, 64):
        for k in range(1, 8):
            ids = default_layer_ids(L, k)
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= L - 2, (L, k, ids)
            assert len(ids) == k or L - 3 < k, (L, k, ids)  # fewer only where 1..L-3 has no room
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # deep targets: the DFLASH.md rule unchanged
    assert default_layer_ids(4, 5) == [1] and default_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_layer_ids(3, 5) == [0] and default_layer_ids(2, 1) == [0]


def test_shallow_target_gets_fewer_taps_with_a_log_line(caplog):
    cfg = load_config(None, ["model.num_feature_layers=5"])
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert resolve_layer_ids(cfg.model, _info(6)) == [1, 2, 3]
    assert any("room for 3 distinct" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("ids, needle", [("[1,1,2]", "repeat|distinct"), ("[1,3]", "within 0..2")])
def test_explicit_taps_that_no_engine_can_capture_are_refused(ids, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        resolve_layer_ids(load_config(None, [f"model.target_layer_ids={ids}"]).model, _info(4))
    assert str(e.value).count(". ") == 0 and "model.target_layer_ids" in str(e.value)


def test_mask_token_text_is_exported_when_the_tokenizer_has_it(tiny_llama, tmp_path):
    from tiny_chat import make_byte_tokenizer

    tok = make_byte_tokenizer()
    cfg = load_config(None, [f"model.target={tiny_llama}", "model.mask_token_id=5", "model.target_layer_ids=[1]"])
    out = save_drafter(build_drafter(cfg.model, target_config_info(tiny_llama), tok), tmp_path / "d")
    dc = json.loads((out / "config.json").read_text())["dflash_config"]
    assert dc["mask_token_id"] == 5 and dc["mask_token"] == tok.convert_ids_to_tokens(5)
    again = save_drafter(load_drafter(out), tmp_path / "again")  # a reload keeps it for the next export
    assert json.loads((again / "config.json").read_text())["dflash_config"] == dc
    # Without a tokenizer there is no text to write: the field is left out.
    out = save_drafter(build_drafter(cfg.model, target_config_info(tiny_llama)), tmp_path / "none")
    assert "mask_token" not in json.loads((out / "config.json").read_text())["dflash_config"]


@pytest.mark.parametrize("where", ["dflash_config", "top"])
@pytest.mark.parametrize("key, value", [("input_embedding_scale", 8.0), ("output_multiplier", 0.5),
                                        ("final_logit_softcapping", 30.0)])
def test_a_drafter_config_the_reference_scales_is_refused(tiny_llama, tmp_path, key, value, where):
    """The reference scales a drafter's input embeddings and logits by these settings (read from dflash_config,
    else the top level); dflash-train applies none, so a foreign drafter that sets them is refused by name. Our own
    exports, and the neutral values, load."""
    out = save_drafter(make_drafter(tiny_llama), tmp_path / "d", dtype=torch.float32)
    load_drafter(out)
    conf = json.loads((out / "config.json").read_text())
    neutral = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}[key]
    (conf["dflash_config"] if where == "dflash_config" else conf)[key] = neutral
    (out / "config.json").write_text(json.dumps(conf))
    load_drafter(out)
    (conf["dflash_config"] if where == "dflash_config" else conf)[key] = value
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=f"sets {key}={value}, which dflash-train's drafters do not apply"):
        load_drafter(out)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16},
])
def test_a_drafter_config_with_rope_scaling_is_refused_or_run_as_the_reference_runs_it(tiny_llama, tmp_path,
                                                                                       rope_scaling):
    """A drafter directory whose config.json scales RoPE (a released drafter for a Llama 3.1 or YaRN target: the
    reference's Qwen3RotaryEmbedding applies the scaling) must not be read as plain RoPE: loading it either computes
    what the reference does or is refused, naming the setting."""
    dflash = pytest.importorskip("dflash.model")
    out = save_drafter(make_drafter(tiny_llama), tmp_path / "d", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    conf["rope_scaling"] = rope_scaling
    (out / "config.json").write_text(json.dumps(conf))
    ref = dflash.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    S, N, H = 40, B, 64
    feats, x, pos = torch.randn(1, S, 2 * H), torch.randn(1, N, H), torch.arange(S + N)[None]
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=x, target_hidden=feats)[0]
    try:
        ours = load_drafter(out).float()
    except CheckpointError as e:
        assert "rope" in str(e)
        return
    with torch.no_grad():
        got = ours(x[0], pos[0, S:], feats[0], pos[0, :S], sdpa_attend(torch.ones(N, S + N, dtype=torch.bool)))
    torch.testing.assert_close(got, want)
