"""The main job on a machine with nothing downloaded: the embedded default model (trained here on
the Python standard library's sources, shipped inside the package with its EAGLE-3 drafter)
answers a chat turn with speculative decoding, and the same answer is checked against plain
decoding (speculation is lossless).

    python scripts/demo.py [--prompt TEXT] [--max-new-tokens 96] [--repeats 5]

The rates compare like with like: one reply of each kind first warms both (sessions opened, the
drafter's policy measured), then speculative and plain replies alternate --repeats times, so load
from anything else on the machine meets both, and each rate is its best reply's.
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="Write a Python function that does this: Return the number of lines in a file.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5, help="alternating timed replies of each kind (default: 5)")
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.runtime.chat.template import ChatTemplate
    from hybrid_npu.runtime.chat.conversation import encode_turns

    engine = hybrid_npu.load_engine(hybrid_npu.default_model())
    ids = encode_turns(engine, ChatTemplate.from_export(engine.path), [{"role": "user", "content": args.prompt}],
                       enable_thinking=False)
    replies, best = {True: set(), False: set()}, {}
    for run in range(1 + max(args.repeats, 1)):  # run 0 warms both and is not counted
        for speculative in ((True, False) if run % 2 else (False, True)):  # each kind goes first in turn
            replies[speculative].add(tuple(engine.generate(ids, args.max_new_tokens, speculative=speculative)))
            stats = engine.last_stats
            rate = stats["decode_tokens_per_s"]
            if run and rate > best.get(speculative, {"decode_tokens_per_s": 0.0})["decode_tokens_per_s"]:
                best[speculative] = stats
    identical = len(replies[True] | replies[False]) == 1  # every reply, speculative or plain, the same
    fast = list(next(iter(replies[True])))
    print("user:", args.prompt)
    print("assistant:", engine.tokenizer.decode(fast))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in best[True].items()}, indent=1))
    print(f"speculative {best[True]['decode_tokens_per_s']:.1f} tok/s vs plain {best[False]['decode_tokens_per_s']:.1f}"
          f" tok/s (best of {max(args.repeats, 1)} alternating warm replies each); identical output: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
