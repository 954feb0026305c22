"""How many tokens each chat turn prefills, with turn checkpoints and without (checkpoints=0: the
engine can only keep a context that is a prefix of the next prompt, else it starts over).

    python scripts/bench/bench_chat_turns.py [MODEL] [--turns 6] [--max-new-tokens 24] [--think]

Prints one JSON object: per-turn prefill tokens, context tokens and prefill seconds for both runs.
"""
from __future__ import annotations

import argparse
import sys
import time

import harness  # one JSON object, machine and commit recorded (this folder is on sys.path when run)
import hybrid_npu
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling

MESSAGES = ["Write a function that reverses a list.", "Now make it work on strings too.",
            "Add a docstring and type hints.", "Write a test for it.", "Make the test cover empty input.",
            "Explain the edge cases in one paragraph.", "Now do the same for tuples.", "Summarise what we did."]


def run(model, turns: int, max_new: int, think, checkpoints: int) -> list[dict]:
    engine = hybrid_npu.load_engine(model, checkpoints=checkpoints)
    conv = Conversation(engine, system="You are a careful Python programmer.", enable_thinking=think)
    rows = []
    for user in MESSAGES[:turns]:
        t0 = time.perf_counter()
        reply = conv.reply(user, Sampling(max_new_tokens=max_new, temperature=0.0, speculative=False))
        rows.append({"prefill_tokens": reply.stats["prefill_tokens"], "kept": reply.reused_tokens,
                     "context_tokens": reply.stats["context_tokens"], "prefill_s": round(reply.stats["ttft_s"], 4),
                     "turn_s": round(time.perf_counter() - t0, 4)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--think", action="store_true", default=None)
    a = p.parse_args(argv)
    if not 1 <= a.turns <= len(MESSAGES):
        p.error(f"--turns: give 1 to {len(MESSAGES)}")
    model = a.model or hybrid_npu.default_model()
    out = {"model": str(model), "turns": a.turns, "max_new_tokens": a.max_new_tokens, "think": a.think,
           "with_checkpoints": run(model, a.turns, a.max_new_tokens, a.think, 8),
           "without_checkpoints": run(model, a.turns, a.max_new_tokens, a.think, 0)}
    harness.emit(out)  # one JSON object, with the machine and commit
    return 0


if __name__ == "__main__":
    sys.exit(main())
