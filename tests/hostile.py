"""Running a CLI on a hostile input under a memory and time bound, and checking its refusal.

The child runs in its own process; its resident memory (with its children's) is sampled every
50 ms with psutil and the process tree is killed past `rss_mb` or `timeout`: a hang or a runaway
allocation fails the test as such instead of taking the machine. Platform-neutral (psutil, no
signals beyond kill, no resource limits that Windows lacks).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

RSS_MB = 1200      # a CLI with the embedded model loads in ~350 MB; the attacks went to 3-23 GB
TIMEOUT_S = 180    # a hang guard on a shared 2-core machine, not a speed assertion


@dataclass
class Run:
    rc: int | None
    out: str
    err: str
    peak_mb: float
    killed: str | None  # why the bound killed it, or None


def run_bounded(args, *, rss_mb: float = RSS_MB, timeout: float = TIMEOUT_S, cwd=None, env=None) -> Run:
    """`python ARGS...` under the bounds."""
    proc = psutil.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        stdin=subprocess.DEVNULL, text=True, encoding="utf-8", errors="replace", cwd=cwd,
                        env={**os.environ, **(env or {})})
    start, peak, killed = time.monotonic(), 0.0, None
    while True:
        try:
            out, err = proc.communicate(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            peak = max(peak, _tree_rss_mb(proc))
            if peak > rss_mb:
                killed = f"resident memory {peak:.0f} MB over {rss_mb} MB"
            elif time.monotonic() - start > timeout:
                killed = f"still running after {timeout} s"
            if killed:
                for p in [*_children(proc), proc]:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                out, err = proc.communicate()
                break
    return Run(proc.returncode, out, err, peak, killed)


def _children(proc) -> list:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _tree_rss_mb(proc) -> float:
    total = 0
    for p in [proc, *_children(proc)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def error_lines(err: str) -> list[str]:
    """stderr without export-hybrid's progress lines ("[  1.2s] ...")."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("[")]


def assert_refused(run: Run, *needles: str) -> str:
    """Exit 2, one line on stderr naming each needle, no traceback, within the bounds."""
    assert run.killed is None, f"{run.killed}; stderr: {run.err[-2000:]}"
    assert run.rc == 2, run.err[-3000:] + run.out[-500:]
    lines = error_lines(run.err)
    assert len(lines) == 1, run.err
    assert "Traceback" not in run.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
