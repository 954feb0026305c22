"""Speculative decoding in a real multi-turn chat: one conversation of held-out chat prompts, turn
after turn, through the export's own chat template (runtime/conversation.py: each turn keeps the
context and prefills only what is new), on two engines of the same export loaded side by side, one
speculating (the default policy) and one decoding plainly. The two replies of a turn are generated
one after the other, the order swapped every turn, so load from other jobs hits both.

Per turn: context length, tokens reused, decode tok/s of both, the speculative reply's rounds and
plain steps, and whether the two replies are the same tokens (greedy: speculation is lossless, a
mismatch would be a bug and is reported). Summary: the median of the per-turn ratios, over all
turns and over those with no round at all (what speculation on by default costs where it does not
speculate). --fresh times the first turn while the verify session is still opening (a new user's
first reply, as `npu-chat` starts); by default both engines wait for it first.

    python scripts/bench_spec_chat.py [--model EXPORT] [--turns 12] [--new 128] [--threads 2]
        [--fresh] [--out F]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)
from bench_speculative import held_out_messages, machine  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402


def measure(model: Path | None, turns: int, new: int, threads: int, fresh: bool) -> dict:
    import hybrid_npu
    from hybrid_npu.runtime.conversation import Conversation, Sampling

    path = model or hybrid_npu.default_model()
    engines = {mode: hybrid_npu.load(path, threads=threads) for mode in ("speculative", "plain")}
    if engines["speculative"].drafter is None:
        raise UserError(f"{path} has no drafter; export one with: export-hybrid SOURCE OUT --drafter DRAFTER")
    if not fresh:
        for engine in engines.values():
            engine.pipelines["verify"]  # wait for the background open: steady turns only
    chats = {mode: Conversation(engine) for mode, engine in engines.items()}
    rows = []
    for i, text in enumerate(held_out_messages(turns)):
        replies = {}
        for mode in ("speculative", "plain") if i % 2 == 0 else ("plain", "speculative"):
            sampling = Sampling(max_new_tokens=new, temperature=0.0, speculative=mode == "speculative")
            replies[mode] = chats[mode].reply(text, sampling)
        s, p = replies["speculative"], replies["plain"]
        rows.append({"turn": i, "context_tokens": s.stats["context_tokens"], "reused_tokens": s.reused_tokens,
                     "new_tokens": len(s.token_ids), "same_output": s.token_ids == p.token_ids,
                     "speculative_tok_s": round(s.stats["decode_tokens_per_s"], 1),
                     "plain_tok_s": round(p.stats["decode_tokens_per_s"], 1),
                     "ratio": round(s.stats["decode_tokens_per_s"] / p.stats["decode_tokens_per_s"], 3),
                     "rounds": s.stats["rounds"], "plain_steps": s.stats["plain_steps"],
                     "acceptance_length": round(s.stats["acceptance_length"], 2),
                     "ttft_ms": {"speculative": round(s.stats["ttft_s"] * 1e3, 1),
                                 "plain": round(p.stats["ttft_s"] * 1e3, 1)}})
    no_round = [r["ratio"] for r in rows if r["rounds"] == 0]
    return {"machine": machine(), "model": str(path), "threads": threads, "new_tokens_per_turn": new,
            "fresh_first_turn": fresh, "turns": rows,
            "mismatches": sum(not r["same_output"] for r in rows),
            "median_ratio": round(statistics.median(r["ratio"] for r in rows), 3),
            "median_ratio_no_round": round(statistics.median(no_round), 3) if no_round else None,
            "turns_with_rounds": sum(r["rounds"] > 0 for r in rows)}


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an export with a drafter (default: the embedded model)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--new", type=int, default=128, help="new tokens at most per reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="time the first turn while the verify session opens")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("turns", "new", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    try:
        result = measure(args.model, args.turns, args.new, args.threads, args.fresh)
    except UserError as e:
        print(f"bench_spec_chat: {e}", file=sys.stderr)
        return 2
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
