"""Cost of the export integrity hash (src/hybrid_npu/integrity.py) on a weights-sized file: prints JSON.

    python scripts/bench_integrity_hash.py FILE [--algos blake2b,sha256]

FILE: e.g. a 0.8B export's graphs/weights.bin, or random bytes of that size
(head -c 1600M /dev/urandom > /tmp/w.bin). Each algorithm streams the file twice (the first read
may come from disk, the second from the page cache); both times are reported.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

CHUNK = 1 << 20


def stream(path: Path, algo: str) -> tuple[str, float]:
    h = hashlib.new(algo)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--algos", default="blake2b,sha256")
    a = ap.parse_args()
    path = Path(a.file)
    size = path.stat().st_size
    out = {"file": str(path), "bytes": size, "results": []}
    for algo in a.algos.split(","):
        for attempt in ("first", "second"):
            _, s = stream(path, algo)
            out["results"].append({"algo": algo, "pass": attempt, "seconds": round(s, 3),
                                   "gb_per_s": round(size / s / 1e9, 2)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
