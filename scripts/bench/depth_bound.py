"""What a decode step reads at context 0 and at a longer context, from an export's own decode graph
and state, and the depth ratio (decode at that context over decode at 0) those bytes allow.

A CPU decode step streams its weights once, reads and writes the GDN layers' fixed state, and reads
the attention layers' K/V over the buffer's capacity (runtime/state.py: the graph reads the whole
buffer, rows past the context masked). When the step runs at the machine's memory rate, its time
is proportional to those bytes, so the depth ratio is at most bytes(0) / bytes(context); measured
ratios near this bound mean the step is memory-bound, and no reordering of the same bytes raises it.

- weights: every initializer of the decode graph except those only a Gather reads (the embedding:
  one row a step), at their stored size (external data included);
- state: the GDN layers' recurrent and conv state (State.fresh), counted twice: read and written;
- K/V: State.fresh grown to hold context + 1 rows, keys and values at the export's dtype.

`kv_bytes_allowed` is what the K/V at the context may weigh for decode to keep `--goal` of its
context-0 rate, and `kv_bits_allowed` that as bits per stored K/V element (32 is fp32, as now).

A step is memory-bound only if it runs at the machine's read rate, so unless --no-measure this
measures, in one run:
- the read rate: an ONNX Runtime MatMul of one row against an fp32 matrix as large as the K/V at
  the context (a GEMV streams its matrix once; two matrices alternated so neither is read from
  cache), best of --rounds;
- the engine's decode step at context 0 and at the context (bench_context.decode_rates: the K/V
  rows filled, the median of --steps steps), and so the measured depth ratio;
- `depth_ratio_bound_at_read_rate`: the step at 0 as measured, plus reading the K/V's added bytes
  once at that rate: what decode at the context could keep with a perfect attention kernel over
  this cache, nothing else changed; `kv_read_ms_allowed` and `kv_bits_allowed_at_read_rate`: how
  long that read may take for --goal, and the bits per element that fit in it at that rate.
Prints one JSON object.

    python scripts/bench/depth_bound.py EXPORT_DIR [--context 8192] [--goal 0.85] [--threads 2]
                                  [--rounds 8] [--steps 24] [--no-measure] [--out FILE]
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)
from bench_context import decode_rates  # noqa: E402  (the engine's decode rate at each context length)
from bench_cpu import cpu_model  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.config import ModelConfig  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402
from hybrid_npu.format import LEGACY_KV_CACHE, MANIFEST  # noqa: E402


def stored_bytes(t: onnx.TensorProto) -> int:
    """A tensor's size as stored: its external data's length, else its raw or typed data."""
    external = {e.key: e.value for e in t.external_data}
    if "length" in external:
        return int(external["length"])
    if t.raw_data:
        return len(t.raw_data)
    return int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def weight_bytes(graph_path: Path) -> dict:
    """Bytes of the graph's initializers a step reads whole (all but those only Gathers read)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    readers = defaultdict(set)
    for node in model.graph.node:
        for name in node.input:
            readers[name].add(node.op_type)
    read = gathered = 0
    for t in model.graph.initializer:
        if readers[t.name] and readers[t.name] <= {"Gather"}:
            gathered += stored_bytes(t)
        else:
            read += stored_bytes(t)
    return {"read": read, "gathered": gathered}


def step_bytes(export_dir: Path, context: int) -> dict:
    from hybrid_npu.runtime.state import State

    manifest = json.loads((export_dir / MANIFEST).read_text())
    cfg = ModelConfig.from_dict(manifest["config"])
    weights = weight_bytes(export_dir / manifest["graphs"]["decode"]["file"])
    state = State.fresh(cfg, kv_cache=manifest.get("kv_cache", LEGACY_KV_CACHE))  # the export's cache dtype
    fixed = sum(layer.recurrent.nbytes + layer.conv.nbytes for layer in state.gdn.values())
    kv = {}
    for rows in (0, context):
        state.ensure_capacity(rows + 1)
        kv[rows] = sum(a.key.nbytes + a.value.nbytes + sum(x.nbytes for x in (a.key_scale, a.value_scale) if x is not None)
                       for a in state.attention.values())
    return {"weights_read": weights["read"], "embedding_gathered": weights["gathered"],
            "state_read_and_written": 2 * fixed, "kv_at_0": kv[0], "kv_at_context": kv[context],
            "kv_capacity_rows": state.capacity, "kv_itemsize": next(iter(state.attention.values())).key.itemsize
            if state.attention else 4}


def bytes_at_0(b: dict) -> int:
    """What a step at context 0 reads: its weights, its state (read and written), one K/V block."""
    return b["weights_read"] + b["state_read_and_written"] + b["kv_at_0"]


def bound(b: dict, goal: float) -> dict:
    at_0 = bytes_at_0(b)
    at_context = at_0 - b["kv_at_0"] + b["kv_at_context"]
    allowed = at_0 / goal - (at_0 - b["kv_at_0"])
    return {"bytes_at_0": at_0, "bytes_at_context": at_context,
            "depth_ratio_bound": round(at_0 / at_context, 4),
            "kv_bytes_allowed": int(allowed),
            "kv_bits_allowed": round(8 * b["kv_itemsize"] * allowed / b["kv_at_context"], 2) if b["kv_at_context"] else None}


def read_rate(n_bytes: int, threads: int, rounds: int) -> dict:
    """GB/s of a one-row fp32 MatMul streaming an n_bytes matrix (ORT's CPU EP, `threads` threads)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from hybrid_npu.runtime.session_options import session_options

    cols = 4096
    rows = max(1, n_bytes // (4 * cols))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [rows, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((rows, cols), dtype=np.float32) for _ in range(2)]
    x = rng.standard_normal((1, rows), dtype=np.float32)
    best = float("inf")
    for r in range(max(rounds, 2)):
        t0 = time.perf_counter()
        session.run(None, {"x": x, "w": mats[r % 2]})
        best = min(best, time.perf_counter() - t0)
    read = rows * cols * 4
    return {"matrix_bytes": read, "best_ms": round(best * 1e3, 3), "read_gb_per_s": round(read / best / 1e9, 2)}


def measured_bound(b: dict, read_gb_per_s: float, goal: float, rates: list[float]) -> dict:
    """The bound with the step at 0 as measured (rates: decode tok/s at 0 and at the context)."""
    step_0 = 1e3 / rates[0]
    added_ms = (b["kv_at_context"] - b["kv_at_0"]) / (read_gb_per_s * 1e9) * 1e3
    allowed_ms = step_0 * (1 / goal - 1)
    return {"decode_tokens_per_s": {"at_0": rates[0], "at_context": rates[1]},
            "measured_depth_ratio": round(rates[1] / rates[0], 4),
            "step_at_0_ms": round(step_0, 2),
            "step_at_0_ms_if_memory_bound": round(bytes_at_0(b) / (read_gb_per_s * 1e9) * 1e3, 2),
            "kv_added_read_ms_at_rate": round(added_ms, 2),
            "depth_ratio_bound_at_read_rate": round(step_0 / (step_0 + added_ms), 4),
            "kv_read_ms_allowed": round(allowed_ms, 2),
            "kv_bits_allowed_at_read_rate": round(
                8 * b["kv_itemsize"] * (allowed_ms * 1e-3 * read_gb_per_s * 1e9 + b["kv_at_0"]) / b["kv_at_context"], 2)}


def main(argv=None) -> int:
    ap = OneLineParser(prog="depth_bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--goal", type=float, default=0.85)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--no-measure", action="store_true", help="bytes only: time neither the read rate nor the decode steps")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.context < 1 or not 0 < args.goal < 1 or min(args.threads, args.rounds, args.steps) < 1:
        print("depth_bound: --context, --threads, --rounds and --steps take positive integers, --goal a fraction "
              "between 0 and 1", file=sys.stderr)
        return 2
    if not (args.export_dir / MANIFEST).exists():
        print(f"depth_bound: {args.export_dir} is not an export (no {MANIFEST}); export one with export-hybrid",
              file=sys.stderr)
        return 2
    try:
        b = step_bytes(args.export_dir, args.context)
    except (UserError, KeyError) as e:
        print(f"depth_bound: {args.export_dir}: {e}", file=sys.stderr)
        return 2
    result = {"machine": {"cpu": cpu_model()}, "export": str(args.export_dir), "context": args.context,
              "goal": args.goal, "bytes": b, **bound(b, args.goal)}
    if not args.no_measure and b["kv_at_context"]:
        rate = read_rate(b["kv_at_context"], args.threads, args.rounds)
        result["read_rate"] = dict(rate, threads=args.threads)
        result.update(measured_bound(b, rate["read_gb_per_s"], args.goal,
                                     decode_rates(args.export_dir, [0, args.context], args.steps, args.threads)))
    harness.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
