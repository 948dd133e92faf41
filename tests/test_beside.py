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
