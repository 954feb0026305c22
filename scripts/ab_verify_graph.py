"""Paired A/B of two CPU verify graphs of the same model: both sessions in one process, calls
alternated chain by chain (so load from other jobs hits both), the median of --repeats per arm and
node count, with one plain decode step per repeat for scale. Each arm gets a chain of n nodes as
its export's engine feeds it: n nodes where its graph takes any count (model.json any_count),
else padded on the host to the smallest of its sizes that holds n. Before timing, both arms'
logits must agree (≤ 1e-3) on every real node. Prints one JSON object.

    python scripts/ab_verify_graph.py --a EXPORT_A --b EXPORT_B [--contexts 24,1500] [--repeats 40]
        [--counts 2,3,4,5,6,7,8]
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
    ap.add_argument("--counts", default="2,3,4,5,6,7,8", help="chain node counts (default: 2-8)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts {args.counts!r}: give node counts, e.g. 2,3,4")
    if not counts or min(counts) < 2:
        ap.error(f"--counts {args.counts!r}: a verified chain has 2 or more nodes")
    for arm in (args.a, args.b):
        if not (arm / "graphs" / "cpu_verify.onnx").is_file():
            ap.error(f"{arm} has no graphs/cpu_verify.onnx; export it again with export-hybrid")
    import hybrid_npu
    from hybrid_npu.format import VERIFY_ANY_COUNT
    from hybrid_npu.runtime.export_check import read_manifest
    from hybrid_npu.runtime.pipeline import Pipeline, cpu_session
    from hybrid_npu.runtime.speculative import Tree, tree_feed
    from hybrid_npu.runtime.step_inputs import chain_feed

    engine = hybrid_npu.load(args.a, threads=args.threads)
    cfg, rng = engine.config, np.random.default_rng(0)
    arms = {"a": engine.pipelines["verify"],
            "b": Pipeline([cpu_session(args.b / "graphs" / "cpu_verify.onnx", engine.manifest, args.threads)], "CPU")}
    graphs = {"a": engine.manifest["graphs"]["cpu_verify"], "b": read_manifest(args.b)[0]["graphs"]["cpu_verify"]}

    def fed(k: str, n: int) -> int:  # the nodes arm k's engine verifies a chain of n nodes with
        g = graphs[k]
        return n if g.get(VERIFY_ANY_COUNT) else next((m for m in g["sizes"] if m >= n), g["sizes"][-1])
    if max(counts) > min(graphs["a"]["sizes"][-1], graphs["b"]["sizes"][-1]):
        ap.error(f"--counts {args.counts!r}: the graphs take at most {graphs['a']['sizes'][-1]} / "
                 f"{graphs['b']['sizes'][-1]} nodes")
    chains = {n: [int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in counts}
    trees = {(k, n): Tree.from_draft(chains[n][0], chains[n][1:], list(range(-1, n - 2)), fed(k, n))[0]
             for k in "ab" for n in counts}
    result = {"machine": {"cpu": cpu_model()}, "threads": args.threads, "repeats": args.repeats,
              "a": str(args.a), "b": str(args.b), "unit": "ms, median of repeats", "contexts": []}
    for context in (int(c) for c in args.contexts.split(",")):
        engine.prefill_logits([int(t) for t in rng.integers(0, cfg.vocab_size, context)])
        for n in counts:  # the same logits first: a faster wrong graph is no result
            la, lb = (arms[k].run(tree_feed(cfg, engine.state, trees[(k, n)]))["logits"][:n] for k in "ab")
            if np.abs(la - lb).max() > 1e-3:
                print(f"ab_verify_graph: the arms' logits differ by {np.abs(la - lb).max():.2e} at {n} nodes",
                      file=sys.stderr)
                return 1
        times = {(k, n): [] for k in "ab" for n in counts}
        decode = []
        for _ in range(args.repeats):
            for n in counts:
                for k in "ab":
                    feed = tree_feed(cfg, engine.state, trees[(k, n)])
                    t0 = time.perf_counter()
                    arms[k].run(feed)
                    times[(k, n)].append(time.perf_counter() - t0)
            feed = chain_feed(cfg, engine.state, [5], 1)
            t0 = time.perf_counter()
            engine.pipelines["decode"].run(feed)
            decode.append(time.perf_counter() - t0)
        ms = lambda xs: round(1e3 * float(np.median(xs)), 2)  # noqa: E731
        row = {"context": context, "decode": ms(decode),
               **{k: {str(n): ms(times[(k, n)]) for n in counts} for k in "ab"},
               "nodes_fed": {k: {str(n): fed(k, n) for n in counts} for k in "ab"},
               "b_over_a": {str(n): round(float(np.median(times[("b", n)]) / np.median(times[("a", n)])), 3)
                            for n in counts}}
        result["contexts"].append(row)
        print(row, file=sys.stderr, flush=True)
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
