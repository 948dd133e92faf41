"""Tiny randomly initialised targets (Llama and Qwen3 shapes) saved as local HF directories: seconds on CPU."""

from __future__ import annotations

import getpass
import os
import random
import tempfile

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor on CPU first dry-compiles a probe per vector ISA (AVX-512, AVX2, ...) with g++ and dlopens each in a child
# process: about 11 s of CPU in every process that compiles (each pytest-xdist worker, the benchmark smoke, the
# warm-up child, CLI runs), whatever cache directory it uses. This takes the ISAs /proc/cpuinfo lists as buildable
# instead (a compiler that could not build them fails the inductor tests loudly). Inherited by the subprocesses.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# One compile cache for the whole suite, shared by every pytest-xdist worker and subprocess (inductor's FX graph and
# AOT autograd caches write atomically): the tiny drafter steps and target forwards that many tests compile at the
# same shapes compile once a suite, not once a test (a run points inductor at <out_dir>/../.cache/torch_compile
# unless TORCHINDUCTOR_CACHE_DIR is set: training/startup.py). Tests of a cold start clear it for themselves (the
# no_env fixture below). Under the system's temp directory, like inductor's own default, so a second suite run on
# the same machine starts warm too.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"dflash-train-tests-compile-cache-{getpass.getuser()}"))
# Tiny models are launch-bound, and three pytest-xdist workers share the cores (pyproject.toml): a second intra-op
# thread per test process only spins against the other workers (10x slower on a loaded 2-core box). One thread in
# every test process, run alone (-k, -n 0) or in the suite alike; the pipeline still sets its own workers' counts.
torch.set_num_threads(1)

# Hang guards, not speed limits (speed is the benchmarks' business): 10x and more the normal time on an idle 2-core
# box, so that a busy machine never trips one. pytest-timeout (pyproject.toml) guards each test as a whole.
RUN_HANG_GUARD_S = 300   # a CLI or torchrun subprocess run by a test: seconds to tens of seconds
STOP_HANG_GUARD_S = 60   # a process or pipeline stopping after a signal, a kill or a peer's failure: about a second

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)


def make_tiny_target(path, kind: str = "llama", seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(TINY, **overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=False))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=16, tie_word_embeddings=True))
    else:
        raise ValueError(kind)
    model.save_pretrained(path)
    return str(path)


def pytest_collection_finish(session):
    """Everything the imports made (torch, transformers, the package: most of a worker's ~650k objects) frozen out
    of the collector's reach, once per worker, and the collector declared the suite's (training/heap.py): each
    training run a test starts then skips its own collect-and-freeze, which walked this whole heap, 0.3-0.8 s of CPU
    a run on the 2-core box, a hundred-odd runs a suite."""
    import gc

    from dflash_train.training.heap import leave_gc_to_caller

    gc.collect()
    gc.freeze()
    leave_gc_to_caller()


def pytest_collection_modifyitems(config, items):
    """The slow integration tests (marker `slow`: tens of seconds each) run first, the rest after them in file order.
    pytest-xdist hands tests out in collection order (pyproject.toml: --maxschedchunk 1, a worker holds at most two
    at a time), so the long ones start while the short ones fill the other workers around them, instead of the
    slowest (tests/test_warmup.py's, last by name) starting near the end with the other workers idle. Every worker
    sorts the same collection the same way (a stable sort), as xdist requires; fixed_seed keeps each test's
    numbers independent of the order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def fixed_seed():
    """Every test starts from the same RNG state: it draws the same numbers run alone (-k) as in the whole suite."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def root_log_handlers():
    """The root logger's handlers as they were before the test. cli.main (run in-process by some tests) points them
    at sys.stdout, which is pytest's capture of that one test: left in place, a later test's log record in the same
    worker goes to a closed file ("--- Logging error ---")."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture
def thawed_heap():
    """The heap as a plain process has it (nothing frozen, the collector frozen_heap's: pytest_collection_finish
    above undone), frozen and the suite's again after."""
    import gc

    from dflash_train.training.heap import leave_gc_to_caller

    gc.unfreeze()
    leave_gc_to_caller(False)
    yield
    gc.freeze()
    leave_gc_to_caller()


@pytest.fixture
def no_env(monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR unset here and restored afterwards (use_compile_cache sets it process-wide)."""
    from dflash_train.training.startup import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    return monkeypatch


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


# tests/test_demo.py compares the converted SmolLM2's logits on these tokens with the GGUF-loaded model's
SMOLLM2_PROBE_IDS = [[1, 540, 2017, 314, 253, 1695, 30]]
SMOLLM2_GGUF_LOGITS = "smollm2_gguf_logits.pt"  # beside the converted directory


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The embedded SmolLM2 GGUF converted once into a Hugging Face directory, as the demo does (that the logits stay
    identical is tests/test_demo.py's). Every GGUF parse dequantizes all tensors and rebuilds the tokenizer (~30 s of
    CPU): the real-model tests share this one, across pytest-xdist workers too (the first converts, the others wait
    on the lock and find the finished directory). The model the conversion loads from the GGUF also leaves its
    logits on SMOLLM2_PROBE_IDS in SMOLLM2_GGUF_LOGITS, so that the exactness check needs no second parse."""
    from filelock import FileLock

    import dflash_train.models.target as target_module
    from dflash_train.demo import local_embedded_target

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own base temp; their parent is shared
        root = root.parent
    cache_root = root / "smollm2_cache"
    real_load = target_module.load_causal_lm

    def load_and_record_logits(target, *args, **kwargs):
        hf = real_load(target, *args, **kwargs)
        with torch.no_grad():
            cache_root.mkdir(exist_ok=True)
            torch.save(hf(torch.tensor(SMOLLM2_PROBE_IDS)).logits, cache_root / SMOLLM2_GGUF_LOGITS)
        return hf

    with FileLock(str(root / "smollm2_cache.lock")), pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_module, "load_causal_lm", load_and_record_logits)  # local_embedded_target imports it late
        return local_embedded_target(cache_root)


@pytest.fixture(scope="session")
def biased_llama(tmp_path_factory):
    """A tiny Llama whose greedy choice is token 0 or token 1 (by the sign of one hidden unit): a drafter that
    always proposes 0 then sees accepted runs of every length and rejections, exercising the cache crops."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_target(tmp_path_factory.mktemp("biased"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        hf.model.norm.weight.zero_()
        hf.model.norm.weight[0] = 1.0
        hf.lm_head.weight[:, 0] = 0.0
        hf.lm_head.weight[0, 0], hf.lm_head.weight[1, 0] = 10.0, -10.0
    hf.save_pretrained(path)
    return path


@pytest.fixture(params=["llama", "qwen3"])
def tiny_target(request, tiny_llama, tiny_qwen3):
    return {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, whatever a test before it set (the default here is one already, above).
    Use per module: pytestmark = pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def single_loop_as_the_pipeline_runs(cfg):
    """train_single_device(cfg) with the intra-op threads the pipeline gives each of its two CPU workers (the
    pipeline splits the cores between them), so that its numbers can equal the pipeline's bit for bit."""
    from dflash_train.pipeline.devices import cpu_threads_per_worker
    from dflash_train.training.trainer import train_single_device

    old = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker([torch.device("cpu")] * 2))
    try:
        return train_single_device(cfg)
    finally:
        torch.set_num_threads(old)


def assert_same_weights(dir_a, dir_b) -> None:
    """Two servable drafter directories hold bit-identical weights."""
    from pathlib import Path

    from safetensors.torch import load_file

    wa, wb = (load_file(str(Path(d) / "model.safetensors")) for d in (dir_a, dir_b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
