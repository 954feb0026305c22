"""What a plain decode step costs in the steps right after a break from decode calls, against one in
a run of them: on the embedded pair a round's cost to plain decoding includes these slow steps, and
the speculation policy's decode cost, read from the second plain step after rounds, reads high
(docs/speculation.md, ninth pass).

On the embedded pair (or --model EXPORT, drafter or not, tokenizer or not) after a 24-token prompt, each repeat runs `--settle` plain steps, then one
break, then `--after` timed plain steps (the state untouched: the same step each time). Breaks:
nothing; the verify graph once (8 nodes; without a drafter, an 8-token chain); one draft (the drafter's chain); a full round (draft,
verify, commit, drafter observe); `--sleep-ms` of sleep; as long a Python busy loop; a read of
128 MB (the caches flushed). Each column is the median over the repeats of the k-th step after
the break; "steady" is the median of the steps before breaks. A break that evicts nothing (a
sleep) tells the caches apart from whatever else a pause changes (the cores' power states, the
hypervisor's scheduling of an idle vCPU).

    python scripts/bench_step_after_break.py [--threads 2] [--repeats 25] [--after 8] [--out F]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)
from bench_speculative import machine  # noqa: E402
from profile_speculative_round import source_tokens, timed_decode, timed_round  # noqa: E402

from hybrid_npu.cli_common import OneLineParser, report  # noqa: E402


def main() -> int:
    ap = OneLineParser(prog="bench_step_after_break", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--after", type=int, default=8, help="timed plain steps after each break")
    ap.add_argument("--settle", type=int, default=6, help="plain steps before each break")
    ap.add_argument("--sleep-ms", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime.generation import catch_up_drafter
    from hybrid_npu.runtime.speculative import Tree, tree_feed

    try:
        engine = hybrid_npu.load(args.model or hybrid_npu.default_model(), threads=args.threads)
    except UserError as e:
        return report("bench_step_after_break", e)
    drafter = getattr(engine, "drafter", None)
    if engine.tokenizer is not None:
        prompt = source_tokens(engine.tokenizer, 64)[:24]
    else:  # a random-weight export (no tokenizer): random tokens
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, 24)]
    engine.generate(prompt, 1, speculative=False)
    root = engine._pending[0]
    engine._pending = []
    if drafter is not None:
        catch_up_drafter(engine)
        tokens, parents = drafter.propose(root, **engine.draft_shape)
        tree, _ = Tree.from_draft(root, tokens, parents, engine.verify_nodes(engine.draft_shape["depth"]))
    else:  # no drafter: an 8-node chain of the root repeated stands for a draft
        tree = Tree([root] * 8, [-1] + list(range(7)))
    feed = tree_feed(engine.config, engine.state, tree)
    flush = np.ones(128 * 2**18, np.float32)
    pause = args.sleep_ms / 1e3

    def busy():
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass

    def round_():
        nonlocal root
        root = timed_round(engine, root)[1][-1]

    breaks = {"nothing": lambda: None, "verify": lambda: engine.pipelines["verify"].run(feed),
              "sleep": lambda: time.sleep(pause), "busy_loop": busy, "read_128MB": lambda: flush.sum()}
    if drafter is not None:
        breaks.update(draft=lambda: drafter.propose(root, **engine.draft_shape), round=round_)
    after = {name: [[] for _ in range(args.after)] for name in breaks}
    steady = []
    for _ in range(args.repeats):
        for name, brk in breaks.items():  # every break in each repeat: drift hits them all
            steady += [timed_decode(engine, root) for _ in range(args.settle)][-2:]
            brk()
            for k in range(args.after):
                after[name][k].append(timed_decode(engine, root))
    ms = lambda xs: round(1e3 * median(xs), 3)  # noqa: E731
    result = {"machine": machine(), "platform": platform.machine(), "threads": args.threads,
              "spinning": os.environ.get("HYBRID_NPU_SPINNING", "stops when a run ends"),
              "repeats": args.repeats, "sleep_ms": args.sleep_ms, "unit": "ms, median over repeats",
              "steady": ms(steady),
              "after_break": {name: [ms(col) for col in cols] for name, cols in after.items()}}
    result["first_over_steady"] = {n: round(v[0] / result["steady"], 2) for n, v in result["after_break"].items()}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
