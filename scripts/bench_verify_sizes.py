"""What verifying k draft nodes costs against one decode step, on the real Qwen3.5 config (random
weights), through the CPU verify graph sized to the draft (graphs/cpu_verify.onnx); then the
modelled speed-up of chain speculation for drafters of acceptance rate a.

Each verify is followed by the host's commit of its whole path (runtime/speculative.commit_path: the
recurrent states along the path, the conv windows, the K/V rows), timed apart: "commit_ms", and
"modelled_with_commit" charges a round verify + commit (what a round costs the engine, besides
the drafter's observe), beside "modelled" (the graph alone, as the earlier passes gave it).

With a drafter (--drafter-weights, the first one given), "commit_beside" times the round as the
engine runs it: the commit on a worker thread while the drafter observes the path's tokens
(runtime/speculative.commit_beside; the worker is used only where the state is large enough,
"worker"), against the observe alone; what the commit adds beside it is charged to the round.
"modelled_round" charges a round as the engine runs it: verify + (commit beside the observe) + the
d - 1 draft levels after the first, whose logits the observe computes. The observe runs after the
verify has streamed the target's weights, so it is costlier than a warm draft level;
"modelled_with_drafter" (earlier passes) charged it as one warm level.

k = 1 is the decode step itself (a round that drafts nothing is a plain step); the other k are
the graph's core sizes up to 16 (2-8 and 16 in an export whose verify takes any count; 2, 4, 8, 16
before), chain trees of k nodes at the same context. Decode steps and verify calls alternate, repeat by
repeat (the machine is shared), each keeping its best time.

Modelled (not measured): a chain of d drafts, each accepted with probability a, emits
E(d) = (1 - a^(d+1)) / (1 - a) tokens per round and costs verify(size holding d + 1 nodes) +
d x draft; speed-up = max over d of E(d) / (round cost / decode step). The draft cost per level
is an assumption (--draft-fraction of a decode step; an EAGLE-3 drafter is one layer and a head).

--drafter-weights float,int8,int4,int4-head4: also measure what a draft level costs (one drafter call after
512 observed positions, the mean of a depth-6 chain's five) for a random EAGLE-3 drafter shaped
for the target (one layer mirroring its attention and MLP, --draft-vocab ids, the embedding the
target's), exported at each weights mode (int: the target's QuantSpec; -headN: its head at N bits instead of
the target's head bits); the modelled speed-ups
are then also given with that measured draft cost in place of --draft-fraction.

--mtp-vocabs full,32768: also measure a draft level of a random MTP head (the released one-layer
layout) shaped for the target, its head over the whole vocabulary ("full") or trimmed to N tokens
(export-hybrid --mtp-vocab N), exported at the target's weights; modelled speed-ups as above.

--model embedded-shape: the embedded default model's shape (8 layers, hidden 256, vocab 4096),
random weights: what the sized verify would cost there (the shipped export has only the static
16-node verify). --clock thread (with --threads 1): the calling thread's CPU time, where ONNX
Runtime runs every op at one thread (work, not waits for cores on a shared machine).

    python scripts/bench_verify_sizes.py [--model 0.8B] [--weights int4] [--contexts 512] [--repeats 5]
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
from random_checkpoint import make_random_checkpoint, make_random_drafter  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

# the embedded default model's shape (src/hybrid_npu/models/default/model.json), on the 0.8B base
EMBEDDED_SHAPE = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                      linear_value_head_dim=64, intermediate_size=768, vocab_size=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                       "mrope_section": [2, 3, 3], "mrope_interleaved": True})


def modelled_speedup(costs: dict[int, float], decode: float, a: float, draft_fraction: float) -> dict:
    """costs: verify size -> seconds. Best chain depth d (d + 1 nodes padded up to a size)."""
    best = {"speedup": 0.0}
    for d in range(1, max(costs)):
        size = min((m for m in costs if m >= d + 1), default=None)
        if size is None:
            continue
        tokens = (1 - a ** (d + 1)) / (1 - a)
        cost = costs[size] + d * draft_fraction * decode
        s = tokens / (cost / decode)
        if s > best["speedup"]:
            best = {"speedup": round(s, 2), "depth": d, "verify_size": size, "tokens_per_round": round(tokens, 2)}
    return best


def modelled_round(verify: dict[int, float], beside: dict[int, float], level: float, decode: float, a: float) -> dict:
    """modelled_speedup for rounds costing verify(d + 1 nodes) + beside(d + 1), the commit and the
    observe side by side, + (d - 1) draft levels: the observe yields the first level's logits."""
    return modelled_speedup({m: verify[m] + beside[m] - level for m in beside}, decode, a, level / decode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.8B")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_verify_sizes"))
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-fraction", type=float, default=0.1)
    ap.add_argument("--drafter-weights", default="", help="e.g. float,int8,int4,int4-head4 (default: none)")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--mtp-vocabs", default="", help="e.g. full,32768: random MTP heads, whole or trimmed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.export.exporter import export
    from hybrid_npu.runtime.speculative import Tree, tree_feed
    from hybrid_npu.runtime.step_inputs import chain_feed
    from hybrid_npu.export.step_graph import ANY_COUNT_MAX

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.clock == "thread" and args.threads != 1:
        print("bench_verify_sizes: --clock thread needs --threads 1", file=sys.stderr)
        return 2
    if args.model == "embedded-shape":
        src = make_random_checkpoint("0.8B", args.workdir / "embedded-shape-random", **EMBEDDED_SHAPE)
    else:
        src = make_random_checkpoint(args.model, args.workdir / f"qwen35-{args.model}-random")
    out = args.workdir / f"export-{args.model}-{args.weights}"
    t0 = time.perf_counter()
    export(src, out, chunk=128, force=True, weights=None if args.weights == "float" else args.weights)
    print(f"exported in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    engine = hybrid_npu.load(out, threads=args.threads)
    cfg = engine.config
    rng = np.random.default_rng(0)
    sizes = [m for m in engine.manifest["graphs"]["cpu_verify"]["sizes"] if m <= 16]
    trees = {m: Tree([int(t) for t in rng.integers(0, cfg.vocab_size, m)], [-1] + list(range(m - 1))) for m in sizes}
    verify = engine.pipelines["verify"]
    drafters = {mode: open_drafter(engine, src, args, mode) for mode in args.drafter_weights.split(",") if mode}
    drafters.update({f"mtp-{v}": open_mtp(engine, src, args, v) for v in args.mtp_vocabs.split(",") if v})
    result = {"machine": platform.machine(), "model": f"Qwen3.5-{args.model} config, random weights",
              "weights": args.weights, "threads": args.threads, "clock": args.clock, "repeats": args.repeats,
              "note": "machine shared with other jobs; calls interleaved, best of repeats", "contexts": []}
    for context in [int(c) for c in args.contexts.split(",")]:
        engine.prefill_logits([int(t) for t in rng.integers(0, cfg.vocab_size, max(context, 1))])
        verify.run(tree_feed(cfg, engine.state, trees[sizes[0]]))  # opens and warms the session
        best = {m: 1e9 for m in [1] + sizes}
        commit = {m: 1e9 for m in sizes}
        engine.state.ensure_capacity(engine.state.position + max(sizes))  # no K/V growth inside the timing
        for d in drafters.values():  # 512 positions of context (its window), then the rows it drafts from
            d.reset()
            d.observe([int(t) for t in rng.integers(0, cfg.vocab_size, 512)],
                      rng.standard_normal((512, d.tap_width)).astype(np.float32))
            d._propose_chain(2)  # warm
        level = {mode: 1e9 for mode in drafters}
        beside_drafter = next(iter(drafters.values()), None)
        observed, together = {m: 1e9 for m in sizes}, {m: 1e9 for m in sizes}
        for _ in range(args.repeats):
            t = clock()
            engine.pipelines["decode"].run(chain_feed(cfg, engine.state, [5], 1))
            best[1] = min(best[1], clock() - t)
            for m in sizes:
                t = clock()
                out = verify.run(tree_feed(cfg, engine.state, trees[m]))
                best[m] = min(best[m], clock() - t)
                commit[m] = min(commit[m], timed_commit(engine.state, out, trees[m], cfg.linear_conv_kernel_dim, clock))
                if beside_drafter is not None and m <= ANY_COUNT_MAX:  # the engine's round: the commit
                    # beside the drafter's observe of the path (runtime/speculative.commit_beside)
                    observe = observing(beside_drafter, trees[m].tokens, rng)
                    verify.run(tree_feed(cfg, engine.state, trees[m]))  # the caches as a round leaves them
                    t = clock()
                    observe()
                    observed[m] = min(observed[m], clock() - t)
                    out = verify.run(tree_feed(cfg, engine.state, trees[m]))
                    together[m] = min(together[m], timed_commit(engine.state, out, trees[m], cfg.linear_conv_kernel_dim,
                                                                clock, engine.commit_worker(), observe))
            for mode, d in drafters.items():
                t = clock()
                d._propose_chain(6)  # five drafter calls (the first level is the observe's logits)
                level[mode] = min(level[mode], (clock() - t) / 5)
            if drafters:  # the target's calls are timed in a run of them: a full-vocabulary MTP head's
                # 0.8 GB, streamed just before, made the next decode step 2.4x slower (0.8B int4)
                engine.pipelines["decode"].run(chain_feed(cfg, engine.state, [5], 1))
        decode = best[1]
        costs = {m: best[m] for m in sizes}
        with_commit = {m: best[m] + commit[m] for m in sizes}
        row = {"context": context, "ms": {str(k): round(1e3 * v, 2) for k, v in best.items()},
               "over_decode": {str(k): round(v / decode, 2) for k, v in best.items()},
               "commit_ms": {str(k): round(1e3 * v, 2) for k, v in commit.items()},
               "commit_over_decode": {str(k): round(v / decode, 3) for k, v in commit.items()},
               "modelled": {"draft_fraction_of_decode": args.draft_fraction,
                            **{f"a={a}": modelled_speedup(costs, decode, a, args.draft_fraction)
                               for a in (0.6, 0.7, 0.8)}},
               "modelled_with_commit": {f"a={a}": modelled_speedup(with_commit, decode, a, args.draft_fraction)
                                        for a in (0.6, 0.7, 0.8)}}
        if beside_drafter is not None:  # what the commit adds to a round where it runs beside the observe
            visible = {m: max(0.0, together[m] - observed[m]) for m in sizes if m <= ANY_COUNT_MAX}
            first_level = level[next(iter(drafters))]
            frac = first_level / decode
            row["commit_beside"] = {
                "worker": engine.commit_worker() is not None,
                "observe_ms": {str(m): round(1e3 * observed[m], 2) for m in visible},
                "commit_and_observe_ms": {str(m): round(1e3 * together[m], 2) for m in visible},
                "visible_commit_over_decode": {str(m): round(v / decode, 3) for m, v in visible.items()},
                "modelled_with_drafter": {f"a={a}": modelled_speedup({m: best[m] + v for m, v in visible.items()},
                                                                     decode, a, frac) for a in (0.6, 0.7, 0.8)},
                "observe_over_level": round(observed[min(visible)] / first_level, 2),
                "modelled_round": {f"a={a}": modelled_round(best, {m: together[m] for m in visible},
                                                            first_level, decode, a)
                                   for a in (0.6, 0.7, 0.8)}}
        for mode, d in drafters.items():
            frac = level[mode] / decode
            row.setdefault("drafters", {})[mode] = {
                "draft_vocab": len(d.draft_to_target), "weights_bytes": d.weights_bytes,
                "draft_level_ms": round(1e3 * level[mode], 2), "draft_level_over_decode": round(frac, 3),
                "modelled": {f"a={a}": modelled_speedup(costs, decode, a, frac) for a in (0.6, 0.7, 0.8)},
                "modelled_with_commit": {f"a={a}": modelled_speedup(with_commit, decode, a, frac)
                                         for a in (0.6, 0.7, 0.8)}}
        result["contexts"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    bench_json.emit(result, args.out)
    return 0


def timed_commit(state, out: dict, tree, k: int, clock, worker=None, work=lambda: None) -> float:
    """Seconds the host takes to commit the whole of `tree`'s path from the verify outputs `out` (with
    `worker`: on it, while `work()` runs, as a round does beside the drafter's observe); the state is
    then put back as it was by a turn checkpoint (the K/V rows written past its position are never
    read)."""
    from hybrid_npu.runtime.checkpoints import Checkpoint
    from hybrid_npu.runtime.speculative import commit_beside

    saved = Checkpoint.take(state)
    t = clock()
    commit_beside(worker, state, out, tree, list(range(len(tree.tokens))), k, work)
    seconds = clock() - t
    saved.restore(state)
    return seconds


def observing(drafter, tokens: list[int], rng):
    """A call of the drafter's observe of `tokens` (random taps) that leaves it as it was."""
    features = rng.standard_normal((len(tokens), drafter.tap_width)).astype(np.float32)

    def observe():
        kept = drafter.length, drafter._hidden, drafter._logits, drafter._last_token
        drafter.observe(tokens, features)
        drafter.length, drafter._hidden, drafter._logits, drafter._last_token = kept
    return observe


def open_drafter(engine, src: Path, args, mode: str):
    """A random real-shape EAGLE-3 drafter exported at weights `mode` (int: the target's QuantSpec)."""
    from hybrid_npu.export.checkpoint import read_checkpoint
    from hybrid_npu.export.drafter import export_drafter, read_drafter
    from hybrid_npu.export.quantize import QuantSpec
    from hybrid_npu.runtime.eagle3 import Eagle3Drafter

    ck_dir = make_random_drafter(engine.config, args.workdir / f"drafter-{args.model}-v{args.draft_vocab}",
                                 args.draft_vocab)
    target = read_checkpoint(src)
    ck = read_drafter(ck_dir, engine.config, lambda: target.load("embed_tokens.weight"))
    q = engine.manifest["weights"]
    bits, _, head = mode.partition("-head")  # int4-head4: the drafter's head at 4 bits too (default: the target's)
    quant = None if mode == "float" else QuantSpec(bits=int(bits[3:]), block_size=q.get("block_size", 32),
                                                   symmetric=q.get("symmetric", True),
                                                   head_bits=int(head) if head else q.get("head_bits", 8))
    out = args.workdir / f"drafter-{args.model}-v{args.draft_vocab}-{mode}"
    manifest = export_drafter(ck, out, "fp32", quant)
    d = Eagle3Drafter(out, threads=args.threads)
    d.weights_bytes = manifest["weights"]["bytes"]
    return d


def open_mtp(engine, src: Path, args, vocab: str):
    """A random real-shape MTP head at the target's weights, over the whole vocabulary or trimmed."""
    from hybrid_npu.export.checkpoint import read_checkpoint
    from hybrid_npu.export.mtp_drafter import export_mtp, read_mtp, trim_head
    from hybrid_npu.runtime.mtp import MtpDrafter

    from random_checkpoint import make_random_mtp

    ck = read_mtp(read_checkpoint(src), make_random_mtp(engine.config, args.workdir / f"mtp-{args.model}"))
    if vocab != "full":
        ck = trim_head(ck, np.arange(int(vocab)))  # which ids does not change the cost
    out = args.workdir / f"mtp-{args.model}-{args.weights}-v{vocab}"
    manifest = export_mtp(ck, out, "fp32", engine_quant(engine))
    d = MtpDrafter(out, threads=args.threads)
    d.weights_bytes = manifest["weights"]["bytes"]
    return d


def engine_quant(engine):
    """The export's QuantSpec, for a drafter quantised as its target (None: float)."""
    from hybrid_npu.export.quantize import QuantSpec

    q = engine.manifest["weights"]
    if not q.get("bits"):
        return None
    return QuantSpec(bits=q["bits"], block_size=q.get("block_size", 32), symmetric=q.get("symmetric", True),
                     head_bits=q.get("head_bits", 8))


if __name__ == "__main__":
    sys.exit(main())
