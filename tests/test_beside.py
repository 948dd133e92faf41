"""Children that work beside the run start at a lower CPU priority (beside.py)."""

import os
import subprocess
import sys

import pytest

from dflash_train.beside import NICENESS, lower_priority, start_beside

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no process priorities on this OS")


def lowered() -> int:
    """The niceness a child started beside this process gets."""
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)


def sleeper(**kwargs) -> subprocess.Popen:
    return start_beside([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)


def test_a_child_started_beside_runs_at_a_lower_priority_and_its_children_too():
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process already runs at the lowest priority")
    # the child looks only once told to (a line on stdin): start_beside has returned by then
    child = start_beside([sys.executable, "-c", "import os, subprocess, sys; sys.stdin.readline(); "
                          "print(os.getpriority(os.PRIO_PROCESS, 0), subprocess.run([sys.executable, '-c', "
                          "'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'], capture_output=True, "
                          "text=True).stdout.strip())"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == lowered()
    out, _ = child.communicate("go\n", timeout=60)
    assert out.split() == [str(lowered())] * 2  # as the child sees itself, and a process it starts


def test_a_gone_process_is_no_error():
    child = sleeper()
    assert lower_priority(child.pid) is True  # a live child of ours: lowered (again)
    child.kill()
    child.wait()
    assert lower_priority(child.pid) is False  # nothing to lower: no exception, and it says so


def test_the_run_keeps_its_own_priority():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    child = sleeper()
    try:
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    finally:
        child.kill()
        child.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("killed_by", ["SIGTERM", "SIGKILL"])
def test_a_child_beside_a_run_killed_outright_ends_with_it(tmp_path, killed_by):
    """A run ended by a plain SIGTERM (`kill`, `timeout`: Python's default exits without unwinding its `with`
    blocks) or SIGKILL never stops its children; a child that calls exit_with_parent (the compile warm-up, the
    precompile and the tokenize-ahead children do) then ends itself instead of compiling on for minutes. Without
    exit_with_parent the same child outlives the run."""
    import signal
    import time

    from conftest import STOP_HANG_GUARD_S

    def run_with_child(watch: bool) -> int:
        child = ("from dflash_train.beside import exit_with_parent; exit_with_parent(0.05); " if watch else "") + \
            "import time; time.sleep(120)"
        script = (f"import sys, time; from dflash_train.beside import start_beside; "
                  f"p = start_beside([sys.executable, '-c', {child!r}], start_new_session=True); "
                  "print(p.pid, flush=True); time.sleep(120)")
        run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        pid = int(run.stdout.readline())
        run.send_signal(getattr(signal, killed_by))
        run.wait(timeout=STOP_HANG_GUARD_S)
        return pid

    watched, unwatched = run_with_child(True), run_with_child(False)
    try:
        deadline = time.monotonic() + STOP_HANG_GUARD_S  # a hang guard: the watched child goes within a second
        while _alive(watched) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(watched), "the child outlived its run"
        assert _alive(unwatched)  # the control: nothing else ends a child in its own session
    finally:
        for pid in (watched, unwatched):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
