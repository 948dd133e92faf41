"""Fast start (issue #16): seconds from the command to the first training step, with a cold and a warm compile cache.

`dflash-train train` runs twice in a subprocess, with the pipeline benchmark's configuration (cases_end_to_end.py:
the suite's shapes, the synthetic source, on CUDA the drafter step in reduce-overhead and the GPU demo's compiled,
CUDA-graphed flex target forward) on a random-init target of the suite's shape written to disk once, and one fresh
train.compile_cache_dir: the first run compiles everything (cold), the second loads what the first compiled (warm;
dynamo still traces and CUDA graphs are still captured: neither is cacheable, so warm is not zero). The figure is
each run's own start-up line, "first step (step N) done X s after the command started" (training/startup.py); the
log's timestamps (whole seconds) say where the time went. Everything the runs print is kept: its tail in the row's
extra, and streamed to this process's output as it comes.

DFLASH_STARTUP_ARGS="key=value ..." adds overrides to both runs (e.g. train.validation_graph=training).
DFLASH_STARTUP_DIR=DIR keeps the work (target, compile cache) in DIR across calls: a call finds the cold run done
there (its marker file) and measures the warm start alone. On the H200 a cold start at Qwen3-8B's shape took 304-496 s,
so cold and warm do not fit in one 10-minute device call; two calls on the same warm machine do.

Not measured cold: the page cache (the weights were just written, Python's own files were read by this process)
and the GPU's first use on a fresh machine.
"""

from __future__ import annotations

import gc
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import Context, Row, Skip, benchmark

from cases import target_config
from cases_end_to_end import pipeline_overrides

STEPS = 3                      # a few steps: the figure is the first one; the rest is the run's normal ending
GOALS_S = {"cold": 180.0, "warm": 60.0}   # issue #16's goals, seconds from the command to the first step
KEEP_ENV, COLD_DONE = "DFLASH_STARTUP_DIR", "cold_done"   # a work dir kept across calls (see the module's doc)
ARGS_ENV = "DFLASH_STARTUP_ARGS"   # more overrides for both runs, e.g. "train.validation_graph=training"
HANG_GUARD_S = 600.0           # a run's limit when the suite has no time budget (CPU: normally ~10 s)
TAIL_CHARS = 12_000            # of a run's output kept in the row
FIRST_STEP = re.compile(r"^(\d\d):(\d\d):(\d\d) .*first step \(step (\d+)\) done ([\d.]+) s after the command started")
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d) (.*)")
CACHE_LINE = re.compile(r"compile cache: (.+) \(((?:cold|warm)[^)]*)\)")
# The lines that end each phase of the start-up, in order (the CLI's log; the last phase ends at the first step).
# A phase whose line is missing is counted in the next one.
PHASES = (("python+config", "compile cache: "),       # train.py, before anything imports inductor
          ("imports+data+drafter", "target: "),       # training/run.py's summary: the stages imported, data, drafter
          ("target load", "validation: "),            # load_target, then the held-out rows' features (if any)
          ("drafter compile", "drafter0: training step ready"),  # its step and validation's forward: compile, capture
          ("target compile", "target0: feature forward ready"))  # the target worker's compile and capture
LAST_PHASE = "step 1"                                 # the heap frozen, the pipeline filled, the first step


@dataclass
class StartupLog:
    """What a run's output says about its start: parse_startup_log."""
    compile_s: dict | None = None           # torch.compile's stages -> seconds (train.compile_times' table)
    first_step: int | None = None
    first_step_s: float | None = None       # seconds from the command to the end of the first step
    phases_s: dict | None = None            # phase -> seconds (to +-1 s: the log's timestamps are whole seconds)
    cache_dir: str | None = None
    cache_state: str | None = None          # "cold: compiling fills it" | "warm: N compiled artifacts ..."


def parse_startup_log(text: str) -> StartupLog:
    """A `dflash-train train` output (lines 'HH:MM:SS message') -> its first-step time, the phases before it and the
    compile cache it used. Phases: each marker line's age is the first step's age less the seconds between the two
    lines' timestamps (modulo a day: a run may cross midnight)."""
    out = StartupLog()
    lines = text.replace("\r", "\n").splitlines()
    out.compile_s = parse_compile_times(lines)
    stamped: list[tuple[int, str]] = []
    for line in lines:
        if (m := CACHE_LINE.search(line)) and out.cache_dir is None:
            out.cache_dir, out.cache_state = m.group(1), m.group(2)
        if m := FIRST_STEP.match(line):
            h, mi, sec, step, age = m.groups()
            out.first_step, out.first_step_s = int(step), float(age)
            end = int(h) * 3600 + int(mi) * 60 + int(sec)
            break
        if m := STAMP.match(line):
            stamped.append((int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)), m.group(4)))
    if out.first_step_s is None:
        return out
    out.phases_s, before, i = {}, 0.0, 0
    for name, prefix in PHASES:
        hit = next((j for j in range(i, len(stamped)) if stamped[j][1].startswith(prefix)), None)
        if hit is None:
            continue
        age = max(0.0, out.first_step_s - (end - stamped[hit][0]) % 86400)
        out.phases_s[name], before, i = age - before, age, hit + 1
    out.phases_s[LAST_PHASE] = out.first_step_s - before
    return out


# The stages of torch.compile's table (train.compile_times) that a row's note names: dynamo's tracing, AOT autograd's
# joint graph and partition, inductor's forward and backward compiles, and the wait for the kernels' compile workers.
COMPILE_STAGES = ("_compile.compile_inner", "create_aot_dispatcher_function", "compile_fx.<locals>.fw_compiler_base",
                  "compile_fx.<locals>.bw_compiler", "async_compile.wait")


def parse_compile_times(lines: list[str]) -> dict | None:
    """The 'name, seconds' rows after the run's "compile times (train.compile_times):" line; None without one."""
    start = next((i for i, x in enumerate(lines) if "compile times (train.compile_times):" in x), None)
    if start is None:
        return None
    out = {}
    for line in lines[start + 3:]:   # past the title and the header
        name, _, value = line.rpartition(", ")
        try:
            out[name] = float(value)
        except ValueError:
            break
    return out


@dataclass
class CliRun:
    returncode: int | None     # None: stopped at its time limit
    output: str
    wall_s: float
    peak_device_gib: float | None   # the most device memory in use while it ran (every process: nvidia-smi's view)


def run_cli(args: list[str], cwd: Path, device: torch.device, limit_s: float) -> CliRun:
    """`python -m dflash_train.cli *args` in a process group of its own, its output echoed as it comes and kept;
    killed (with any compile workers) past limit_s. The child imports this dflash_train and compiles only into the
    cache its config names (inductor's and Triton's cache variables are not passed on)."""
    import dflash_train

    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    src = str(Path(dflash_train.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    lines: list[str] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *args], cwd=cwd, env=env, text=True,
                            errors="replace", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def pump():   # a thread: the main one polls the clock and the device memory meanwhile
        for line in proc.stdout:
            lines.append(line)
            print(f"    | {line}", end="", flush=True)

    reader = threading.Thread(target=pump, name="startup-output", daemon=True)
    reader.start()
    peak, stopped = None, False
    try:
        while proc.poll() is None:
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                peak = max(peak or 0.0, (total - free) / 2**30)
            if time.perf_counter() - t0 > limit_s:
                stopped = True
                break
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # its own group: the CLI and inductor's compile workers
            proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()
    return CliRun(None if stopped else proc.returncode, "".join(lines), time.perf_counter() - t0, peak)


def write_target(ctx: Context, path: Path) -> float:
    """A random-init causal LM of the suite's target shape (every layer: the CLI loads and truncates it itself),
    built on the device in the compute dtype and saved as safetensors. -> seconds taken."""
    from transformers import Qwen3ForCausalLM

    s = ctx.suite
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)
    try:
        torch.manual_seed(0)
        with torch.device(ctx.device):
            hf = Qwen3ForCausalLM(target_config(s))
    finally:
        torch.set_default_dtype(default)
    hf.save_pretrained(path)
    del hf
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()   # now, not after the variant: the runs need the memory
    return time.perf_counter() - t0


@benchmark("startup", "fast start: seconds from `dflash-train train` to its first step, cold (a fresh compile cache) "
                      "and warm (the same cache again), on a target of the suite's shape written to disk; not in "
                      "the default set (--only startup)")
def bench_startup(ctx: Context):
    s, dev = ctx.suite, ctx.device
    keep = os.environ.get(KEEP_ENV)
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dflash_bench_startup_"))
    work.mkdir(parents=True, exist_ok=True)
    cache, cold_marker = work / "compile_cache", work / COLD_DONE
    home = "cuda:0" if dev.type == "cuda" else "cpu"
    shape = f"L={s.target['num_hidden_layers']} H={s.target['hidden_size']} T={s.token_budget}"
    done: dict = {}

    def start(which: str):
        def run():
            if which == "warm" and "cold" not in done:
                raise Skip("needs the cold run of this benchmark first (it fills the compile cache)")
            if not (work / "target" / "config.json").is_file():
                done["write_s"] = write_target(ctx, work / "target")
                done["target_bytes"] = sum(f.stat().st_size for f in (work / "target").iterdir())
            out_dir = work / f"run_{which}"
            args = ["train", *pipeline_overrides(ctx, str(work / "target"), str(out_dir), [home], [home]),
                    f"train.max_steps={STEPS}", "train.log_every=1", "train.final_eval_prompts=0",
                    f"train.compile_cache_dir={cache}", "train.compile_times=true",
                    "pipeline.stall_timeout_s=600",   # the product's default: a cold compile takes minutes
                    *shlex.split(os.environ.get(ARGS_ENV, ""))]
            # Past the time budget by at most 20 s, so that the table still prints inside the caller's own limit.
            limit = HANG_GUARD_S if math.isinf(s.budget_s) else max(60.0, s.budget_s - ctx.elapsed() + 20)
            try:
                res = run_cli(args, work, dev, limit)
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)   # its checkpoint and drafters: ~17 GB at Qwen3-8B's
            return startup_row(which, res, parse_startup_log(res.output), cache, args, done)
        return run

    try:
        # Costs for the time budget, one H200 at Qwen3-8B's shape (guesses): writing 16 GB of weights ~20 s; cold
        # ~290 s to the first step (the drafter step's compile ~200 s, the target's ~50 s, loading ~30 s); warm
        # ~90 s; each run then trains its few steps, validates and writes its checkpoint (~20 s).
        cuda = dev.type == "cuda"
        if cold_marker.is_file():   # a kept work dir whose cold run finished in an earlier call
            done["cold"] = True
            ctx.variant("startup", "cold", shape, skip_cold(cold_marker), cost_s=0)
        else:
            cold = ctx.variant("startup", "cold", shape, start("cold"), cost_s=330 if cuda else 30)
            if cold is not None and cold.status == "ok":
                done["cold"] = True
                cold_marker.write_text(f"{cold.extra.get('first_step_s')}\n")
        ctx.variant("startup", "warm", shape, start("warm"), cost_s=120 if cuda else 20)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def skip_cold(marker: Path):
    def run():
        raise Skip(f"ran in an earlier call ({marker.parent}, first step after {marker.read_text().strip()} s): this "
                   "call measures the warm start on its compile cache")
    return run


def startup_row(which: str, res: CliRun, log: StartupLog, cache: Path, args: list[str], done: dict) -> Row:
    """One run's row: ok when its first step was logged (even if it was stopped afterwards), else an error."""
    extra = {"first_step_s": log.first_step_s, "first_step": log.first_step, "wall_s": res.wall_s,
             "phases_s": log.phases_s, "compile_s": log.compile_s, "goal_s": GOALS_S[which],
             "compile_cache": log.cache_dir,
             "cache_state": log.cache_state, "returncode": res.returncode,
             "command": "python -m dflash_train.cli " + shlex.join(args), "output_tail": res.output[-TAIL_CHARS:]}
    if which == "cold":
        extra.update(weights_write_s=done.get("write_s"), target_bytes=done.get("target_bytes"))
    ended = (f"stopped at its time limit after {res.wall_s:.0f} s" if res.returncode is None
             else f"exit status {res.returncode}")
    if log.first_step_s is None or (res.returncode not in (0, None)):
        last = next((x for x in reversed(res.output.strip().splitlines()) if x.strip()), "no output")
        return Row("", "", status="error", note=f"{ended}, {'no' if log.first_step_s is None else 'a'} first-step "
                                                f"line; last line: {last[:160]}", extra=extra)
    if log.cache_dir is not None and Path(log.cache_dir).resolve() != cache.resolve():
        return Row("", "", status="error", note=f"the run compiled into {log.cache_dir}, not the fresh {cache}: "
                                                "not a cold / warm measurement", extra=extra)
    phases = " | ".join(f"{k} {v:.0f} s" for k, v in (log.phases_s or {}).items())
    cache_state = (log.cache_state or "?").replace(" from earlier runs", "").replace(": compiling fills it", "")
    if which == "warm" and cache_state.startswith("cold"):
        cache_state += ", the cold run cached nothing (nothing compiled?)"
    note = (f"first step {log.first_step_s:.1f} s after the command (goal <= {GOALS_S[which]:.0f} s), run "
            f"{res.wall_s:.0f} s in all{'' if res.returncode == 0 else ' (' + ended + ')'}; cache {cache_state}; "
            f"{phases}")
    if log.compile_s:
        note += "; torch.compile: " + ", ".join(f"{k.rsplit('.', 1)[-1]} {log.compile_s[k]:.0f} s"
                                                for k in COMPILE_STAGES if k in log.compile_s)
    if which == "cold" and done.get("write_s") is not None:
        note += f"; target written in {done['write_s']:.0f} s before (not counted)"
    return Row("", "", note=note, peak_gib=res.peak_device_gib, extra=extra)
