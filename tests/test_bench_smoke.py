"""The benchmark entry point at tiny CPU shapes: every registered benchmark runs (or says why it cannot), so the GPU
suite cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Hang guards, not speed limits (how fast the smoke suite runs is the benchmarks' business): 10x and more the
# normal time, about 50 s for the whole CPU smoke suite and 10 s for one benchmark.
SMOKE_HANG_GUARD_S = 600
BENCH_HANG_GUARD_S = 120


@pytest.mark.slow
def test_cpu_smoke_runs_every_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(tmp_path, "--json", str(out), timeout=SMOKE_HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["bench"] for r in rows} == {"matmul", "drafter", "optimizer", "target", "colocated", "pipeline",
                                          "generate", "dflash2"}
    ok = {(r["bench"], r["variant"]) for r in rows if r["status"] == "ok"}
    assert {v for b, v in ok if b == "optimizer"} == {"adamw", "muon"}
    assert {v for b, v in ok if b == "drafter"} == {"eager", "reference: dense mask+SDPA, fp32 logits, eager",
                                                    "compile default", "compile reduce-overhead"}
    for r in rows:
        timed = r["bench"] in ("drafter", "target", "colocated", "dflash2") and r["variant"] != "build"
        if r["status"] == "ok" and timed:
            assert r["ms"] > 0 and r["mfu"] > 0 and r["tokens_per_s"] > 0, r
    # the pipeline's compiled target forward (FeatureForward), flex and sdpa; its CUDA-graph variants skip on CPU
    compiled_target = [r for r in rows if r["bench"] == "target" and "compile" in r["variant"] and r["status"] == "ok"]
    assert {r["variant"] for r in compiled_target} == {"compile default, flex (model.target_compile)",
                                                       "torch.compile (default)"}, compiled_target
    assert all(r["extra"]["compile"]["graph_breaks"] == 0 for r in compiled_target), compiled_target
    drafter = [r for r in rows if r["bench"] == "drafter"]
    for r in drafter:
        assert r["extra"]["loss"] == r["extra"]["loss"], "loss is NaN"
        assert r["extra"]["flops"]["train"] > r["extra"]["flops"]["forward"] > 0
    compiled = [r for r in drafter if r["variant"].startswith("compile")]
    assert all(r["extra"]["compile"]["graph_breaks"] == 0 for r in compiled), compiled
    # DFlash v1 and 2 side by side: the same shape, the same compiled step; v2 adds its convolutions and selector
    arch = {r["extra"]["architecture"]: r for r in rows if r["bench"] == "dflash2" and r["status"] == "ok"}
    assert set(arch) == {"dflash", "dflash2"}, [r for r in rows if r["bench"] == "dflash2"]
    v1, v2 = arch["dflash"]["extra"], arch["dflash2"]["extra"]
    assert v1["compile"]["graph_breaks"] == 0 and v2["compile"]["graph_breaks"] == 0
    assert v2["loss"] == v2["loss"] and v2["params"] > v1["params"] and v2["flops"]["train"] > v1["flops"]["train"]
    assert {"conv_kernels", "conv_taps", "selector_projection"} <= set(v2["flops"]) and "conv_taps" not in v1["flops"]
    generate = [r for r in rows if r["bench"] == "generate"]
    assert len(generate) == 10 and all(r["status"] == "ok" for r in generate), generate
    # issue #16's row of record comes first (a run cut by its budget still has it), with its bound
    record, record_bound = generate[0]["extra"], generate[1]
    assert record["every_reply_full"] and record["cold_wall_s"] > 0 and record["prompts"] == 2 * record["batch"]
    assert "row of record" in record_bound["variant"] and record_bound["tokens_per_s"] > 0
    decoded = [r for r in generate[2:] if not r["variant"].startswith("bound")]
    assert len(decoded) == 7 and all(r["extra"]["same_as_first"] == 1.0 for r in decoded)  # fp32: batching changes
    assert generate[-1]["tokens_per_s"] > 0                                                  # no output
    pipeline = {r["variant"]: r for r in rows if r["bench"] == "pipeline"}
    assert all(r["status"] == "ok" for r in pipeline.values()), pipeline
    assert pipeline["one CPU shared"]["extra"]["vs_slowest_stage"] > 0
    # the table (and the goal ratios) are the last thing printed
    table = proc.stdout[proc.stdout.rfind("== dflash-train bench"):]
    assert table and "drafter best MFU" in table and "colocated" in table and "dflash2 step time" in table


def run_bench(tmp_path, *args, timeout=BENCH_HANG_GUARD_S):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OUT=str(tmp_path))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--suite", "cpu-smoke", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout, check=False)


def test_layouts_parse_and_map_to_disjoint_devices(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench
        from harness import Skip, layout_devices, parse_layouts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert parse_layouts("shared, 1+3,2+2,,1+3, 01+7") == ["shared", "1+3", "2+2", "1+7"]
    for bad in ("1+x", "0+2", "1+0", "3", "1+2+3", "shard", " , "):
        with pytest.raises(ValueError, match="--layouts"):
            parse_layouts(bad)
    assert layout_devices("shared", "cuda", 1) == (["cuda:0"], ["cuda:0"])
    assert layout_devices("1+3", "cuda", 4) == (["cuda:0"], ["cuda:1", "cuda:2", "cuda:3"])
    assert layout_devices("2+6", "cuda", 8) == (["cuda:0", "cuda:1"], [f"cuda:{i}" for i in range(2, 8)])
    assert layout_devices("2+2", "cpu", 0) == (["cpu", "cpu"], ["cpu", "cpu"])
    with pytest.raises(Skip, match="needs 8 GPUs, 4 visible"):
        layout_devices("1+7", "cuda", 4)
    # bench.py's own main, in this process: a bad --layouts is refused before any benchmark runs, so a subprocess
    # (a torch import, seconds) adds nothing; main() inserts benchmarks/ into sys.path, put back afterwards.
    saved_path = list(sys.path)
    try:
        code = bench.main(["--suite", "cpu-smoke", "--only", "pipeline", "--layouts", "1+3,2x2"])
    finally:
        sys.path[:] = saved_path
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        ("error: --layouts item '2x2' is not 'shared' (one GPU runs target and drafter) or T+D (T target GPUs, then D "
         "drafter GPUs, e.g. 1+3)")], err


def test_synthetic_documents_of_a_stated_length():
    from dflash_train.config import ConfigError, DataConfig
    from dflash_train.data.dataset import load_dataset

    lens = {len(s.input_ids) for s in load_dataset(DataConfig(source="synthetic")).train}
    assert min(lens) >= 24 and max(lens) <= 96 and len(lens) > 10   # the default stream is unchanged
    fixed = load_dataset(DataConfig(source="synthetic", synthetic_min_len=300, synthetic_max_len=300, max_length=4096))
    assert {len(s.input_ids) for s in fixed.train} == {300}
    capped = load_dataset(DataConfig(source="synthetic", synthetic_min_len=300, synthetic_max_len=300, max_length=64))
    assert {len(s.input_ids) for s in capped.train} == {64}
    with pytest.raises(ConfigError, match="synthetic_min_len"):
        DataConfig(source="synthetic", synthetic_min_len=100, synthetic_max_len=50)


def test_cpu_smoke_pipeline_layouts(tmp_path):
    """1+N layouts on CPU workers: several targets and drafter replicas, scaling efficiency against 1+1, samples/s
    of documents of token_budget / num_docs tokens, each worker's busy fraction."""
    out = tmp_path / "bench.json"
    proc = run_bench(tmp_path, "--only", "pipeline", "--layouts", "1+2,1+1,2+1", "--pipeline-steps", "4",
                     "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["extra"].get("layout"): r for r in res["rows"] if r["bench"] == "pipeline" and "layout" in r["extra"]}
    assert list(rows) == ["1+2", "1+1", "2+1"] and all(r["status"] == "ok" for r in rows.values()), rows
    for layout, r in rows.items():
        t, d = (int(x) for x in layout.split("+"))
        e = r["extra"]
        assert e["steps"] == 4 and e["measured_windows"] == 3 and e["sample_len"] == 32 and e["docs_per_row"] == 2
        assert e["samples_per_s"] == pytest.approx(r["tokens_per_s"] / 64 * 2)
        assert set(e["busy_by_worker"]) == {f"target{i}" for i in range(t)} | {f"drafter{i}" for i in range(d)}
        assert 0 <= e["target_busy"] <= 1 and 0 < e["drafter_busy"] <= 1 and e["vs_ideal"] > 0
        assert "samples/s of 32 tok" in r["note"]
    eff = rows["1+2"]["extra"]["scaling_efficiency"]
    assert eff == pytest.approx(rows["1+2"]["tokens_per_s"] / (2 * rows["1+1"]["tokens_per_s"]))
    assert "scaling_efficiency" not in rows["1+1"]["extra"] and "scaling_efficiency" not in rows["2+1"]["extra"]
    ratios = res["ratios"]
    assert ratios["pipeline 1+2 scaling efficiency: tokens/s / (2 x tokens/s of 1+1)"] == pytest.approx(eff)
    best = [k for k in ratios if k.startswith("pipeline best layout on 3 GPUs by tokens/s: ")]
    assert len(best) == 2 and best[0].rsplit(": ", 1)[1] in ("1+2", "2+1")
