"""scripts/bench/matmul_ceiling.py: the bound it reports must come from the export's own matmuls.

Each rebuilt node multiplies its rows by the export's own packed weights (checked against numpy
dequantising them straight from weights.bin), every MatMulNBits node of the graph is there once,
and the rows match what the graph feeds them (the chunk; one row for the last-token lm_head).
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import CHUNK
from onnx import numpy_helper

from hybrid_npu.export.exporter import export
from hybrid_npu.export.quantize import dequantize_blockwise

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "bench"
import matmul_ceiling  # noqa: E402


@pytest.fixture(scope="module")
def exports(text_tied, tmp_path_factory):
    root = tmp_path_factory.mktemp("ceiling")
    # asymmetric block 16: zero points ride along as a fourth input
    export(text_tied.src, root / "int4", chunk=CHUNK, weights="int4", block_size=16, asymmetric=True)
    export(text_tied.src, root / "int8", chunk=CHUNK, weights="int8")
    return root


def _weights(node, graph_path):
    full = onnx.load(str(graph_path))  # with weights.bin: the bytes the export ships
    inits = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    return [inits[name] if name else None for name in (list(node.input[1:]) + [""])[:3]]


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("part", ["decode", "prefill"])
def test_rebuilt_matmuls_are_the_exports_own(text_tied, exports, mode, part):
    graph_path = exports / mode / "graphs" / f"{part}.onnx"
    model, shapes = matmul_ceiling.matmul_only_model(graph_path)
    original = [n for n in onnx.load(str(graph_path), load_external_data=False).graph.node
                if n.op_type == "MatMulNBits"]
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"] * len(original)
    tokens = 1 if part == "decode" else CHUNK
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    outs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    for i, (node, out) in enumerate(zip(original, outs)):
        attrs = matmul_ceiling._attrs(node)
        k, n, bits = attrs["K"], attrs["N"], attrs["bits"]
        rows = feed[f"rows.{i}"]
        assert rows.shape == (1 if node.input[1].startswith("lm_head") else tokens, k)
        packed, scales, zeros = _weights(node, graph_path)
        w = dequantize_blockwise(packed, scales.reshape(n, -1), zeros, bits, k)
        want = rows @ w.T
        # int8 activations (accuracy_level 4): a per-block rounding of the rows, ~1% here
        assert np.linalg.norm(out - want) <= 0.02 * np.linalg.norm(want), (node.name, part)


def test_ceiling_reports_both_steps_and_refuses_a_float_export(text_tied, exports, tmp_path):
    report = matmul_ceiling.ceiling(exports / "int4", threads=1, repeats=2, min_seconds=0)
    assert report["weights"] == "int4"
    for part, tokens in (("decode", 1), ("prefill", CHUNK)):
        step = report[part]
        assert step["matmul_nbits_nodes"] > 0 and step["ms_per_step"] > 0
        assert step["tokens_per_s"] == pytest.approx(tokens / step["ms_per_step"] * 1e3, rel=0.05)
    with pytest.raises(ValueError, match="float export"):
        matmul_ceiling.ceiling(text_tied.out)
    run = subprocess.run([sys.executable, str(SCRIPTS / "matmul_ceiling.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "no model.json" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
