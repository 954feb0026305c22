"""Speculative decoding in a real multi-turn chat: one conversation of held-out chat prompts, turn
after turn, through the export's own chat template (runtime/chat/conversation.py: each turn keeps the
context and prefills only what is new), on two engines of the same export loaded side by side, one
speculating (the default policy) and one decoding plainly. The two replies of a turn are generated
one after the other, the order swapped every turn, so load from other jobs hits both.

Per turn: context length, tokens reused, decode tok/s of both, the speculative reply's rounds and
plain steps, and whether the two replies are the same tokens (greedy: speculation is lossless, a
mismatch would be a bug and is reported). Summary: the median of the per-turn ratios, over all
turns and over those with no round at all (what speculation on by default costs where it does not
speculate). --fresh times the first turn while the verify session is still opening (a new user's
first reply, as `npu-chat` starts); by default both engines wait for it first. `chat_ratio` is the
whole chat's: the plain replies' decode time over the speculative ones'.

--policy-b SETTINGS adds a third engine, speculating with a policy that takes those SpecPolicy
settings (bench_speculative.py's --policy-b form, e.g. probe_budget=0.02): the same conversation, its
replies checked against the plain ones too, its per-turn `ratio_b` and summary `*_b` beside the
default's. With three engines the order of a turn is the three turned by the turn's index.

    python scripts/bench/bench_spec_chat.py [--model EXPORT] [--turns 12] [--new 128] [--threads 2]
        [--fresh] [--policy-b probe_budget=0.02] [--out F]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)
from bench_speculative import engine_with, held_out_messages, machine, rotated, settings  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402


def measure(model: Path | None, turns: int, new: int, threads: int, fresh: bool, policy_b: dict | None = None) -> dict:
    import hybrid_npu
    from hybrid_npu.runtime.chat.conversation import Conversation, Sampling

    path = model or hybrid_npu.default_model()
    engines = {mode: hybrid_npu.load_engine(path, threads=threads) for mode in ("speculative", "plain")}
    if policy_b is not None:
        engines["speculative_b"] = engine_with(policy_b, threads, model=path)
    if engines["speculative"].drafter is None:
        raise UserError(f"{path} has no drafter; export one with: export-hybrid SOURCE OUT --drafter DRAFTER")
    if not fresh:
        for engine in engines.values():
            engine.pipelines["verify"]  # wait for the background open: steady turns only
    chats = {mode: Conversation(engine) for mode, engine in engines.items()}
    rows = []
    for i, text in enumerate(held_out_messages(turns)):
        replies = {}
        order = ["speculative", "plain"] if i % 2 == 0 else ["plain", "speculative"]
        if policy_b is not None:
            order = rotated(["speculative", "plain", "speculative_b"], i)
        for mode in order:
            sampling = Sampling(max_new_tokens=new, temperature=0.0, speculative=mode != "plain")
            replies[mode] = chats[mode].reply(text, sampling)
        s, p = replies["speculative"], replies["plain"]
        rows.append(row := {"turn": i, "context_tokens": s.stats["context_tokens"], "reused_tokens": s.reused_tokens,
                     "new_tokens": len(s.token_ids), "same_output": s.token_ids == p.token_ids,
                     "speculative_tok_s": round(s.stats["decode_tokens_per_s"], 1),
                     "plain_tok_s": round(p.stats["decode_tokens_per_s"], 1),
                     "ratio": round(s.stats["decode_tokens_per_s"] / p.stats["decode_tokens_per_s"], 3),
                     "rounds": s.stats["rounds"], "plain_steps": s.stats["plain_steps"],
                     "acceptance_length": round(s.stats["acceptance_length"], 2),
                     "ttft_ms": {"speculative": round(s.stats["ttft_s"] * 1e3, 1),
                                 "plain": round(p.stats["ttft_s"] * 1e3, 1)}})
        if policy_b is not None:
            b = replies["speculative_b"]
            row.update(same_output_b=b.token_ids == p.token_ids, speculative_b_tok_s=round(b.stats["decode_tokens_per_s"], 1),
                       ratio_b=round(b.stats["decode_tokens_per_s"] / p.stats["decode_tokens_per_s"], 3),
                       rounds_b=b.stats["rounds"], plain_steps_b=b.stats["plain_steps"])
    no_round = [r["ratio"] for r in rows if r["rounds"] == 0]
    summary_b = {}
    if policy_b is not None:
        summary_b = {"policy_b": policy_b, "mismatches_b": sum(not r["same_output_b"] for r in rows),
                     "median_ratio_b": round(statistics.median(r["ratio_b"] for r in rows), 3),
                     "chat_ratio_b": chat_ratio(rows, "speculative_b_tok_s")}
    return {"machine": machine(), "model": str(path), "threads": threads, "new_tokens_per_turn": new,
            "fresh_first_turn": fresh, "turns": rows,
            "mismatches": sum(not r["same_output"] for r in rows),
            "median_ratio": round(statistics.median(r["ratio"] for r in rows), 3),
            "median_ratio_no_round": round(statistics.median(no_round), 3) if no_round else None,
            "turns_with_rounds": sum(r["rounds"] > 0 for r in rows),
            "chat_ratio": chat_ratio(rows, "speculative_tok_s"), **summary_b}


def chat_ratio(rows: list[dict], key: str) -> float:
    """The whole chat's decode time plainly over its time speculating (the replies' lengths over their
    rates): what the conversation took, where the median of the turns weighs an 11-token turn as a
    128-token one."""
    seconds = lambda rate: sum((r["new_tokens"] - 1) / r[rate] for r in rows if r["new_tokens"] > 1)  # noqa: E731
    return round(seconds("plain_tok_s") / max(seconds(key), 1e-12), 3)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an export with a drafter (default: the embedded model)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--new", type=int, default=128, help="new tokens at most per reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="time the first turn while the verify session opens")
    ap.add_argument("--policy-b", help="SpecPolicy settings of a third, speculating engine, e.g. probe_budget=0.02")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("turns", "new", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    try:
        policy_b = settings(args.policy_b) if args.policy_b is not None else None
        result = measure(args.model, args.turns, args.new, args.threads, args.fresh, policy_b)
    except UserError as e:
        print(f"bench_spec_chat: {e}", file=sys.stderr)
        return 2
    harness.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
