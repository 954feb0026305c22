"""Paired A/B of two CPU verify graphs of the same model: both sessions in one process, calls
alternated tree size by tree size (so load from other jobs hits both), the median of --repeats
per arm and size, with one plain decode step per repeat for scale. Before timing, both arms'
logits must agree (≤ 1e-3) on every size. Prints one JSON object.

    python scripts/ab_verify_graph.py --a EXPORT_A --b EXPORT_B [--contexts 24,1500] [--repeats 40]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import cpu_model  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True)
    ap.add_argument("--b", type=Path, required=True)
    ap.add_argument("--contexts", default="24,1500")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    for arm in (args.a, args.b):
        if not (arm / "graphs" / "cpu_verify.onnx").is_file():
            ap.error(f"{arm} has no graphs/cpu_verify.onnx; export it again with export-hybrid")
    import hybrid_npu
    from hybrid_npu.runtime.pipeline import Pipeline, cpu_session
    from hybrid_npu.runtime.speculative import Tree, tree_feed
    from hybrid_npu.runtime.step_inputs import chain_feed

    engine = hybrid_npu.load(args.a, threads=args.threads)
    cfg, rng = engine.config, np.random.default_rng(0)
    arms = {"a": engine.pipelines["verify"],
            "b": Pipeline([cpu_session(args.b / "graphs" / "cpu_verify.onnx", engine.manifest, args.threads)], "CPU")}
    sizes = [m for m in engine.manifest["graphs"]["cpu_verify"]["sizes"] if m <= 16]
    trees = {m: Tree([int(t) for t in rng.integers(0, cfg.vocab_size, m)], [-1] + list(range(m - 1))) for m in sizes}
    result = {"machine": {"cpu": cpu_model()}, "threads": args.threads, "repeats": args.repeats,
              "a": str(args.a), "b": str(args.b), "unit": "ms, median of repeats", "contexts": []}
    for context in (int(c) for c in args.contexts.split(",")):
        engine.prefill_logits([int(t) for t in rng.integers(0, cfg.vocab_size, context)])
        for m in sizes:  # the same logits first: a faster wrong graph is no result
            la, lb = (arms[k].run(tree_feed(cfg, engine.state, trees[m]))["logits"] for k in "ab")
            if np.abs(la - lb).max() > 1e-3:
                print(f"ab_verify_graph: the arms' logits differ by {np.abs(la - lb).max():.2e} at size {m}",
                      file=sys.stderr)
                return 1
        times = {(k, m): [] for k in "ab" for m in sizes}
        decode = []
        for _ in range(args.repeats):
            for m in sizes:
                for k in "ab":
                    feed = tree_feed(cfg, engine.state, trees[m])
                    t0 = time.perf_counter()
                    arms[k].run(feed)
                    times[(k, m)].append(time.perf_counter() - t0)
            feed = chain_feed(cfg, engine.state, [5], 1)
            t0 = time.perf_counter()
            engine.pipelines["decode"].run(feed)
            decode.append(time.perf_counter() - t0)
        ms = lambda xs: round(1e3 * float(np.median(xs)), 2)  # noqa: E731
        row = {"context": context, "decode": ms(decode),
               **{k: {str(m): ms(times[(k, m)]) for m in sizes} for k in "ab"},
               "b_over_a": {str(m): round(float(np.median(times[("b", m)]) / np.median(times[("a", m)])), 3)
                            for m in sizes}}
        result["contexts"].append(row)
        print(row, file=sys.stderr, flush=True)
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
