"""The start-up benchmark (benchmarks/cases_startup.py, issue #16's fast start): `dflash-train train` run twice on one
fresh compile cache, each run's "first step ... done X s after the command started" line read back; at the CPU
smoke suite's tiny shape, and its log parsing on made-up logs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def benchmarks_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.slow  # two CLI runs of the tiny shape in subprocesses: ~15 s each on a 2-core CPU
def test_cpu_smoke_startup_measures_a_cold_and_a_warm_start(tmp_path):
    bench = benchmarks_module("bench")
    saved_path = list(sys.path)
    try:  # bench.py's main in this process (it inserts benchmarks/ into sys.path: put back afterwards)
        code = bench.main(["--suite", "cpu-smoke", "--only", "startup", "--json", str(tmp_path / "bench.json")])
    finally:
        sys.path[:] = saved_path
    res = json.loads((tmp_path / "bench.json").read_text())
    assert code == 0 and not [r for r in res["rows"] if r["status"] == "error"], res["rows"]
    rows = [r for r in res["rows"] if r["bench"] == "startup"]
    assert [(r["variant"], r["status"]) for r in rows] == [("cold", "ok"), ("warm", "ok")], rows
    cold, warm = (r["extra"] for r in rows)
    assert cold["compile_s"] is None  # train.compile_times on, but the CPU suite's step is eager: no table
    for e in (cold, warm):
        assert e["first_step_s"] > 0 and e["first_step"] == 1 and e["returncode"] == 0, e
        assert sum(e["phases_s"].values()) == pytest.approx(e["first_step_s"])  # the phases add up to the figure
        assert "first step (step 1) done" in e["output_tail"] and "train.compile_cache_dir=" in e["command"]
    assert set(cold["phases_s"]) == {"python+config", "imports+data+drafter", "target load", "drafter compile",
                                     "target compile", "step 1"}
    assert cold["compile_cache"] == warm["compile_cache"] and cold["cache_state"].startswith("cold")
    assert cold["weights_write_s"] > 0 and cold["target_bytes"] > 0
    assert not Path(cold["compile_cache"]).parent.exists()  # the target, the runs and the cache are removed
    assert res["ratios"]["startup warm: seconds to the first step (goal <= 60)"] == warm["first_step_s"]


@pytest.mark.slow  # one CLI run of the tiny shape in a subprocess: ~15 s on a 2-core CPU
def test_a_kept_work_dir_whose_cold_run_is_done_measures_the_warm_start_alone(tmp_path, monkeypatch):
    """DFLASH_STARTUP_DIR: on the GPU the cold start (5-8 minutes at Qwen3-8B's shape) and the warm one do not fit in
    one device call, so a second call on the same machine finds the cold run's marker and runs the warm start only,
    and the dir (target, compile cache) stays for the caller to remove."""
    bench = benchmarks_module("bench")
    keep = tmp_path / "kept"
    keep.mkdir()
    (keep / "cold_done").write_text("496.2\n")   # as an earlier call leaves it
    monkeypatch.setenv("DFLASH_STARTUP_DIR", str(keep))
    saved_path = list(sys.path)
    try:
        code = bench.main(["--suite", "cpu-smoke", "--only", "startup", "--json", str(tmp_path / "bench.json")])
    finally:
        sys.path[:] = saved_path
    res = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["variant"]: r for r in res["rows"] if r["bench"] == "startup"}
    assert code == 0 and rows["cold"]["status"] == "skipped" and "earlier call" in rows["cold"]["note"], rows
    assert "496.2" in rows["cold"]["note"]
    warm = rows["warm"]
    assert warm["status"] == "ok" and warm["extra"]["first_step_s"] > 0, warm
    assert Path(warm["extra"]["compile_cache"]).resolve() == (keep / "compile_cache").resolve()
    assert (keep / "target" / "config.json").is_file() and (keep / "compile_cache").is_dir()  # kept


def test_startup_log_parsing_and_rows():
    startup = benchmarks_module("cases_startup")
    log = "\n".join([
        "23:59:50 train without --config: the defaults (...)",
        "23:59:52 compile cache: /c/cc (warm: 12 compiled artifacts from earlier runs)",
        "23:59:58 target: qwen3, 36 layers, H=4096, vocab 151936; drafter: 5 layers",
        "Loading weights:   0%|     | 0/9 [00:00<?, ?it/s]\rLoading weights: 100%|#####| 9/9",
        "00:00:20 validation: 8 held-out rows (...)",
        "00:00:50 drafter0: training step ready in 25.1 s, validation's forward in 4.2 s (compile ...)",
        "00:01:05 target0: feature forward ready in 14.8 s (compile default, CUDA graph on)",
        "00:01:05 compile times (train.compile_times):",
        "TorchDynamo compilation metrics:",
        "Function, Runtimes (s)",
        "_compile.compile_inner, 41.5000",
        "compile_fx.<locals>.bw_compiler, 12.2500",
        "00:01:10 first step (step 1) done 81.5 s after the command started",
        "00:01:11 step      1/3 | loss 5.3871",
        "00:01:12 validation: best val_tau_decoding 1.148 at step 3"])
    got = startup.parse_startup_log(log)
    assert (got.first_step, got.first_step_s, got.cache_dir) == (1, 81.5, "/c/cc")
    assert got.cache_state == "warm: 12 compiled artifacts from earlier runs"
    assert got.compile_s == {"_compile.compile_inner": 41.5, "compile_fx.<locals>.bw_compiler": 12.25}
    # ages: 81.5 less the seconds to the first step's stamp, across midnight; each phase ends at its line
    assert got.phases_s == pytest.approx({"python+config": 3.5, "imports+data+drafter": 6.0, "target load": 22.0,
                                          "drafter compile": 30.0, "target compile": 15.0, "step 1": 5.0})
    no_target_line = startup.parse_startup_log(log.replace("target: ", "sizes: "))
    assert no_target_line.phases_s == pytest.approx({"python+config": 3.5, "target load": 28.0, "drafter compile": 30.0,
                                                     "target compile": 15.0, "step 1": 5.0})  # counted in the next
    assert startup.parse_startup_log(log.split("00:01:10")[0]).first_step_s is None

    cache = Path("/c/cc")

    def row(returncode, output):
        run = startup.CliRun(returncode, output, 95.0, None)
        return startup.startup_row("warm", run, startup.parse_startup_log(output), cache, ["train"], {})

    ok = row(0, log)
    assert ok.status == "ok" and ok.extra["first_step_s"] == 81.5 and "goal <= 60 s" in ok.note
    assert row(None, log).status == "ok"  # stopped at its time limit after the first step: the figure stands
    crashed = row(1, log.split("00:01:10")[0] + "\nTraceback (most recent call last):\nValueError: no GPU")
    assert crashed.status == "error" and crashed.note.startswith("exit status 1, no first-step line")
    assert crashed.note.endswith("ValueError: no GPU") and "Traceback" in crashed.extra["output_tail"]
    elsewhere = row(0, log.replace("/c/cc", "/other"))
    assert elsewhere.status == "error" and "not the fresh /c/cc" in elsewhere.note
