"""How every benchmark script reports: one JSON object on stdout, and the same text in --out."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None = None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
