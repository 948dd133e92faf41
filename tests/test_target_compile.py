"""model.target_compile: the target's feature forward compiled by torch.compile at fixed shapes (models/target.py
FeatureForward) equals the eager forward on every document layout, never recompiles for a new layout, compiles in
the target worker's thread, and trains the pipeline to the eager run's losses.

Which compiler: inductor's C++ code generation takes 45-90 s per graph on a cold 2-core CPU, so most tests compile
with the aot_eager backend as a stand-in (dynamo's capture and AOT autograd's graph, which inductor would receive,
run without code generation); one slow test compiles with inductor itself (mode default, as a run does)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from dflash_train.cli import main
from dflash_train.config import ConfigError, load_config
from dflash_train.data.packing import Sample, pack_samples
from dflash_train.models.target import FeatureForward, load_target
from dflash_train.pipeline.coordinator import train_pipeline
from dflash_train.training.cudagraphs import configure_cudagraphs

T = 192
# Document lengths per row: three that fill it, one document, many short ones and padding, two and padding.
LAYOUTS = [(100, 60, 32), (T,), (1, 2, 3, 50, 7, 64), (130, 40)]


def packed(lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    docs = [Sample(torch.randint(0, 128, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    (row,) = pack_samples(docs, T)  # padding (document id -1) after the documents when they fall short
    return row.input_ids, row.position_ids, row.doc_ids


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from an empty dynamo cache: TargetModel.features is one code object, and entries left by
    other tests would count toward its recompile limit (past it dynamo runs the function eagerly, silently)."""
    configure_cudagraphs()  # the policy a run applies at start-up
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("layers", [False, True], ids=["forward", "each-layer"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_compiled_forward_equals_eager_on_every_layout_without_recompiling(tiny_target, attention, layers):
    """fp32, aot_eager stand-in: one graph, no graph break, then the other layouts with recompiling an error. With
    model.target_compile_layers the one graph is a decoder layer's, serving every layer (the taps' hooks outside)."""
    target = load_target(tiny_target, [1, 3], attention=attention)
    rows = [packed(lens, seed=i) for i, lens in enumerate(LAYOUTS)]
    eager = [target.features(*row) for row in rows]  # first: eager flex compiles its own kernel (transformers)
    compiled = FeatureForward(target, T, compile="default", backend="aot_eager", layers=layers)
    before, breaks = graphs_compiled(), sum(counters["graph_break"].values())
    outs = [compiled(*rows[0])]  # compiles
    assert graphs_compiled() - before == 1 and sum(counters["graph_break"].values()) == breaks
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs += [compiled(*row) for row in rows[1:]]
    assert graphs_compiled() - before == 1
    for out, ref in zip(outs, eager):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inductor_compiled_forward_equals_eager(tiny_qwen3):
    """The real compiler of a run (inductor, mode default, C++ kernels on CPU) on the flex path, whose document mask
    (doc_causal_block_mask) is lowered into the graph too: the same features, fp32, on two layouts. One tap on the
    first layer: the forward stops after the last tap (truncate), and each layer inductor lowers costs ~9 s of CPU
    (the aot_eager tests above run all four, with several taps)."""
    target = load_target(tiny_qwen3, [0], attention="flex")
    compiled = FeatureForward(target, T, compile="default")
    with_pad, many = packed(LAYOUTS[3], seed=0), packed(LAYOUTS[2], seed=1)
    torch.testing.assert_close(compiled(*with_pad), target.features(*with_pad), atol=1e-5, rtol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(*many), target.features(*many), atol=1e-5, rtol=1e-5)


def test_a_row_of_another_length_is_refused_not_recompiled(tiny_llama):
    compiled = FeatureForward(load_target(tiny_llama, [1, 3]), T, compile="default", backend="aot_eager")
    with pytest.raises(ValueError, match=f"rows of {T}"):
        compiled(torch.zeros(T // 2, dtype=torch.long), torch.arange(T // 2), torch.zeros(T // 2, dtype=torch.long))


def pipeline_losses(tiny_llama, out, target_compile: str, *more: str) -> list[float]:
    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={out}", "train.max_steps=4",
                                   "train.log_every=1", f"model.target_compile={target_compile}", *more])
    res = train_pipeline(cfg)
    assert res.steps == 4
    return [h["loss"] for h in res.history]


@pytest.mark.parametrize("layers", [False, True], ids=["forward", "each-layer"])
def test_pipeline_trains_to_the_eager_losses_compiling_in_the_target_thread(tiny_llama, tmp_path, monkeypatch,
                                                                            layers):
    """model.target_compile=default through the whole pipeline (aot_eager stand-in for inductor, recorded): one
    compile, at fixed shapes, in the target worker's thread; the recompile guard is armed with it, so any rows'
    recompile would have failed the run; the losses are the eager run's to 1e-5 (the same fp32 ops, traced). With
    model.target_compile_layers the one compile is a decoder layer's, for every layer."""
    compiles: list[tuple[str, dict]] = []
    real_compile, aot_eager = torch.compile, lookup_backend("aot_eager")
    # One backend object per set of arguments, as inductor's (its wrappers of one mode compare equal): dynamo reuses
    # a layer's compiled graph for the other layers only under an equal backend (model.target_compile_layers).
    backends = {}

    def recording_compile(fn, **kw):
        def backend(gm, example_inputs):
            compiles.append((threading.current_thread().name, kw))
            return aot_eager(gm, example_inputs)
        return real_compile(fn, dynamic=kw["dynamic"], backend=backends.setdefault(repr(sorted(kw.items())), backend))

    eager = pipeline_losses(tiny_llama, tmp_path / "eager", "eager")
    monkeypatch.setattr(torch, "compile", recording_compile)
    compiled = pipeline_losses(tiny_llama, tmp_path / "compiled", "default", f"model.target_compile_layers={layers}")
    assert compiles == [("dflash-target0", {"dynamic": False, "mode": "default"})]
    assert ("compile default, each layer, CUDA graph off" in (tmp_path / "compiled" / "run.log").read_text()) == layers
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def test_target_compile_config_errors_are_one_sentence(tiny_llama, tmp_path, capsys):
    assert load_config(None, []).model.target_compile == "eager"  # until a GPU measurement says otherwise
    assert load_config(None, ["model.target_compile=max-autotune-no-cudagraphs"]).model.target_compile \
        == "max-autotune-no-cudagraphs"
    with pytest.raises(ConfigError, match="must be one of eager, default, max-autotune-no-cudagraphs"):
        load_config(None, ["model.target_compile=inductor"])
    code = main(["train", "--config", "tiny_cpu", f"model.target={tiny_llama}", f"run.out_dir={tmp_path}/r",
                 "model.target_compile=reduce-overhead"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "set model.target_compile=default and model.target_graphs=true" in err[0]
    with pytest.raises(ConfigError, match="model.target_compile_layers=true compiles the target's layers in model."
                                          "target_compile's mode, which is eager: set model.target_compile=default"):
        load_config(None, ["model.target_compile_layers=true"])
