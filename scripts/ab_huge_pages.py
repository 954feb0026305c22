"""Paired A/B of huge pages (runtime/huge_pages.py) in one process: two engines of one export, one
made with HYBRID_NPU_HUGE_PAGES=0 and one without, their generations (or prefills) alternated
round by round (A B, then B A), so the VM's drift hits both alike. Reports each round's tok/s, the
best per arm, the median of the per-round ratios B / A, and how much of the process is on huge
pages. Linux only (elsewhere both arms are the same). Prints one JSON object.

    python scripts/ab_huge_pages.py EXPORT_DIR [--measure decode|prefill] [--rounds 8]
                                    [--threads 2] [--tokens 32] [--prompt 512] [--out FILE]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import cpu_model  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def anon_huge_mb() -> float | None:
    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.exists():
        return None
    line = next((x for x in rollup.read_text().splitlines() if x.startswith("AnonHugePages:")), None)
    return None if line is None else round(int(line.split()[1]) / 1024, 1)


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--measure", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a round (--measure decode)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a round (--measure prefill)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    import hybrid_npu
    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime import huge_pages

    engines = {}
    try:
        for arm, value in (("a_small_pages", "0"), ("b_huge_pages", "1")):
            os.environ["HYBRID_NPU_HUGE_PAGES"] = value
            engines[arm] = hybrid_npu.load(args.export_dir, threads=args.threads)
            huge_pages.wait()
            engines[arm].prefill_logits(list(range(16)))  # warm-up
    except UserError as e:
        print(f"ab_huge_pages.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        os.environ.pop("HYBRID_NPU_HUGE_PAGES", None)
    rates = {arm: [] for arm in engines}
    prompt = [i % 1000 for i in range(args.prompt)]
    for r in range(args.rounds):
        for arm in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            engine = engines[arm]
            if args.measure == "decode":
                engine.generate(list(range(16)), args.tokens, stop_at_eos=False)
                rates[arm].append(round(engine.last_stats["decode_tokens_per_s"], 2))
            else:
                engine.prefill_logits(prompt)
                rates[arm].append(round(engine.last_stats["prefill_tokens_per_s"], 2))
    a, b = (np.array(rates[k]) for k in engines)
    bench_json.emit({"machine": cpu_model(), "export": str(args.export_dir), "measure": args.measure,
                     "threads": args.threads, "anon_huge_pages_mb": anon_huge_mb(), "tokens_per_s": rates,
                     "best": {k: max(v) for k, v in rates.items()},
                     "median_ratio_b_over_a": round(float(np.median(b / a)), 3),
                     "rounds_b_ahead": int((b > a).sum())}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
