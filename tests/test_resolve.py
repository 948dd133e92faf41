"""Every device-dependent "auto" is decided once, by devices.resolve_config, and the stages only see concrete values."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dflash_train.config import Config, ModelConfig, PipelineConfig, TrainConfig, load_config
from dflash_train.devices import AUTO, choose, compute_dtype, parse_device, resolve_config
from dflash_train.models.drafter import DFlashDrafter, DrafterConfig
from dflash_train.training.step import DrafterStep

SRC = Path(__file__).resolve().parents[1] / "src" / "dflash_train"
CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


def test_auto_is_the_cuda_choice_only_when_every_device_is_cuda():
    for key, (on_cuda, elsewhere) in AUTO.items():
        assert choose(key, "auto", [CUDA0, CUDA1]) == on_cuda
        assert choose(key, "auto", [CPU]) == elsewhere
        assert choose(key, "auto", [CUDA0, CPU]) == elsewhere  # a mixed set gets the choice that works everywhere
    assert choose("compile", "default", [CUDA0]) == "default"   # a value the user wrote is kept
    assert (compute_dtype("auto", CUDA0), compute_dtype("auto", CPU)) == (torch.bfloat16, torch.float32)
    assert compute_dtype("bf16", CPU) == torch.bfloat16


def test_resolve_config_replaces_every_auto_and_keeps_the_rest():
    cfg = load_config(None, ["train.attention=flex"])          # devices, compile, dtype, target attention: auto
    resolved = resolve_config(cfg)
    here = parse_device("auto", "test")                       # cuda:0 on a GPU machine, else cpu
    t, m, p = resolved.train, resolved.model, resolved.pipeline
    assert (t.compile, t.attention, t.dtype) == (choose("compile", "auto", [here]), "flex",
                                                 choose("dtype", "auto", [here]))
    assert m.target_attention == choose("attention", "auto", [here])
    assert p.target_devices == p.drafter_devices == [str(here)]
    assert "auto" not in (t.compile, t.attention, t.dtype, m.target_attention, *p.target_devices, *p.drafter_devices)
    assert resolve_config(resolved) == resolved                                  # nothing left to decide
    assert cfg.train.compile == "auto" and cfg.pipeline.drafter_devices == ["auto"]  # the config as written stays


def test_the_single_loop_decides_target_attention_for_its_one_device():
    cfg = Config(model=ModelConfig(target_attention="auto"),
                 pipeline=PipelineConfig(target_devices=["cpu"], drafter_devices=["cpu"]))
    assert resolve_config(cfg, single=True).pipeline.target_devices == ["cpu"]
    assert resolve_config(cfg, single=True).model.target_attention == "sdpa"


def test_a_step_refuses_an_unresolved_config():
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=64, target_layer_ids=[0],
                         num_target_layers=1, mask_token_id=63, block_size=4)
    embed = torch.zeros(64, 32)
    with pytest.raises(ValueError, match="resolved TrainConfig"):
        DrafterStep(DFlashDrafter(dcfg), embed, embed, TrainConfig(), CPU)
    step = DrafterStep(DFlashDrafter(dcfg), embed, embed, TrainConfig(compile="eager", attention="sdpa", dtype="fp32"),
                       CPU)
    assert (step.compile_mode, step.attention, step.dtype) == ("eager", "sdpa", torch.float32)


# Where the package may still compare a value with "auto", and why it is not a device choice decided elsewhere.
ALLOWED = {
    "devices.py": "the one place: device names and resolve_config",
    "doctor.py": "its own --compile flag (on CPU it checks 'default' when a C++ compiler exists)",
    "cli.py": "regenerate --batch-size auto: sized from the loaded models' free memory (engine.batch_size_for)",
    "config.py": "run.resume=auto is a mode (resume if a checkpoint exists), not a device choice",
    "training/checkpointing.py": "run.resume=auto",
    "training/rundir.py": "run.resume=auto",
    "training/step.py": "the refusal of an unresolved config",
}


def test_auto_is_compared_only_where_it_is_decided():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "auto"
                                                     for c in [node.left, *node.comparators]):
                found.setdefault(path.relative_to(SRC).as_posix(), []).append(f"{node.lineno}: {ast.unparse(node)}")
    assert "devices.py" in found and "training/step.py" in found                 # the scan sees comparisons
    stray = {f: lines for f, lines in found.items() if f not in ALLOWED}
    assert not stray, f"'auto' decided outside devices.resolve_config: {stray}"
