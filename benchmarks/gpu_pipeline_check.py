"""Pipeline check on the GPU (torch 2.11, no network): the threaded pipeline with compiled `reduce-overhead` drafter
steps (flex attention, bf16) in worker threads, on a random-init Qwen3-shaped target.

Cases, each in its own subprocess (a fresh CUDA context and inductor config per case):
  all-gpus     target cuda:0, one drafter replica per visible GPU (cuda:0 shared with the target)   -> trains
  all-nccl     all-gpus with pipeline.grad_reduce=nccl (only with 2+ GPUs)                          -> trains
  split        target cuda:0, drafters on cuda:1..N-1 (only with 2+ GPUs)                             -> trains
  trees-on     torch's defaults (trees on), no pipeline: a reduce-overhead step on a worker thread  -> must FAIL
               with the trees' AssertionError, as a drafter's step would (why training/cudagraphs.py exists)
Prints steps/s, the stages' busy/wait fractions and whether the replicas stayed identical, then a table.

  Run (from the repo root): PYTHONPATH=src python3 benchmarks/gpu_pipeline_check.py
  Some cases only:          CASES=all-gpus,all-nccl PYTHONPATH=src python3 benchmarks/gpu_pipeline_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

WORK = Path("/tmp/dflash_gpu_pipeline_check")
STEPS, LOG_EVERY, CASE_TIMEOUT_S = 30, 5, 240


def overrides(target: str, out: Path, drafters: list[str], grad_reduce: str = "host") -> list[str]:
    return [f"model.target={target}", f"run.out_dir={out}", "run.overwrite=true", "model.block_size=16",
            "model.num_draft_layers=2", "model.num_feature_layers=3", "train.token_budget=4096",
            "train.num_anchors=256", f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}",
            "train.compile=reduce-overhead", "train.attention=flex", "train.dtype=bf16",
            "data.synthetic_samples=4000", "pipeline.target_devices=[cuda:0]",
            f"pipeline.drafter_devices=[{','.join(drafters)}]", "pipeline.stall_timeout_s=180",
            f"pipeline.grad_reduce={grad_reduce}"]


def run_trees_case() -> dict:
    """In the child: what training/cudagraphs.py guards against. With the trees on and their module imported by the
    main thread first, a compiled reduce-overhead forward + backward called on a plain threading.Thread fails."""
    import threading

    import torch
    import torch._inductor.cudagraph_trees  # noqa: F401 - imported in the main thread first, as real programs do

    torch._inductor.config.triton.cudagraph_trees = True  # torch's default; this child never applies the policy
    layer = torch.nn.Linear(1024, 1024, device="cuda")
    step = torch.compile(lambda x: layer(x).square().mean(), mode="reduce-overhead")
    errors: list[str] = []

    def work() -> None:
        try:
            x = torch.randn(256, 1024, device="cuda")
            for _ in range(3):  # warm-up, capture, replay
                step(x).backward()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - reported in the table
            errors.append(traceback.format_exc())

    t0 = time.perf_counter()
    worker = threading.Thread(target=work, name="dflash-drafter0")
    worker.start()
    worker.join()
    if not errors:
        return {"ok": False, "seconds": time.perf_counter() - t0, "assertion": False, "trees": True,
                "error": "ran: with the trees on, the worker thread's compiled step no longer fails"}
    return {"ok": False, "seconds": time.perf_counter() - t0, "assertion": "AssertionError" in errors[0],
            "error": errors[0].strip().splitlines()[-1][:200], "trees": True}


def run_case(spec: dict) -> dict:
    """In the child: train, return the figures (or the error)."""
    if spec["trees"]:
        return run_trees_case()
    import logging

    import torch
    import torch._inductor.cudagraph_trees  # noqa: F401 - imported in the main thread first, as real programs do

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s", stream=sys.stdout)
    from dflash_train.config import load_config
    from dflash_train.pipeline.coordinator import train_pipeline

    cfg = load_config("tiny_cpu", overrides(spec["target"], Path(spec["out"]), spec["drafters"], spec["reduce"]))
    t0 = time.perf_counter()
    try:
        res = train_pipeline(cfg)
    except Exception as e:  # noqa: BLE001 - reported in the table
        msg = str(e)
        return {"ok": False, "seconds": time.perf_counter() - t0, "assertion": "AssertionError" in msg,
                "error": msg.strip().splitlines()[-1][:200] if msg.strip() else type(e).__name__,
                "trees": torch._inductor.config.triton.cudagraph_trees}
    late = [h for h in res.history if h["step"] > LOG_EVERY]  # the first window holds compile + warm-up
    mean = lambda k: sum(h[k] for h in late) / len(late)  # noqa: E731
    return {"ok": True, "seconds": time.perf_counter() - t0, "steps": res.steps,
            "steps_s": 1.0 / mean("step_time_s"), "tok_s": mean("tokens_per_s"),
            "drafter_busy": mean("drafter_busy"), "drafter_wait": mean("drafter_wait"),
            "target_busy": mean("target_busy"), "target_wait": mean("target_wait"),
            "loss_first": res.history[0]["loss"], "loss_last": res.history[-1]["loss"],
            "identical": all(len(set(c)) == 1 for c in res.replica_checksums),
            "trees": torch._inductor.config.triton.cudagraph_trees}


def launch(name: str, target: str, drafters: list[str], trees: bool, grad_reduce: str = "host") -> dict:
    spec = {"target": target, "out": str(WORK / name), "drafters": drafters, "reduce": grad_reduce, "trees": trees}
    print(f"\n=== {name}: target cuda:0, drafters {drafters}, cudagraph trees {'on' if trees else 'off'}, "
          f"grad_reduce {grad_reduce}", flush=True)
    try:
        p = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True, text=True,
                           timeout=CASE_TIMEOUT_S)
        lines = (p.stdout + p.stderr).splitlines()
        print("\n".join(line[:240] for line in lines[-25:]), flush=True)
        found = [line for line in lines if line.startswith("RESULT ")]
        if not found:
            return {"ok": False, "error": f"no result (exit {p.returncode}): {lines[-1][:200] if lines else ''}"}
        return json.loads(found[-1][len("RESULT "):])
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {CASE_TIMEOUT_S} s"}
    except Exception:  # noqa: BLE001
        return {"ok": False, "error": traceback.format_exc().splitlines()[-1]}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print("RESULT " + json.dumps(run_case(json.loads(sys.argv[2]))), flush=True)
        return
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_foundation_check import make_target

    n = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {n} x {torch.cuda.get_device_name(0)}", flush=True)
    target = WORK / "target"
    if not (target / "config.json").is_file():
        make_target(str(target), layers=8, hidden=1024)
    all_gpus = [f"cuda:{i}" for i in range(n)]
    cases = [("all-gpus", all_gpus, False, True, "host")]
    if n >= 2:
        cases.append(("all-nccl", all_gpus, False, True, "nccl"))
        cases.append(("split", all_gpus[1:], False, True, "host"))
    cases.append(("trees-on", all_gpus, True, False, "host"))
    if os.environ.get("CASES"):  # e.g. CASES=all-gpus,all-nccl
        cases = [c for c in cases if c[0] in os.environ["CASES"].split(",")]
    rows = [(name, drafters, expect_ok, launch(name, str(target), drafters, trees, reduce))
            for name, drafters, trees, expect_ok, reduce in cases]

    print(f"\ntorch {torch.__version__}, {n} GPU(s); {STEPS} steps, token_budget 4096, reduce-overhead, flex, bf16")
    print(f"{'case':<9} {'drafters':<24} {'expect':<7} {'verdict':<8} {'steps/s':>7} {'tok/s':>9} "
          f"{'drafter busy/wait':>18} {'target busy/wait':>17} {'identical':>9}  note")
    for name, drafters, expect_ok, r in rows:
        # trains: it must train and keep the replicas identical; fails: it must fail with the trees' AssertionError
        good = (r["ok"] and r["identical"]) if expect_ok else (not r["ok"] and r.get("assertion", False))
        verdict, expect = "PASS" if good else "FAIL", "trains" if expect_ok else "fails"
        if r["ok"]:
            print(f"{name:<9} {','.join(drafters):<24} {expect:<7} {verdict:<8} {r['steps_s']:>7.2f} "
                  f"{r['tok_s']:>9,.0f} {r['drafter_busy']:>9.0%}/{r['drafter_wait']:<8.0%}"
                  f"{r['target_busy']:>8.0%}/{r['target_wait']:<8.0%} {r['identical']!s:>9}  "
                  f"loss {r['loss_first']:.2f} -> {r['loss_last']:.2f}, {r['seconds']:.0f} s")
        else:
            print(f"{name:<9} {','.join(drafters):<24} {expect:<7} {verdict:<8} {'-':>7} {'-':>9} {'-':>18} "
                  f"{'-':>17} {'-':>9}  {r.get('error', '')}")

if __name__ == "__main__":
    main()
