"""What the hostile-input suites share: a peak-RSS watch (psutil, any OS), an export whose chat
template is the attacker's, and a check that a refusal is one line."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import psutil

import hybrid_npu

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
