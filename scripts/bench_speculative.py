"""Speculative decoding on the embedded model and its trained EAGLE-3 drafter: acceptance length
and decode tokens/s, plain vs tree vs chain, on held-out prompts (scripts/stdlib_corpus.py).

Every speculative run is checked against the plain greedy run of the same prompt: a mismatch
is reported in the JSON (it would be a bug: speculation is lossless).

    python scripts/bench_speculative.py [--model EXPORT] [--prompts 16] [--new 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402

# EAGLE-2 tree shapes (research/eagle3.md §1.6); a chain is the tree of width 1
SHAPES = {"tree": {"top_k": 4, "depth": 6, "total_tokens": 31},
          "chain": {"top_k": 1, "depth": 6, "total_tokens": 6}}


def held_out_prompts(n: int) -> list[str]:
    docs = [d for d in stdlib_corpus.documents() if d.held_out and d.kind != "code"]
    docs.sort(key=lambda d: d.name)
    return [stdlib_corpus.chat_text(d.prompt) for d in docs[:n]]


def run(engine, prompts, new, mode):
    total_new = total_s = rounds = accepted_plus_rounds = draft_s = verify_s = 0
    outputs = []
    for text in prompts:
        ids = engine.tokenizer.encode(text).ids
        engine.generate(ids, 1, speculative=False)  # prefill cost out of the timing below
        t0 = time.perf_counter()
        out = engine.generate(ids, new, speculative=mode != "plain")
        s = engine.last_stats
        total_s += time.perf_counter() - t0 - s["ttft_s"]
        total_new += len(out) - 1  # the first token comes from the prefill
        outputs.append(out)
        if mode != "plain":
            rounds += s["rounds"]
            accepted_plus_rounds += s["acceptance_length"] * s["rounds"]
            draft_s, verify_s = draft_s + s["draft_s"], verify_s + s["verify_s"]
    row = {"decode_tokens_per_s": round(total_new / total_s, 2), "new_tokens": total_new}
    if mode != "plain":
        row["acceptance_length"] = round(accepted_plus_rounds / max(rounds, 1), 3)
        row["rounds"] = rounds
        row["draft_ms_per_round"] = round(1e3 * draft_s / max(rounds, 1), 2)
        row["verify_ms_per_round"] = round(1e3 * verify_s / max(rounds, 1), 2)
    return row, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an export with drafter/ (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    import hybrid_npu

    engine = hybrid_npu.load(args.model or hybrid_npu.default_model(), threads=args.threads)
    if engine.drafter is None:
        print("bench_speculative: the model has no drafter/", file=sys.stderr)
        return 2
    prompts = held_out_prompts(args.prompts)
    result = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": args.threads,
              "prompts": len(prompts), "new_tokens_per_prompt": args.new, "greedy": True, "rows": {}}
    plain, reference = run(engine, prompts, args.new, "plain")
    result["rows"]["plain"] = plain
    for name, shape in SHAPES.items():
        engine.draft_shape = dict(shape, total_tokens=min(shape["total_tokens"],
                                                          engine.manifest["graphs"]["verify"]["n"] - 1))
        row, outputs = run(engine, prompts, args.new, name)
        row["speedup"] = round(row["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 2)
        row["mismatched_prompts"] = sum(a != b for a, b in zip(outputs, reference))
        row["shape"] = engine.draft_shape
        result["rows"][name] = row
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
