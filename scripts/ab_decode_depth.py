"""Paired A/B of decode speed at depth: two exports (same checkpoint, different graphs), alternated
A B, B A, ... (the order turned each round) each in a fresh process, decode tok/s at each context length (the K/V rows filled with
random values as bench_context.py does: decode cost depends on how many rows there are, not on
their values; the rate of the median step), best of the rounds per arm and length. Gives each arm's depth ratio (decode at the
longest length / at the first) and B / A per length. Prints one JSON object.

    python scripts/ab_decode_depth.py --a EXPORT_A --b EXPORT_B [--lengths 0,2048,8192]
                                      [--rounds 3] [--steps 24] [--threads 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_context import fill_context  # noqa: E402
from bench_cpu import cpu_model, fresh_process  # noqa: E402
from bench_speculative import paired, rotated  # noqa: E402  (the arm order turned each round, the median paired ratio)

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def decode_rates(export_dir: Path, lengths: list[int], steps: int, threads: int) -> list[float]:
    """Decode tok/s at each context length, one engine (run in a fresh process)."""
    import hybrid_npu
    from hybrid_npu.runtime import huge_pages

    engine = hybrid_npu.load(export_dir, threads=threads)
    huge_pages.wait()  # the prepacked weights settled on huge pages (runtime/huge_pages.py) before timing
    rng = np.random.default_rng(0)
    rates = []
    for length in lengths:
        fill_context(engine, length, rng)
        engine.decode(1), engine.decode(1)  # warm-up at this size
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.decode(1)
            times.append(time.perf_counter() - t0)
        rates.append(round(1 / float(np.median(times)), 2))  # the median step: robust to this VM's spikes
    return rates


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True)
    ap.add_argument("--b", type=Path, required=True)
    ap.add_argument("--lengths", default="0,2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    for arm in (args.a, args.b):
        if not (arm / "model.json").is_file():
            ap.error(f"{arm} is not an export (no model.json); make one with export-hybrid")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths {args.lengths!r} is not a comma-separated list of token counts, e.g. 0,2048,8192")
    runs: dict[str, list[list[float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in rotated(["a", "b"], r):  # turned each round: no slot's advantage goes to one arm
            runs[name].append(fresh_process(decode_rates, getattr(args, name), lengths, args.steps, args.threads))
            print(name, dict(zip(lengths, runs[name][-1])), file=sys.stderr, flush=True)
    result = {"machine": {"cpu": cpu_model()}, "threads": args.threads, "steps": args.steps, "lengths": lengths}
    best = {}
    for name in ("a", "b"):
        best[name] = [max(r[j] for r in runs[name]) for j in range(len(lengths))]
        result[name] = {"export": str(getattr(args, name)), "runs": runs[name], "best_decode_tokens_per_s": best[name],
                        "depth_ratio": round(best[name][-1] / best[name][0], 3)}
    result["b_over_a"] = [round(b / a, 3) for a, b in zip(best["a"], best["b"])]
    result["b_over_a_paired"] = [paired([r[j] for r in runs["b"]], [r[j] for r in runs["a"]])["paired_vs_plain"]
                                 for j in range(len(lengths))]
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
