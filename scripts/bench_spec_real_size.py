"""Speculation left on at real size, where the drafter is never right: is it still no slower than
plain decoding? The Qwen3.5-0.8B config with random weights at int4 and a random MTP head of the
released layout (scripts/random_checkpoint.py), its vocabulary whole or trimmed (--mtp-vocab), so
the drafts are almost never accepted: the worst case for the default, adaptive speculation, whose
policy must notice and decode plainly. Replies after a random prompt, the same engine generating
plainly and speculatively in turn (pairs alternated, fresh context each), greedy, every pair's
outputs compared (counted: an int4 export's verify can part from its decode on near-tied logits,
which random weights have). Decode rates (after the prefill), paired. Prints one JSON object.

    python scripts/bench_spec_real_size.py [--mtp-vocabs full,32768] [--prompt 512] [--new 64] [--pairs 6]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import machine  # noqa: E402
from random_checkpoint import make_random_checkpoint, make_random_mtp  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def one_export(src: Path, mtp_dir: Path, out: Path, vocab: str) -> Path:
    from hybrid_npu.export.exporter import export

    if not (out / "model.json").is_file():
        export(src, out, weights="int4", mtp=mtp_dir, mtp_vocab=None if vocab == "full" else int(vocab),
               warn=lambda msg: None)
    return out


def pairs(export_dir: Path, prompt: list[int], new: int, n: int, threads: int) -> dict:
    import hybrid_npu

    engine = hybrid_npu.load(export_dir, threads=threads)
    while not engine.pipelines.ready("verify"):  # (opened in the background at load)
        time.sleep(0.1)
    for speculative in (False, True):  # a pair to warm every session, not counted
        engine.generate(prompt, 8, stop_at_eos=False, speculative=speculative)
    rates, ratios, rounds, plain_steps, mismatches = {"plain": [], "speculative": []}, [], 0, 0, 0
    for i in range(n):
        got = {}
        for arm in (("plain", "speculative") if i % 2 == 0 else ("speculative", "plain")):
            got[arm] = engine.generate(prompt, new, stop_at_eos=False, speculative=arm == "speculative")
            rates[arm].append(engine.last_stats["decode_tokens_per_s"])
            if arm == "speculative":
                rounds += engine.last_stats["rounds"]
                plain_steps += engine.last_stats["plain_steps"]
        # greedy, yet an int4 export's verify may part from its decode on near-tied logits (README,
        # "Quantised weights"): random weights give flat logits, so this counts, not asserts
        mismatches += got["plain"] != got["speculative"]
        ratios.append(rates["speculative"][-1] / rates["plain"][-1])
    return {"decode_tok_s_best": round(max(rates["plain"]), 2),
            "speculative_decode_tok_s_best": round(max(rates["speculative"]), 2),
            "paired_median": round(statistics.median(ratios), 4), "paired": [round(r, 3) for r in ratios],
            "rounds": rounds, "plain_steps": plain_steps, "mismatches": mismatches,
            "drafter_weights_bytes": engine.drafter.manifest["weights"]["bytes"],
            "draft_vocab": len(engine.drafter.draft_to_target)}


def main() -> int:
    from hybrid_npu.cli_common import OneLineParser

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtp-vocabs", default="full,32768")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_verify_sizes"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from hybrid_npu.config import ModelConfig
    from hybrid_npu.export.checkpoint import read_checkpoint

    src = make_random_checkpoint("0.8B", args.workdir / "qwen35-0.8B-random")
    cfg: ModelConfig = read_checkpoint(src).config
    mtp_dir = make_random_mtp(cfg, args.workdir / "mtp-0.8B")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt)]
    rows = {}
    for vocab in args.mtp_vocabs.split(","):
        out = one_export(src, mtp_dir, args.workdir / f"export-0.8B-int4-mtp-{vocab}", vocab)
        rows[f"mtp-{vocab}"] = pairs(out, prompt, args.new, args.pairs, args.threads)
        print(vocab, rows[f"mtp-{vocab}"], file=sys.stderr, flush=True)
    bench_json.emit({"machine": machine(), "model": "Qwen3.5-0.8B config, random weights, int4; random MTP head",
                     "prompt_tokens": args.prompt, "new_tokens": args.new, "threads": args.threads,
                     "policy": "adaptive (the default)", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
