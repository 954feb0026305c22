"""Paired A/B of two speculation-policy settings (runtime/spec_policy.py's fields) on the embedded
pair's held-out chat prompts, in one process: plain decoding, the policy with --a's settings, with
--b's, and a round every step, each on its own engine (its own policy and sessions), the four
rotated repeat by repeat (bench_speculative.rotated) so no arm always runs in the same slot.
With --context N the replies come after N tokens of held-out source ending in a chat prompt
(bench_speculative's context rows: --context-prompts of them, 96 new tokens each, no stop).
Each speculative reply is checked against the plain one (lossless). Prints one JSON object: per
arm the best rate, the median of its per-repeat ratios to the plain run of the same repeat, and the
plain steps and rounds it ran.

    python scripts/ab_spec_policy.py --a max_refresh_every=16 --b max_refresh_every=64 [--prompts 16] [--repeats 4]
        [--context 6000 --context-prompts 4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)
from bench_cpu import cpu_model  # noqa: E402
from bench_speculative import context_prompts, held_out_prompts, paired, rotated, run, set_mode  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402


def settings(text: str) -> dict:
    """"field=value,field=value" -> {field: value} for SpecPolicy (numbers only)."""
    from dataclasses import fields

    from hybrid_npu.runtime.spec_policy import SpecPolicy

    known = {f.name for f in fields(SpecPolicy) if not f.name.startswith("_")}
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise UserError(f"{item!r}: give FIELD=NUMBER with a SpecPolicy field, e.g. max_refresh_every=16")
        try:
            out[name] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise UserError(f"{item!r}: {value!r} is not a number") from None
    return out


def engine_with(overrides: dict, threads: int, drafter: str | None = None, model=None):
    """An engine (default: the embedded model) whose speculation policies take `overrides`."""
    import hybrid_npu
    from hybrid_npu.runtime.spec_policy import SpecPolicy

    engine = hybrid_npu.load(hybrid_npu.DEFAULT_MODEL if model is None else model, threads=threads, drafter=drafter)
    engine.make_policy = lambda e: SpecPolicy(e.draft_shape["depth"], verify_nodes=e.verify_graph,
                                              verify_graphs=e.verify_graphs, **overrides)
    return engine


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--a", required=True, help="SpecPolicy settings of arm A, e.g. max_refresh_every=16")
    ap.add_argument("--b", required=True, help="... of arm B")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--new", type=int, default=128, help="new tokens a chat reply (96 after a --context)")
    ap.add_argument("--context", type=int, default=0, help="replies after this many tokens of source (0: chat)")
    ap.add_argument("--context-prompts", type=int, default=4)
    ap.add_argument("--drafter", choices=("eagle3", "mtp"), help="the package's drafter to run (default: its default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    try:
        arms = {"a": settings(args.a), "b": settings(args.b)}
    except UserError as e:
        print(f"ab_spec_policy.py: error: {e}", file=sys.stderr)
        return 2
    if args.context < 0 or args.context_prompts < 1:
        print("ab_spec_policy.py: error: give --context >= 0 and --context-prompts >= 1", file=sys.stderr)
        return 2
    prompts = held_out_prompts(args.prompts)
    engines = {name: engine_with(o, args.threads, args.drafter) for name, o in arms.items()}
    long_context = args.context > 0
    if long_context:
        prompts = context_prompts(engines["a"].tokenizer, prompts, [args.context], args.context_prompts)[args.context]
    new = 96 if long_context else args.new
    modes = ["plain", "a", "b", "always"]
    rates = {m: [] for m in modes}
    rows = {m: [] for m in modes}
    reference = None
    for r in range(args.repeats):
        for mode in rotated(modes, r):
            engine = engines["b" if mode == "b" else "a"]
            set_mode(engine, "always" if mode == "always" else "adaptive", engine.draft_shape)
            row, outputs = run(engine, prompts, new, "plain" if mode == "plain" else "adaptive", long_context)
            if reference is None and mode == "plain":
                reference = outputs
            row["mismatched_prompts"] = sum(o != p for o, p in zip(outputs, reference)) if reference else None
            rates[mode].append(row["decode_tokens_per_s"])
            rows[mode].append(row)
    result = {"machine": cpu_model(), "threads": args.threads, "prompts": len(prompts), "repeats": args.repeats,
              "context": args.context, "drafter": args.drafter or "the package's default",
              "arms": {"a": args.a, "b": args.b, "always": "a round every step", "plain": "no speculation"},
              "rows": {m: {"best_tokens_per_s": max(rates[m]), **paired(rates[m], rates["plain"]),
                           "rounds": [x.get("rounds") for x in rows[m]],
                           "plain_steps": [x.get("plain_steps") for x in rows[m]],
                           "mismatched_prompts": [x["mismatched_prompts"] for x in rows[m]]} for m in modes}}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
