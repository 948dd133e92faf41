"""The benchmark entry point at tiny CPU shapes: every registered benchmark runs (or says why it cannot), so the GPU
suite cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_runs_every_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OUT=str(tmp_path))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--suite", "cpu-smoke",
                        "--json", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert took < 60, f"the CPU smoke suite took {took:.0f}s; keep it under a minute"
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["bench"] for r in rows} == {"matmul", "drafter", "target", "colocated", "pipeline", "generate"}
    ok = {(r["bench"], r["variant"]) for r in rows if r["status"] == "ok"}
    assert {v for b, v in ok if b == "drafter"} == {"eager", "reference: dense mask+SDPA, fp32 logits, eager",
                                                    "compile default", "compile reduce-overhead"}
    for r in rows:
        if r["status"] == "ok" and r["bench"] in ("drafter", "target", "colocated") and r["variant"] != "build":
            assert r["ms"] > 0 and r["mfu"] > 0 and r["tokens_per_s"] > 0, r
    drafter = [r for r in rows if r["bench"] == "drafter"]
    for r in drafter:
        assert r["extra"]["loss"] == r["extra"]["loss"], "loss is NaN"
        assert r["extra"]["flops"]["train"] > r["extra"]["flops"]["forward"] > 0
    compiled = [r for r in drafter if r["variant"].startswith("compile")]
    assert all(r["extra"]["compile"]["graph_breaks"] == 0 for r in compiled), compiled
    generate = [r for r in rows if r["bench"] == "generate"]
    assert len(generate) == 3 and all(r["status"] == "ok" for r in generate), generate
    assert all(r["extra"]["same_as_first"] == 1.0 for r in generate)  # fp32: batching changes no output
    pipeline = {r["variant"]: r for r in rows if r["bench"] == "pipeline"}
    assert all(r["status"] == "ok" for r in pipeline.values()), pipeline
    assert pipeline["one CPU shared"]["extra"]["vs_slowest_stage"] > 0
    # the table (and the goal ratios) are the last thing printed
    table = proc.stdout[proc.stdout.rfind("== dflash-train bench"):]
    assert table and "drafter best MFU" in table and "colocated" in table
