"""A child process that ends when its parent does, on every platform.

export-hybrid compiles each NPU graph in a child process (export/npu/check.py); a parent killed
outright (SIGKILL, a closed console, SIGTERM's default action) runs no cleanup, and the compile
would go on for minutes writing into a folder the next export deletes. POSIX offers
prctl(PR_SET_PDEATHSIG) on Linux only and Windows needs job objects, so the child watches
instead: a daemon thread asks every POLL_S whether the parent (its pid and its start time, as a
pid can be reused) still runs, and exits the process at once when it does not.
"""
from __future__ import annotations

import os
import threading

import psutil

POLL_S = 0.5


def parent_token() -> str:
    """What a parent passes its child: "pid:start-time-ms"."""
    me = psutil.Process()
    return f"{me.pid}:{int(me.create_time() * 1000)}"


def _alive(pid: int, started_ms: int) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() * 1000 - started_ms) < 1000
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # cannot tell (access denied): keep running
        return True


def exit_with_parent(token: str, code: int = 3) -> None:
    """Start watching the parent named by `token` (parent_token()); the process exits with `code`
    (no cleanup: whatever it was writing belongs to a dead export) once that parent is gone."""
    pid, _, started = token.partition(":")
    pid_i, started_i = int(pid), int(started)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if not _alive(pid_i, started_i):
                os._exit(code)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
