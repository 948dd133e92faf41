"""The pipeline under torchrun on CPU (gloo): 2 processes x (1 target + 1 drafter thread) train exactly like one
process with 2 drafter threads, shard the data without overlap, resume from rank 0's checkpoints, and stop together
when one rank fails (an exception, or a process that dies hard).

Exactness: with 2 replicas the cross-process sum is g0 + g1 on both sides (float addition is commutative), so the
per-step weights, the loss curve and the final drafter are compared bit for bit. (With more than 2 replicas the sums
associate differently: (g0 + g1) + (g2 + g3) vs ((g0 + g1) + g2) + g3, so only a tolerance would hold.) The reference
runs 2 target threads so that both sides split the cores into the same number of intra-op threads.

This file is also the per-rank entry: `torchrun ... tests/test_distributed.py --rank-entry RESULT_PREFIX OVERRIDES...`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import RUN_HANG_GUARD_S, assert_same_weights

SRC = str(Path(__file__).resolve().parents[1] / "src")
THIS = str(Path(__file__).resolve())
STEPS = 12
# 40 short synthetic documents pack into a few rows per epoch, so 24 batches span several epochs.
COMMON = [f"train.max_steps={STEPS}", "train.log_every=1", "data.synthetic_samples=40", "pipeline.stall_timeout_s=60"]
METRICS = ("loss", "acc", "cond_acc", "tau_est", "lr")
pytestmark = pytest.mark.slow  # several processes each


# ---------------------------------------------------------------------------------------------- rank entry

def _rank_main(prefix: str, overrides: list[str]) -> None:
    """One rank: train, then write what the tests compare to <prefix>.rank<r>.json."""
    import logging

    from dflash_train.config import load_config
    from dflash_train.data import packing
    from dflash_train.pipeline import gradsync
    from dflash_train.pipeline.coordinator import train_pipeline

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    rank = int(os.environ["RANK"])
    built: list[tuple[int, int]] = []  # (batch index, epoch) of every batch this rank's loader built
    real_make_batch = packing.make_batch

    def recording_make_batch(row, num_anchors, seed, index, epoch=0):
        built.append((index, epoch))
        return real_make_batch(row, num_anchors, seed, index, epoch)

    packing.make_batch = recording_make_batch
    if (die := os.environ.get("TEST_DIE_AT_STEP")) is not None and rank == 1:  # dies hard: no status, no goodbye
        real_all_reduce, calls = gradsync.GradAverager.all_reduce, [0]

        def dying_all_reduce(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] > int(die):
                os._exit(9)
            return real_all_reduce(self, *args, **kwargs)

        gradsync.GradAverager.all_reduce = dying_all_reduce
    res = train_pipeline(load_config("tiny_cpu", overrides))
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps({
        "checksums": res.replica_checksums, "batches": res.replica_batches, "built": built,
        "history": [{k: h[k] for k in METRICS} for h in res.history]}))


# ---------------------------------------------------------------------------------------------- helpers

def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_FAULT", "DFLASH_FAULT_RANK")}
    return dict(env, PYTHONPATH=SRC, OMP_NUM_THREADS="1", **extra)


def torchrun(args: list[str], cwd, **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.Popen(cmd, env=_env(**env), cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def rank_results(prefix: Path) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]




def finish(proc: subprocess.Popen) -> str:
    """The process's output once it ends. No speed limit: the tests' messages show that ranks stop by noticing
    each other (pipeline.stall_timeout_s=60 would say so); a run past the hang guard is killed."""
    try:
        out, _ = proc.communicate(timeout=RUN_HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"hang guard: did not finish within {RUN_HANG_GUARD_S} s:\n{out[-6000:]}")
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    """One process, 2 target threads + 2 drafter threads: what 2 processes x 1 drafter must reproduce."""
    from dflash_train.config import load_config
    from dflash_train.pipeline.coordinator import train_pipeline

    out = tmp_path_factory.mktemp("reference") / "run"
    cfg = load_config("tiny_cpu", [f"model.target={tiny_llama}", f"run.out_dir={out}", *COMMON,
                                   "pipeline.target_devices=[cpu,cpu]", "pipeline.drafter_devices=[cpu,cpu]"])
    return train_pipeline(cfg)


# ---------------------------------------------------------------------------------------------- tests

def test_two_processes_train_exactly_like_one_process_with_two_replicas(reference, tiny_llama, tmp_path):
    out = tmp_path / "dist"
    proc = torchrun([THIS, "--rank-entry", str(tmp_path / "result"), f"model.target={tiny_llama}",
                     f"run.out_dir={out}", *COMMON], tmp_path)
    log = finish(proc)
    assert proc.returncode == 0, log[-6000:]
    r0, r1 = rank_results(tmp_path / "result")

    # Every replica of every rank holds the same weights after every step, and they are the reference's.
    assert len(r0["checksums"]) == len(r1["checksums"]) == STEPS
    assert r0["checksums"] == r1["checksums"]
    assert [c[0] for c in r0["checksums"]] == [c[0] for c in reference.replica_checksums]
    assert len({c[0] for c in r0["checksums"]}) == STEPS  # the weights do change every step
    assert_same_weights(out / "drafter", reference.drafter_dir)

    # The data: batch i -> global replica i % 2; each rank built exactly the batches it trained; none twice.
    assert r0["batches"] == [list(range(0, 2 * STEPS, 2))] and r1["batches"] == [list(range(1, 2 * STEPS, 2))]
    assert [i for i, _ in r0["built"]] == r0["batches"][0] and [i for i, _ in r1["built"]] == r1["batches"][0]
    seen = sorted(map(tuple, r0["built"] + r1["built"]))
    assert [i for i, _ in seen] == list(range(2 * STEPS))
    assert len({e for _, e in seen}) >= 3  # several epochs: each (epoch, row) is one index, trained once
    assert reference.replica_batches == r0["batches"] + r1["batches"]

    # The loss curve (globally averaged metrics, logged by rank 0 only) is the reference's, bit for bit.
    assert len(r0["history"]) == STEPS and r1["history"] == []
    assert r0["history"] == [{k: h[k] for k in METRICS} for h in reference.history]
    assert "step     12/12" in (out / "run.log").read_text()
    rank1_log = (out / "run.rank1.log").read_text()
    assert "| loss " not in rank1_log and "replicas identical on all 2 ranks" in rank1_log
    assert len((out / "metrics.jsonl").read_text().splitlines()) == STEPS


def test_a_failing_rank_stops_both_and_rank0_checkpoints_resume_exactly(reference, tiny_llama, tmp_path):
    out = tmp_path / "run"
    args = ["-m", "dflash_train.cli", "train", "--config", "tiny_cpu", f"model.target={tiny_llama}",
            f"run.out_dir={out}", *COMMON, "train.checkpoint_every=4"]
    proc = torchrun(args, tmp_path, DFLASH_FAULT="drafter0:step=6:raise", DFLASH_FAULT_RANK="1")
    log = finish(proc)
    assert proc.returncode != 0, log[-6000:]
    assert "InjectedFault: injected fault drafter0:step=6:raise" in log, log[-6000:]  # rank 1's traceback
    assert "RuntimeError: rank 1 failed; see its log" in log, log[-6000:]  # rank 0 stopped by itself, naming it
    state = torch.load(out / "checkpoints" / "step_00000004" / "training_state.pt", weights_only=False)
    assert state["step"] == 4 and state["data_position"] == 8  # global batches consumed: 4 steps x 2 replicas

    proc = torchrun([*args, "run.resume=auto"], tmp_path)  # every rank resumes from rank 0's checkpoint
    log = finish(proc)
    assert proc.returncode == 0, log[-6000:]
    assert log.count("resuming from") == 2 and "at step 4" in log
    assert_same_weights(out / "drafter", reference.drafter_dir)


def test_a_rank_failing_after_its_last_step_stops_the_other_in_the_final_check(tiny_llama, tmp_path):
    """Between the last step and the end-of-training check a stopping rank speaks in that check's shape (not a step
    all-reduce the other rank no longer waits in): both end non-zero, rank 0 naming rank 1."""
    args = ["-m", "dflash_train.cli", "train", "--config", "tiny_cpu", f"model.target={tiny_llama}",
            f"run.out_dir={tmp_path / 'run'}", *COMMON]
    proc = torchrun(args, tmp_path, DFLASH_FAULT="coordinator:shutdown:raise", DFLASH_FAULT_RANK="1")
    log = finish(proc)
    assert proc.returncode != 0, log[-6000:]
    assert "InjectedFault: injected fault coordinator:shutdown:raise" in log, log[-6000:]
    assert "PeerStopped: rank 1 failed; see its log" in log, log[-6000:]  # rank 0, in the final check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_dies_hard_does_not_hang_the_other(tiny_llama, tmp_path):
    # No torchrun agent here (it would stop the survivor itself): the survivor must notice on its own.
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TEST_DIE_AT_STEP="3")
        procs.append(subprocess.Popen(
            [sys.executable, THIS, "--rank-entry", str(tmp_path / "result"), f"model.target={tiny_llama}",
             f"run.out_dir={tmp_path / 'run'}", *COMMON, "train.max_steps=1000"],
            env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    finish(procs[1])
    out0 = finish(procs[0])
    assert procs[1].returncode == 9
    assert procs[0].returncode != 0
    assert "another rank's process ended without saying why" in out0, out0[-6000:]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--rank-entry":
        _rank_main(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --rank-entry RESULT_PREFIX OVERRIDES... (under torchrun)")
