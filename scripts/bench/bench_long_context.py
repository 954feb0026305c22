"""Ingest a long context on the CPU and report prefill tokens/s per chunk across the run (flat is
the goal: GDN layers cost the same at any depth, only the few attention layers grow) and RSS/PSS.

    python scripts/bench/bench_long_context.py tiny --tokens 100000        (the test suite's tiny fixture)
    python scripts/bench/bench_long_context.py 0.8B --tokens 32768         (real Qwen3.5-0.8B config, random weights)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # fixtures: the tiny checkpoint
sys.path.insert(0, str(HERE.parent / "train"))  # chatml_tokenizer, which fixtures uses
import harness  # noqa: E402  (one JSON object, machine and commit recorded)


def build(which: str, workdir: Path) -> Path:
    from hybrid_npu.export.exporter import export
    from hybrid_npu.manifest import is_export

    out = workdir / f"long-{which}-export"
    if is_export(out):
        return out
    if which == "tiny":
        import fixtures

        fixtures.write_text_checkpoint(workdir / "long-tiny-hf", seed=1, max_position_embeddings=262144)
        src = workdir / "long-tiny-hf"
    else:
        from random_checkpoint import make_random_checkpoint

        src = make_random_checkpoint(which, workdir / f"qwen35-{which}-hybrid-random")
    export(src, out, chunk=128, force=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=["tiny", "0.8B"])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", type=int, default=8192, help="report a window every this many tokens")
    args = ap.parse_args()
    import hybrid_npu

    engine = hybrid_npu.load_engine(build(args.model, args.workdir), threads=args.threads)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, min(engine.config.vocab_size, 300), args.tokens)]
    proc = psutil.Process()
    windows, last = [], {"t": time.perf_counter(), "done": 0}

    def progress(done, total):
        if done - last["done"] >= args.every or done == total:
            now = time.perf_counter()
            windows.append({"tokens": done, "tokens_per_s": round((done - last["done"]) / (now - last["t"]), 1),
                            "rss_gb": round(proc.memory_info().rss / 1e9, 3),
                            "pss_gb": round(proc.memory_full_info().pss / 1e9, 3)})
            print(json.dumps(windows[-1]), file=sys.stderr, flush=True)
            last.update(t=now, done=done)

    t0 = time.perf_counter()
    engine.reset()
    engine.prefill(ids, progress)
    total = time.perf_counter() - t0
    rates = [w["tokens_per_s"] for w in windows]
    harness.emit({"model": args.model, "tokens": args.tokens, "total_s": round(total, 1),
                  "mean_tokens_per_s": round(args.tokens / total, 1),
                  "last_over_first_window": round(rates[-1] / rates[0], 3), "windows": windows,
                  "memory_report": engine.memory_report()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
