"""How fast a quantised export could run on this CPU if everything but its weight matmuls were free.

Rebuilds each step graph's MatMulNBits nodes alone (the export's own packed weights, attributes and
accuracy level, one session, the same threads) and times them: decode = one token through every
node of decode.onnx; prefill = one chunk through every node of prefill.onnx (the lm_head sees the
rows the graph's logits have). The gap between these and the whole graph is our own overhead; the
gap between these and llama.cpp at equal bits is ONNX Runtime's MatMulNBits kernels on this CPU,
which no graph change can close. Prints one JSON object.

    python scripts/bench/matmul_ceiling.py EXPORT_DIR [--threads 2] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.external_data_helper import load_external_data_for_tensor

import harness  # one JSON object, machine and commit recorded (this folder is on sys.path when run)
from hybrid_npu.cli_common import OneLineParser
from hybrid_npu.runtime import huge_pages
from hybrid_npu.runtime.session_options import cpu_inference_session, session_options


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _rows(graph: onnx.GraphProto) -> tuple[int, int]:
    """(tokens per step, rows of the logits): the static first dims of input_ids and logits."""
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)}
    return dims["input_ids"][0], dims["logits"][0]


def matmul_only_model(graph_path: Path) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """The graph's MatMulNBits nodes alone, each fed from its own input `rows.<i>` [rows, K];
    returns the model and each input's shape."""
    model = onnx.load(str(graph_path), load_external_data=False)
    tokens, logit_rows = _rows(model.graph)
    vocab = [d.dim_value for d in next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim][1]
    initializers = {t.name: t for t in model.graph.initializer}
    nodes, inputs, outputs, weights, shapes = [], [], [], {}, {}
    for i, node in enumerate(n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = _attrs(node)
        rows = logit_rows if attrs["N"] == vocab else tokens
        name = f"rows.{i}"
        shapes[name] = (rows, attrs["K"])
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [rows, attrs["K"]]))
        outputs.append(helper.make_tensor_value_info(f"out.{i}", TensorProto.FLOAT, [rows, attrs["N"]]))
        for w in node.input[1:]:
            if w and w not in weights:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(initializers[w])
                if tensor.data_location == TensorProto.EXTERNAL:
                    load_external_data_for_tensor(tensor, str(graph_path.parent))
                    tensor.data_location = TensorProto.DEFAULT
                    del tensor.external_data[:]
                weights[w] = tensor
        nodes.append(helper.make_node("MatMulNBits", [name, *node.input[1:]], [f"out.{i}"], domain="com.microsoft",
                                      **attrs))
    graph = helper.make_graph(nodes, "matmul_only", inputs, outputs, list(weights.values()))
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets), shapes


def time_model(model: onnx.ModelProto, shapes: dict, threads: int, repeats: int, min_seconds: float = 0.0) -> float:
    """Seconds per run, the best of at least `repeats` runs and `min_seconds` after two warm-ups (a
    bound, so the least disturbed run; this VM's slow spells last seconds)."""
    opts = session_options(threads)  # as the engine's sessions: the bound and the graph share their threading
    # the arena hands each run's ~200 MB of prefill outputs back to the next (no page faults): the
    # bound stays an upper bound on what the real graph, which reuses its buffers, could reach
    session = cpu_inference_session(model.SerializeToString(), opts)
    huge_pages.wait()  # time the weights as the engine's sessions hold them once settled
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for _ in range(2):
        session.run(None, feed)
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        session.run(None, feed)
        best, runs = min(best, time.perf_counter() - t0), runs + 1
    return best


def ceiling(export_dir: Path, threads: int = 2, repeats: int = 20, min_seconds: float = 10.0) -> dict:
    manifest = json.loads((export_dir / "model.json").read_text())
    if manifest["weights"].get("mode", "float") == "float":
        raise ValueError(f"{export_dir} is a float export; the ceiling is for --weights int8/int4 exports")
    result = {"weights": manifest["weights"]["mode"], "threads": threads}
    for part in ("decode", "prefill"):
        path = export_dir / manifest["graphs"][part]["file"]
        model, shapes = matmul_only_model(path)
        seconds = time_model(model, shapes, threads, repeats, min_seconds)
        tokens = _rows(onnx.load(str(path), load_external_data=False).graph)[0]
        result[part] = {"matmul_nbits_nodes": len(model.graph.node), "ms_per_step": round(seconds * 1e3, 4),
                       "tokens_per_s": round(tokens / seconds, 1)}
    return result


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not (args.export_dir / "model.json").is_file():
        ap.error(f"{args.export_dir} has no model.json; give the directory export-hybrid wrote")
    try:
        harness.emit(ceiling(args.export_dir, args.threads, args.repeats))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
