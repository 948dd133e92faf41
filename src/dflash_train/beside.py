"""Child processes that work beside the run, started at a lower CPU priority than the run itself.

While the GPU demo regenerates its data, three processes share the host's cores: the run (regenerating: the critical
path, since training starts when its last answer is written), the compile warm-up child (training/warmup.py, done
minutes before the regeneration ends) and a child per file that tokenizes the answers as they are written
(data/tokenize_ahead.py, done minutes early too). Pipeline/precompile.py's child likewise compiles the shorter parts
while the run compiles the long one. The children have slack and the run has none, yet at equal priority the
scheduler shares a contended core evenly. In the demo of 2026-12-07 on an H100 (demo-p), the first with the
tokenizing child, the start-up compiles ran slower than in the run before without it (the regeneration's ShareGPT
pass, which compiles its engine in its first seconds: 75.0 s against 60.7 s; the warm-up child: 147 s against 103 s
to its first step) and the data step took 26 s more, while the pass after the compiles ran within 2% of its speed
then (546 against 554 answers a second). Not yet timed with this change.

A child started here has its niceness raised by NICENESS (POSIX: the scheduler then gives a busy run most of a
shared core, and the child every core the run leaves idle); its own threads and processes inherit it. Where the OS
has no priorities or refuses the change, the child runs as it would have.

The run stops its children itself (their `with` blocks), except when it is killed outright (a plain SIGTERM from
`kill` or `timeout`: Python's default ends the process without unwinding). A child started here is told the run's
pid (PARENT_ENV) and its entry point calls exit_with_parent: a thread of its own that ends it once the run is gone,
so no compile or tokenizing child keeps a GPU and cores busy for minutes after its run.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

NICENESS = 10  # added to the run's own: CFS weights 1024 (the run) against 110 (the child) on a contended core
PARENT_ENV = "DFLASH_BESIDE_RUN_PID"  # the pid of the run that started this child (exit_with_parent)
PARENT_POLL_S = 1.0


def start_beside(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **popen_kwargs), then lower_priority of the child (see the module docstring); the
    child's environment names this process (PARENT_ENV) for exit_with_parent."""
    env = dict(popen_kwargs.pop("env", None) or os.environ, **{PARENT_ENV: str(os.getpid())})
    proc = subprocess.Popen(args, env=env, **popen_kwargs)
    lower_priority(proc.pid)
    return proc


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> None:
    """In a child started by start_beside (a no-op elsewhere): a daemon thread that ends this process at once when
    the run that started it is gone (its parent pid changes: re-parented to init or a subreaper)."""
    run = os.environ.get(PARENT_ENV)
    if not run or not run.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(run):
            time.sleep(poll_s)
        os._exit(143)  # as SIGTERM would: nothing of the child's is worth finishing without its run

    threading.Thread(target=watch, name="dflash-watch-run", daemon=True).start()


def lower_priority(pid: int, by: int = NICENESS) -> bool:
    """Raise process pid's niceness to this process's plus `by` (at most 19); False where that could not be done.
    The niceness is the thread's on Linux: call it before pid starts threads (Popen returns while the child's
    interpreter is still starting)."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, own + by))
    except OSError:  # gone already, or not ours to change: it only runs at the same priority as the run
        return False
    return True
