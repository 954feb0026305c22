"""Where a speculative round's time goes as the context grows: draft, host feeds, verify, commit
(state commit + drafter observe), against one plain decode step at the same context.

The context is stdlib source (the embedded model's own domain) prefilled to each length; then,
at that context, rounds and decode steps alternate (so load from other jobs hits both) and each
part keeps its best (min) time over the repeats.

Each repeat times one plain decode step and one round per drafter window (--windows: "none" =
the drafter attends to its whole context, as before DRAFT_WINDOW; a number = that many rows).

--clock thread (with --threads 1) times the CPU time of the calling thread, where ONNX Runtime
runs every op at one thread: work done, not the waits for the cores that other jobs on a shared
machine cause. --clock wall (default) is elapsed time.

    python scripts/profile_speculative_round.py [--contexts 0,1500,6000,12000] [--repeats 12]
        [--windows none,512] [--threads 1 --clock thread]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

CLOCK = time.perf_counter


def source_tokens(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    for d in sorted(stdlib_corpus.documents(), key=lambda d: d.name):
        if d.kind == "code" and d.held_out:
            ids += tokenizer.encode(d.text).ids
            if len(ids) >= n + 64:
                break
    return ids


def verify_nodes(engine) -> int:
    """The verify graph's node count for the draft shape: what the engine runs (static N, or the
    CPU verify graph's size that holds the tree)."""
    return engine.verify_nodes(engine.draft_shape["depth"])


def timed_round(engine, root: int) -> tuple[dict[str, float], list[int]]:
    """One greedy round, the engine's own steps, timed part by part; returns (seconds, emitted)."""
    from hybrid_npu.runtime.speculative import Tree, accept_greedy, commit_path, tree_feed

    t0 = CLOCK()
    tokens, parents = engine.drafter.propose(root, **engine.draft_shape)
    t1 = CLOCK()
    tree, n_real = Tree.from_draft(root, tokens, parents, verify_nodes(engine))
    feed = tree_feed(engine.config, engine.state, tree)
    t2 = CLOCK()
    out = engine.pipelines["verify"].run(feed)
    t3 = CLOCK()
    path, bonus = accept_greedy(out["logits"], tree, n_real)
    commit_path(engine.state, out, tree, path, engine.config.linear_conv_kernel_dim)
    emitted = [tree.tokens[j] for j in path[1:]] + [bonus]
    t4 = CLOCK()
    engine.drafter.observe(emitted, engine._taps(out, np.array(path)))
    t5 = CLOCK()
    return {"draft": t1 - t0, "host_feeds": t2 - t1, "verify": t3 - t2, "commit": t4 - t3,
            "drafter_observe": t5 - t4}, emitted


def timed_decode(engine, token: int) -> float:
    """One plain decode step at the current context (feeds included), state left untouched."""
    from hybrid_npu.runtime.step_inputs import chain_feed

    t0 = CLOCK()
    engine.pipelines["decode"].run(chain_feed(engine.config, engine.state, [token], 1))
    return CLOCK() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--contexts", default="0,1500,6000,12000")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", default="none,512")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.clock == "thread":
        if args.threads != 1:
            print("profile_speculative_round: --clock thread needs --threads 1", file=sys.stderr)
            return 2
        global CLOCK
        CLOCK = time.thread_time
    import hybrid_npu
    from hybrid_npu.runtime.generation import catch_up_drafter

    engine = hybrid_npu.load(args.model or hybrid_npu.default_model(), threads=args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    text_ids = source_tokens(engine.tokenizer, max(contexts) + 8)
    rows = []
    for ctx in contexts:
        prompt = text_ids[: max(ctx, 24)]
        windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
        best: dict = {w: {} for w in windows}
        accepted = {w: 0 for w in windows}
        engine.drafter.window = None  # every row observed: the rounds below try each window
        engine.generate(prompt, 1, speculative=False)  # fresh context and its first token
        catch_up_drafter(engine)  # the prompt's pairs, then the first token (runtime/drafter_feed.py)
        root = engine._pending[0]
        engine._pending = []
        decode = 1e9
        for r in range(args.repeats):  # the context grows by a few tokens per round: negligible
            decode = min(decode, timed_decode(engine, root))
            for w in windows:
                engine.drafter.window = w
                parts, emitted = timed_round(engine, root)
                accepted[w] += len(emitted) - 1
                for name, sec in parts.items():
                    best[w][name] = min(best[w].get(name, 1e9), sec)
                root = emitted[-1]
        for w in windows:
            row = {"context": len(prompt), "drafter_window": w, "verify_nodes": verify_nodes(engine),
                   "decode_step": round(1e3 * decode, 3),
                   **{k: round(1e3 * v, 3) for k, v in best[w].items()}}
            row["round_total"] = round(sum(1e3 * v for v in best[w].values()), 3)
            row["round_over_decode"] = round(row["round_total"] / row["decode_step"], 2)
            row["acceptance_length"] = round(1 + accepted[w] / args.repeats, 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"machine": platform.machine(), "threads": args.threads, "repeats": args.repeats, "clock": args.clock,
              "note": "machine shared with other jobs: each part's best (min) over the repeats",
              "unit": "ms, best of repeats", "draft_shape": engine.draft_shape, "rows": rows}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
