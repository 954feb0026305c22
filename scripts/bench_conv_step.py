"""The one-token causal conv of every GDN layer in two forms, timed in one process: ORT's
CausalConvWithState with its own activation="silu", against the same op with no activation
followed by Sigmoid·x (kernels/conv.emit_short_conv_step_cpu's form). Same weights and inputs in
both; their outputs are checked equal first. Shapes default to Qwen3.5-0.8B's (18 GDN layers,
6,144 conv channels, kernel 4). Prints one JSON object.

    python scripts/bench_conv_step.py [--layers 18] [--channels 6144] [--rounds 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402
from bench_cpu import cpu_model  # noqa: E402
from decode_gap import median_ms  # noqa: E402

K = 4


def conv_model(weights: list[np.ndarray], fused_silu: bool):
    nodes, inputs, outputs = [], [], []
    c = weights[0].shape[0]
    for i in range(len(weights)):
        x, s, w = f"x{i}", f"s{i}", f"w{i}"
        inputs += [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, c, 1]),
                   helper.make_tensor_value_info(s, TensorProto.FLOAT, [1, c, K - 1])]
        conv_out = f"y{i}" if fused_silu else f"c{i}"
        nodes.append(helper.make_node("CausalConvWithState", [x, w, "", s], [conv_out, f"ns{i}"], domain="com.microsoft",
                                      activation="silu" if fused_silu else "none"))
        if not fused_silu:
            nodes += [helper.make_node("Sigmoid", [conv_out], [f"g{i}"]), helper.make_node("Mul", [conv_out, f"g{i}"], [f"y{i}"])]
        outputs += [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info(f"ns{i}", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "conv_step", inputs, outputs,
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--channels", type=int, default=6144)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((args.channels, 1, K)).astype(np.float32) for _ in range(args.layers)]
    feed = {}
    for i in range(args.layers):
        feed[f"x{i}"] = rng.standard_normal((1, args.channels, 1)).astype(np.float32)
        feed[f"s{i}"] = rng.standard_normal((1, args.channels, K - 1)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    arms = {name: ort.InferenceSession(conv_model(weights, fused).SerializeToString(), opts,
                                       providers=["CPUExecutionProvider"])
            for name, fused in (("ccws_silu_fused", True), ("ccws_then_sigmoid_mul", False))}
    outs = [s.run(None, feed) for s in arms.values()]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(*outs))
    best = {name: float("inf") for name in arms}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            best[name] = min(best[name], median_ms(lambda: arms[name].run(None, feed), 30))
    bench_json.emit({"machine": {"cpu": cpu_model()}, "threads": args.threads, "layers": args.layers,
                     "channels": args.channels, "max_abs_difference": diff,
                     "ms_all_layers_best_median": {k: round(v, 3) for k, v in best.items()}}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
