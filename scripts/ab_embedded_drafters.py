"""Two exports of the same target with different drafters, paired in one process: plain decoding
(export A) against chain speculation with A's drafter and with B's, every step and adaptive, on
held-out chat prompts (bench_speculative.py's), or with --context L after contexts of L tokens
(bench_speculative.py's context rows: held-out source ending in a held-out prompt, no stop), the
arms' order turned each round. Every speculative output is checked against plain greedy. Prints
one JSON object.

    python scripts/ab_embedded_drafters.py --a OLD_EXPORT --b NEW_EXPORT [--rounds 6] [--prompts 8] [--new 96]
        [--depth 6] [--context L]
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import (context_prompts, held_out_prompts, machine, own_paired, paired, rotated,  # noqa: E402
                               run, set_mode)

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="the baseline export (with drafter/)")
    ap.add_argument("--b", type=Path, required=True, help="the same target with the other drafter")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=6, help="the chain's depth (the embedded export records 14)")
    ap.add_argument("--context", type=int, default=0,
                    help="context length in tokens; --prompts contexts of it (0: the chat prompts alone)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import hybrid_npu

    for p in (args.a, args.b):
        if not (p / "model.json").is_file():
            print(f"ab_embedded_drafters.py: error: {p} is not an export (no model.json)", file=sys.stderr)
            return 2
    if args.depth < 1 or args.context < 0 or args.prompts < 1:
        print("ab_embedded_drafters.py: error: --depth and --prompts must be >= 1 and --context >= 0", file=sys.stderr)
        return 2
    chain = {"top_k": 1, "depth": args.depth, "total_tokens": args.depth}
    engines = {"a": hybrid_npu.load(args.a, threads=args.threads), "b": hybrid_npu.load(args.b, threads=args.threads)}
    prompts = held_out_prompts(args.prompts)
    if args.context:
        try:
            prompts = context_prompts(engines["a"].tokenizer, prompts, [args.context], args.prompts)[args.context]
        except ValueError as e:
            print(f"ab_embedded_drafters.py: error: {e}", file=sys.stderr)
            return 2
    arms = [("plain", "a", "plain"), ("a_always", "a", "always"), ("b_always", "b", "always"),
            ("a_adaptive", "a", "adaptive"), ("b_adaptive", "b", "adaptive")]
    rates = {name: [] for name, _, _ in arms}
    own = {name: [] for name, _, _ in arms}
    last, mismatches, reference = {}, 0, None
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.time()
    for r in range(args.rounds):
        for name, which, mode in rotated(arms, r):
            engine = engines[which]
            set_mode(engine, mode, chain)
            row, outputs = run(engine, prompts, args.new, mode, long_context=bool(args.context))
            if name == "plain" and reference is None:
                reference = outputs
            elif reference is not None and outputs != reference:
                mismatches += 1
            rates[name].append(row["decode_tokens_per_s"])
            own[name].append(row["vs_own_plain_steps"])
            last[name] = row
    plain = rates["plain"]
    rows = {}
    for name, v in rates.items():
        rows[name] = {"best_tokens_per_s": max(v), "vs_plain": round(max(v) / max(plain), 3),
                      "paired_vs_plain": paired(v, plain)["paired_vs_plain"],
                      "per_round": v, **own_paired(own[name], own["plain"]),
                      **{k: last[name][k] for k in ("acceptance_length", "rounds", "plain_steps") if k in last[name]}}
    bench_json.emit({"machine": machine(), "a": str(args.a), "b": str(args.b), "rounds": args.rounds,
                     "prompts": args.prompts, "context_tokens": args.context, "new_tokens": args.new, "shape": chain,
                     "mismatches": mismatches,
                     "load_average_at_start": load_start, "seconds": round(time.time() - t0, 1),
                     "b_over_a_paired": {m: paired(rates[f"b_{m}"], rates[f"a_{m}"])["paired_vs_plain"]
                                         for m in ("always", "adaptive")},
                     "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
