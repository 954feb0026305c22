"""scripts/matmul_ceiling.py: the bound it reports must come from the export's own matmuls.

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

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
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


def _output_shapes(model, export_dir, feed) -> dict:
    """Run `model` (beside the export's weights.bin, where its external data resolves) on feed."""
    path = export_dir / "graphs" / "rest_test.onnx"
    onnx.save(model, str(path))
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    finally:
        path.unlink()
    return {o.name: v.shape for o, v in zip(session.get_outputs(), session.run(None, feed))}


def test_decode_gap_rest_graph_reads_no_weight_matmul(exports):
    """scripts/decode_gap.py's `rest`: the export's CPU graph without one MatMulNBits (If branches
    included) or their packed weights, yet the same outputs at the same shapes for the engine's own
    decode feed; an --ablate group also removes its op type, and an unknown one is refused."""
    import decode_gap

    import hybrid_npu
    from hybrid_npu.errors import UserError
    from hybrid_npu.kernels.graph import all_nodes
    from hybrid_npu.runtime.step_inputs import chain_feed

    export_dir = exports / "int4"
    graph_path = export_dir / "graphs" / "cpu.onnx"

    def op_types(g):
        return {n.op_type for n in all_nodes(g.node)}

    original = onnx.load(str(graph_path), load_external_data=False)
    assert "MatMulNBits" in op_types(original.graph)
    engine = hybrid_npu.load(export_dir, threads=1)
    engine.prefill_logits([1, 2, 3])
    pipe = engine.pipelines["decode"]
    feed = {k: v for k, v in chain_feed(engine.config, engine.state, [4], 1).items() if k in pipe._inputs[0]}
    want = dict(zip(pipe._outputs[0], pipe.sessions[0].run(pipe._outputs[0], feed)))
    for ops in (set(), {"LinearAttention", "CausalConvWithState"}):
        rest = decode_gap.ablated(graph_path, ops)
        kinds = op_types(rest.graph)
        assert "MatMulNBits" not in kinds and not kinds & ops
        assert not any(t.name.endswith((".q4", ".q8", ".scales")) for t in rest.graph.initializer)
        assert _output_shapes(rest, export_dir, feed) == {k: v.shape for k, v in want.items()}
    with pytest.raises(UserError, match="no pass-through for Gemm"):
        decode_gap.check_groups([{"Gemm"}])


def test_decode_gap_static_decode_arm_is_the_decode_step_without_ifs(exports):
    """A decode step's split also times decode.onnx (the one-token cores, no per-layer If): it
    answers the engine's decode feed with cpu.onnx's outputs, names and values."""
    import decode_gap

    import hybrid_npu
    from hybrid_npu.runtime.pipeline import cpu_session
    from hybrid_npu.runtime.step_inputs import chain_feed

    export_dir = exports / "int4"
    static = onnx.load(str(export_dir / "graphs" / "decode.onnx"), load_external_data=False)
    assert not any(n.op_type == "If" for n in static.graph.node)
    engine = hybrid_npu.load(export_dir, threads=1)
    engine.prefill_logits([1, 2, 3])
    pipe = engine.pipelines["decode"]
    feed = {k: v for k, v in chain_feed(engine.config, engine.state, [4], 1).items() if k in pipe._inputs[0]}
    want = pipe.sessions[0].run(pipe._outputs[0], feed)
    session = cpu_session(export_dir / "graphs" / "decode.onnx", engine.manifest, 1)
    got = session.run(pipe._outputs[0], {i.name: feed[i.name] for i in session.get_inputs()})
    for name, a, b in zip(pipe._outputs[0], want, got):
        np.testing.assert_allclose(b.reshape(a.shape), a, rtol=0, atol=1e-5, err_msg=name)
    result = decode_gap.measure(export_dir, threads=1, rounds=1, groups=[], tokens=1)
    assert set(result["best_median_ms"]) == {"full", "rest", "matmul_only", "static_decode"}
    assert -1 < result["ifs_share_of_full"] < 1


def test_decode_gap_splits_a_prefill_chunk_and_refuses_other_token_counts(exports):
    """--tokens CHUNK: the rest graph answers the engine's chunk feed at the full graph's shapes, the
    three arms time the chunk (the MatMulNBits alone at CHUNK rows, from prefill.onnx), and a token
    count the any-N graph has no branch for is one UserError."""
    import decode_gap

    import hybrid_npu
    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime.step_inputs import chain_feed

    export_dir = exports / "int4"
    engine = hybrid_npu.load(export_dir, threads=1)
    engine.prefill_logits([1, 2, 3])
    pipe = engine.pipelines["decode"]
    feed = {k: v for k, v in chain_feed(engine.config, engine.state, list(range(4, 4 + CHUNK)), CHUNK).items()
            if k in pipe._inputs[0]}
    want = dict(zip(pipe._outputs[0], pipe.sessions[0].run(pipe._outputs[0], feed)))
    assert want[f"new_key.{engine.config.full_layers[0]}"].shape[1] == CHUNK
    rest = decode_gap.ablated(export_dir / "graphs" / "cpu.onnx", set())
    assert _output_shapes(rest, export_dir, feed) == {k: v.shape for k, v in want.items()}
    result = decode_gap.measure(export_dir, threads=1, rounds=1, groups=[], tokens=CHUNK)
    assert result["tokens"] == CHUNK and set(result["best_median_ms"]) == {"full", "rest", "matmul_only"}
    assert all(v > 0 for v in result["best_median_ms"].values())
    with pytest.raises(UserError, match="--tokens 3"):
        decode_gap.measure(export_dir, threads=1, rounds=1, groups=[], tokens=3)
