"""How far one context's next-token logits move with how its tokens are batched: the prefill
chunk over all of it, prefill then one decode step, prefill then two decode steps, and the CPU
verify graph's root row (a 2-node tree). Greedy speculation equals plain greedy decoding exactly
where the top two logits are further apart than this. A float export agrees to fp32 rounding; a
quantised one (MatMulNBits rounds its input rows to int8 per block) does not (docs/speculation.md,
tenth pass). Prints one JSON object.

    python scripts/batch_invariance.py --model EXPORT [--tokens 30] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import cpu_model  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

from hybrid_npu.cli_common import OneLineParser  # noqa: E402


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tokens < 3:
        ap.error(f"--tokens {args.tokens}: give 3 or more (two decode steps after a prefill)")
    import hybrid_npu
    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime.speculative import Tree, tree_feed

    try:
        engine = hybrid_npu.load(args.model, threads=args.threads)
    except UserError as e:
        ap.error(str(e))
    ids = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, args.tokens)]
    chunk = engine.prefill_logits(ids).copy()
    engine.prefill_logits(ids[:-1])
    one = engine.decode(ids[-1]).copy()
    engine.prefill_logits(ids[:-2])
    engine.decode(ids[-2])
    two = engine.decode(ids[-1]).copy()
    engine.prefill_logits(ids[:-1])
    verify = engine.pipelines["verify"].run(tree_feed(engine.config, engine.state, Tree([ids[-1], 0], [-1, 0])))
    verify = verify["logits"][0]
    paths = {"chunk": chunk, "prefill_then_decode": one, "prefill_then_two_decodes": two, "verify_root": verify}
    top2 = np.sort(chunk)[-2:]
    result = {"machine": {"cpu": cpu_model()}, "model": str(args.model), "weights": engine.manifest["weights"].get("mode"),
              "tokens": args.tokens, "logit_scale": round(float(np.abs(chunk).max()), 4),
              "chunk_top2_gap": round(float(top2[1] - top2[0]), 6),
              "max_abs_diff_vs_chunk": {k: float(np.abs(v - chunk).max()) for k, v in paths.items() if k != "chunk"},
              "argmax": {k: int(v.argmax()) for k, v in paths.items()}}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
