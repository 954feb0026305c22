"""What the hostile-input suites share: running a CLI under a memory and time bound (its resident
memory, with its children's, sampled every 50 ms with psutil; the process tree killed past `rss_mb`
or `timeout`, so a hang or a runaway allocation fails the test as such instead of taking the machine;
platform-neutral), a peak-RSS watch of this process, an export whose chat template is the attacker's,
and checks that a refusal is one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

import hybrid_npu

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


MiB = 1 << 20

CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class PeakRSS:
    """The largest RSS of a process (this one by default) while the block runs, sampled every 10 ms."""

    def __init__(self, pid: int | None = None):
        self.proc = psutil.Process(pid)
        self.peak = 0

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._done.wait(0.01)

    def __enter__(self) -> "PeakRSS":
        self.start = self.proc.memory_info().rss
        self.t0 = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.seconds = time.monotonic() - self.t0
        self.grew = max(self.peak - self.start, 0)


def template_export(root: Path, source: str, full: bool = False) -> Path:
    """An export whose chat template is `source`: the embedded model with model.json's template
    replaced (full=True, it can run), or only the files --render-only reads."""
    src = hybrid_npu.default_model()
    out = root / "hostile-export"
    if full:
        shutil.copytree(src, out)
    else:
        out.mkdir(parents=True)
        shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
        shutil.copy(src / "model.json", out / "model.json")
    manifest = json.loads((out / "model.json").read_text(encoding="utf-8"))
    manifest["tokenizer"]["chat_template"] = source
    (out / "model.json").write_text(json.dumps(manifest), encoding="utf-8")
    return out


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text[-2000:]
    assert "Traceback" not in text
    return lines[0]
