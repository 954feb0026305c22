"""The main job on a machine with nothing downloaded: the embedded default model (trained here on
the Python standard library's sources, shipped inside the package with its EAGLE-3 drafter)
answers a chat turn with speculative decoding, and the same answer is checked against plain
decoding (speculation is lossless).

    python scripts/demo.py [--prompt TEXT] [--max-new-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="Write a Python function that does this: Return the number of lines in a file.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.runtime.chat_template import ChatTemplate
    from hybrid_npu.runtime.conversation import encode_turns

    engine = hybrid_npu.load(hybrid_npu.default_model())
    ids = encode_turns(engine, ChatTemplate.from_export(engine.path), [{"role": "user", "content": args.prompt}],
                       enable_thinking=False)
    fast = engine.generate(ids, args.max_new_tokens, speculative=True)
    stats = engine.last_stats
    plain = engine.generate(ids, args.max_new_tokens, speculative=False)
    print("user:", args.prompt)
    print("assistant:", engine.tokenizer.decode(fast))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}, indent=1))
    print(f"speculative {stats['decode_tokens_per_s']:.1f} tok/s vs plain {engine.last_stats['decode_tokens_per_s']:.1f}"
          f" tok/s; identical output: {fast == plain}")
    return 0 if fast == plain else 1


if __name__ == "__main__":
    sys.exit(main())
