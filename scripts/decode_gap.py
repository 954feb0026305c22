"""Where a decode step's (or a prefill chunk's) time goes besides its weight matmuls, measured in one process.

Three sessions over the same inputs (the engine's own decode feed after a short prompt; with
--tokens C, the feed of one C-token prefill chunk through the same any-N graph), run in
alternating rounds so drift hits all of them alike:
- `full`: the export's CPU graph (cpu.onnx), as the engine runs it;
- `rest`: the same graph with every MatMulNBits replaced by a broadcast of its input's first column
  to the right shape (no weights read): the cost of everything else;
- `matmul_only`: the MatMulNBits nodes alone (scripts/matmul_ceiling.py's graph: decode.onnx's
  for one token, prefill.onnx's for a chunk, whose head has one row as the engine's has).
If full ≈ rest + matmul_only the two parts do not slow each other down, and the gap to the
ceiling is `rest`. A decode step also times
- `static_decode`: the export's decode.onnx, the same one-token cores without cpu.onnx's per-layer
  Ifs (which let one session serve prefill chunks and decode steps with one prepacked copy of the
  weights): full − static_decode is what those Ifs cost.
`--ablate` adds variants of `rest` with more op types replaced by pass-throughs (groups separated
by ';', op types by ','), to see what inside `rest` costs what. The numbers in
those are wrong on purpose; only the time is read. A pass-through that becomes a graph output is a
copy where the kernel wrote in place, so ablation deltas are approximate (within ~0.1 ms here).
Quantised exports only (MatMulNBits). Prints one JSON object.

    python scripts/decode_gap.py EXPORT_DIR [--threads 2] [--rounds 6] [--tokens 1|CHUNK]
        [--ablate "LinearAttention;CausalConvWithState;RMSNormalization,SkipSimplifiedLayerNormalization"]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul_ceiling import matmul_only_model  # noqa: E402
from bench_cpu import cpu_model  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

# op type -> (input index feeding output i) for each output: same shapes, no work
PASS_THROUGH = {
    "LinearAttention": (2, 3),            # o <- v, state out <- state in
    "CausalConvWithState": (0, 3),        # y <- x, conv state out <- state in
    "RMSNormalization": (0,),
    "SkipSimplifiedLayerNormalization": (0, None, None, 1),
    "Sigmoid": (0,), "Softplus": (0,), "Exp": (0,), "Neg": (0,), "Softmax": (0,),
}


def check_groups(groups: list[set[str]]) -> None:
    unknown = set().union(*groups) - set(PASS_THROUGH)
    if unknown:
        raise UserError(f"--ablate: no pass-through for {', '.join(sorted(unknown))}; "
                        f"choose from {', '.join(sorted(PASS_THROUGH))}")


def ablated(graph_path: Path, ops: set[str]) -> onnx.ModelProto:
    """cpu.onnx with MatMulNBits -> broadcast and each op in `ops` -> pass-throughs (If branches too)."""
    m = onnx.load(str(graph_path), load_external_data=False)
    dropped, extra = set(), {"gap_s": [0], "gap_e": [1], "gap_a": [-1]}

    def rewrite(g: onnx.GraphProto) -> None:
        for node in list(g.node):
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    rewrite(a.g)
            if node.op_type == "MatMulNBits":
                n_out = next(a.i for a in node.attribute if a.name == "N")
                y = node.output[0]
                extra[f"gap_N{n_out}"] = [1, n_out]
                new = [helper.make_node("Slice", [node.input[0], "gap_s", "gap_e", "gap_a"], [y + ".col"]),
                       helper.make_node("Expand", [y + ".col", f"gap_N{n_out}"], [y])]
                dropped.update(node.input[1:])
            elif node.op_type in ops:
                new = [helper.make_node("Identity", [node.input[src]], [out])
                       for out, src in zip(node.output, PASS_THROUGH[node.op_type]) if out and src is not None]
            else:
                continue
            at = list(g.node).index(node)
            g.node.remove(node)
            for j, x in enumerate(new):
                g.node.insert(at + j, x)

    rewrite(m.graph)
    kept = [t for t in m.graph.initializer if t.name not in dropped]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    m.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in extra.items())
    return m


def median_ms(run, calls: int = 25) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def measure(export_dir: Path, threads: int, rounds: int, groups: list[set[str]], tokens: int = 1) -> dict:
    import hybrid_npu
    from hybrid_npu.runtime.pipeline import cpu_session
    from hybrid_npu.runtime import huge_pages
    from hybrid_npu.runtime.session_options import cpu_inference_session, session_options
    from hybrid_npu.runtime.step_inputs import chain_feed

    engine = hybrid_npu.load(export_dir, threads=threads)
    if engine.manifest["weights"].get("mode", "float") == "float" or "cpu" not in engine.manifest["graphs"]:
        raise UserError(f"{export_dir}: a quantised export with the any-N CPU graph is needed "
                        "(export it with --weights int4 or int8)")
    chunk = engine.manifest["chunk"]
    if tokens not in (1, chunk):
        raise UserError(f"--tokens {tokens}: the any-N graph takes 1 token (a decode step) or {chunk} "
                        f"(a prefill chunk of this export)")
    engine.prefill_logits(list(range(1, 17)))
    pipe = engine.pipelines["decode"]  # the any-N cpu.onnx session: decode steps and CPU prefill chunks
    names, wanted = pipe._outputs[0], pipe._inputs[0]
    ids = [1 + i % 7 for i in range(tokens)]
    feed = {k: v for k, v in chain_feed(engine.config, engine.state, ids, tokens).items() if k in wanted}
    calls = 25 if tokens == 1 else 5  # a chunk call is ~20x a decode step
    graphs = export_dir / "graphs"
    arms = {"full": lambda: pipe.sessions[0].run(names, feed)}
    if tokens == 1:  # the same cores without the Ifs (its own session: a second copy of the prepacked weights)
        static = cpu_session(graphs / "decode.onnx", engine.manifest, threads)
        static_feed = {i.name: feed[i.name] for i in static.get_inputs()}
        arms["static_decode"] = lambda: static.run(names, static_feed)
    for ops in [set()] + groups:
        # beside weights.bin (ORT resolves external data next to the graph), gone once loaded
        fd, name = tempfile.mkstemp(suffix=".onnx", prefix="decode_gap_", dir=graphs)
        os.close(fd)
        try:
            onnx.save(ablated(graphs / "cpu.onnx", ops), name)
            session = cpu_session(name, engine.manifest, threads)
        finally:
            Path(name).unlink()
        arms["rest" + "".join(f" -{o}" for o in sorted(ops))] = (lambda s: lambda: s.run(None, feed))(session)
    model, shapes = matmul_only_model(graphs / ("decode.onnx" if tokens == 1 else "prefill.onnx"))
    alone = cpu_inference_session(model.SerializeToString(), session_options(threads))  # as the engine's: huge pages
    huge_pages.wait()
    rng = np.random.default_rng(0)
    alone_feed = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    arms["matmul_only"] = lambda: alone.run(None, alone_feed)
    per_round = {k: [] for k in arms}
    order = list(arms)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            per_round[k].append(round(median_ms(arms[k], calls), 3))
    best = {k: min(v) for k, v in per_round.items()}
    return {"machine": {"cpu": cpu_model()}, "export": str(export_dir), "threads": threads, "rounds": rounds,
            "tokens": tokens,
            "best_median_ms": best, "median_ms_per_round": per_round,
            "full_minus_parts_ms": round(best["full"] - best["rest"] - best["matmul_only"], 3),
            "fraction_of_matmul_only_rate": round(best["matmul_only"] / best["full"], 3),
            **({"ifs_share_of_full": round(1 - best["static_decode"] / best["full"], 3)} if tokens == 1 else {})}


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1, help="1: a decode step; the export's chunk: a prefill chunk")
    ap.add_argument("--ablate", default="", help="groups of op types to pass through in `rest`, e.g. "
                    "'LinearAttention;CausalConvWithState'")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    groups = [set(g.split(",")) for g in args.ablate.split(";") if g]
    try:
        check_groups(groups)
        if not (args.export / "graphs" / "cpu.onnx").is_file():
            raise UserError(f"{args.export} has no graphs/cpu.onnx; give an export directory")
        result = measure(args.export, args.threads, args.rounds, groups, args.tokens)
    except UserError as e:
        print(f"decode_gap.py: error: {e}", file=sys.stderr)
        return 2
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
