"""Quantised NPU parts (issue: quantised weights, NPU): QDQ w8a16/w4a16 calibrated on user text,
and MatMulNBits on the HTP, compiled on onnxruntime-qnn's x86_64 emulator with CPU fallback off."""
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import CHUNK
from onnx import TensorProto
from test_npu_export import derived_profile

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.export.npu.qdq import calibration_steps
from hybrid_npu.runtime.pipeline import Pipeline

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")

TEXT = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
        "The quick brown fox jumps over the lazy dog. ") * 12


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qdq8(text_tied, htp_profile, calib, tmp_path_factory):
    out = tmp_path_factory.mktemp("qdq8") / "export"
    manifest = export(text_tied.src, out, chunk=CHUNK, profile=htp_profile, weights="int8", calibration=calib)
    return out, manifest


def _part(out, manifest, graph="parts", k=0):
    return out / manifest["npu"]["test-htp"][graph][k]["file"]


def _initializer_types(path):
    m = onnx.load(str(path), load_external_data=False)
    return {t.name: t.data_type for t in m.graph.initializer}, m.graph


def _prompt(engine, n=3 * CHUNK + 5):
    return engine.tokenizer.encode(TEXT[40:400]).ids[:n]


def test_qdq_manifest_records_the_scheme_and_the_calibration_text(qdq8, calib):
    out, manifest = qdq8
    w = manifest["npu"]["test-htp"]["weights"]
    assert (w["method"], w["activations"], w["weights"], w["per_channel"]) == ("qdq", "uint16", "int8", True)
    assert w["calibration"]["file"] == calib.name and w["calibration"]["tokens"] > CHUNK
    import hashlib
    assert w["calibration"]["sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest()
    assert manifest["weights"]["mode"] == "int8"  # the CPU graphs: MatMulNBits
    assert manifest["npu"]["test-htp"]["context"]["files"]  # compiled with CPU fallback off = 100% on the HTP


def test_closing_table_names_the_npu_weights_and_their_file(qdq8, calib):
    from hybrid_npu.export.summary import summary_lines

    out, manifest = qdq8
    text = "\n".join(summary_lines(out, manifest))
    assert f"QDQ w8a16 (int8 per channel, uint16 activations), calibrated on {calib.name}" in text
    data = _part(out, manifest).name + ".data"
    assert data in text and "its QDQ weights" in text
    import os
    assert os.access(_part(out, manifest).with_name(data), os.R_OK)


def test_qdq_part_quantises_the_linear_layers_and_keeps_the_state_path_float(qdq8):
    out, manifest = qdq8
    types, graph = _initializer_types(_part(out, manifest))
    produced_by = {o: n for n in graph.node for o in n.output}
    linears = [n for n in graph.node if n.op_type == "Gemm"]
    assert len(linears) > 8
    assert types["embed_tokens.weight"] == TensorProto.FLOAT16  # gathered, then widened row by row
    gates = [n for n in linears if n.input[1].endswith(".in_proj_ba")]
    assert gates and all(types[n.input[1]] == TensorProto.FLOAT for n in gates)  # b/a stay float
    others = [n for n in linears if n not in gates]
    for n in others:  # weight through DequantizeLinear of int8, activation through a uint16 Q/DQ pair
        wdq = produced_by[n.input[1]]
        assert wdq.op_type == "DequantizeLinear" and types[wdq.input[0]] == TensorProto.INT8, n.name
        xdq = produced_by[n.input[0]]
        assert xdq.op_type == "DequantizeLinear" and types[xdq.input[2]] == TensorProto.UINT16, n.name
    # nothing of the delta rule is quantised: its MatMuls take float inputs straight from float ops
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    assert matmuls and not any(produced_by.get(i) is not None and produced_by[i].op_type == "DequantizeLinear"
                               for n in matmuls for i in n.input)


def test_qdq_prefill_on_the_htp_follows_the_float_model(qdq8, text_tied, htp_profile):
    out, _ = qdq8
    npu = hybrid_npu.load_engine(out, profile=htp_profile, prefill="npu")
    assert npu.pipelines["npu_prefill"].from_context
    ids = _prompt(npu)
    got = npu.prefill_logits(ids)
    assert npu.prefill_devices == "QNN/HTP"
    ref = hybrid_npu.load_engine(text_tied.out).prefill_logits(ids)  # fp32, CPU
    # the random tiny fixture amplifies rounding: its CPU int8 export is ~7% of the logit scale off
    # fp32 and fp16 on the HTP ~5%; clipped (badly calibrated) activations land far outside this
    assert np.abs(got - ref).max() < 0.15 * np.abs(ref).max()
    assert np.corrcoef(got, ref)[0, 1] > 0.98


def test_calibration_text_sets_the_activation_ranges(text_tied, htp_profile, calib, qdq8, tmp_path):
    """Another text gives other ranges: the scales come from the user's text, not from defaults."""
    other = tmp_path / "other.txt"
    other.write_text("0123456789 " * 200, encoding="utf-8")
    out = tmp_path / "other"
    m = export(text_tied.src, out, chunk=CHUNK, profile=htp_profile, weights="int8", calibration=other,
               compile_context=False)

    def activation_scales(path):
        g = onnx.load(str(path)).graph
        init = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
        return {n.input[1]: float(init[n.input[1]]) for n in g.node if n.op_type == "QuantizeLinear"}
    a, b = activation_scales(_part(*qdq8)), activation_scales(_part(out, m))
    assert a.keys() == b.keys() and any(abs(a[k] - b[k]) > 1e-3 * a[k] for k in a)


def test_w4a16_keeps_the_head_at_8_bits_and_stays_close(text_tied, htp_profile, calib, tmp_path):
    out = tmp_path / "w4"
    m = export(text_tied.src, out, chunk=CHUNK, profile=htp_profile, weights="int4", calibration=calib,
               compile_context=False)
    assert m["npu"]["test-htp"]["weights"]["weights"] == "int4"
    types, _ = _initializer_types(_part(out, m, k=-1))  # the last segment holds the head
    assert types["lm_head_quantized"] == TensorProto.INT8
    assert any(t == TensorProto.INT4 for t in types.values())
    # the QDQ part on the CPU EP (the quantiser's own simulation) against the float part, with the
    # CPU's int4 export (MatMulNBits, blocks of 32) as the bar: 4 bits on the random tiny fixture
    # move the logits a lot either way (int4 on the trained model: scripts/bench/eval_quantized.py)
    engine = hybrid_npu.load_engine(text_tied.out)
    from hybrid_npu.runtime.state import State
    from hybrid_npu.runtime.step_inputs import chain_feed
    feed = chain_feed(engine.config, State.fresh(engine.config), _prompt(engine, CHUNK), CHUNK)
    segments = [ort.InferenceSession(str(out / p["file"]), providers=["CPUExecutionProvider"])
                for p in m["npu"]["test-htp"]["parts"]]  # the attention cores between them in fp32 on the host
    q = Pipeline(segments, "CPU").run(feed)
    ref = engine.pipelines["prefill"].run(feed)["logits"][0]
    cpu4 = hybrid_npu.load_engine(out, prefill="cpu").pipelines["prefill"].run(feed)["logits"][0]
    err, corr = np.abs(q["logits"][0] - ref).max(), np.corrcoef(q["logits"][0], ref)[0, 1]
    assert err <= 1.25 * np.abs(cpu4 - ref).max() and corr >= np.corrcoef(cpu4, ref)[0, 1] - 0.1


def test_matmulnbits_on_the_htp(htp_profile, tmp_path):
    """--npu-quant nbits: the CPU's int4 weights run on the HTP as MatMulNBits (3-D inputs; every
    input width a multiple of the block, which the tiny fixture's 48/60/88 are not)."""
    import fixtures
    with pytest.raises(UserError, match="hidden_size 48 is not divisible by 32"):
        fixtures.write_text_checkpoint(tmp_path / "hf48")
        export(tmp_path / "hf48", tmp_path / "x", chunk=CHUNK, profile=htp_profile, weights="int4", npu_quant="nbits")
    src = tmp_path / "hf"
    fixtures.write_text_checkpoint(src, seed=7, hidden_size=64, intermediate_size=96, linear_value_head_dim=16)
    out = tmp_path / "nbits"
    m = export(src, out, chunk=CHUNK, profile=htp_profile, weights="int4", npu_quant="nbits")
    assert m["npu"]["test-htp"]["weights"]["method"] == "nbits"
    _, graph = _initializer_types(_part(out, m))
    assert any(n.op_type == "MatMulNBits" for n in graph.node)
    npu = hybrid_npu.load_engine(out, profile=htp_profile, prefill="npu")
    ids = _prompt(npu)
    got = npu.prefill_logits(ids)
    assert npu.prefill_devices == "QNN/HTP"
    # against fp32: as close as the CPU's int4 export (same weights; the CPU also rounds activations
    # to int8, the HTP keeps them fp16, and this random fixture amplifies either)
    float_out = tmp_path / "float"
    export(src, float_out, chunk=CHUNK)
    ref = hybrid_npu.load_engine(float_out).prefill_logits(ids)
    cpu4 = hybrid_npu.load_engine(out, prefill="cpu").prefill_logits(ids)
    assert np.abs(got - ref).max() <= 1.25 * np.abs(cpu4 - ref).max()
    assert np.corrcoef(got, ref)[0, 1] >= np.corrcoef(cpu4, ref)[0, 1] - 0.05


def test_verify_parts_are_calibrated_on_chain_trees(text_tied, htp_profile, calib, tmp_path):
    """A profile that verifies on the NPU gets QDQ verify parts too; a chain-shaped tree through the
    verify graph advances the state exactly as prefill chunks do (what calibration relies on)."""
    prof = derived_profile(htp_profile, tmp_path, "verify-npu", verify_device='"npu"', verify_tree_size="8")
    out = tmp_path / "verify"
    m = export(text_tied.src, out, chunk=CHUNK, profile=prof, weights="int8", calibration=calib,
               compile_context=False)
    types, _ = _initializer_types(out / m["npu"]["verify-npu"]["verify_parts"][0]["file"])
    assert any(t == TensorProto.INT8 for t in types.values())
    engine = hybrid_npu.load_engine(text_tied.out)
    n = engine.manifest.verify.n
    ids = (_prompt(engine, 10 * CHUNK) * 4)[: 2 * n - 3]  # the second tree is not full
    last = {}
    for graph, tree, size in (("prefill", False, CHUNK), ("verify", True, n)):
        for feed, commit in calibration_steps(engine.config, ids, size, tree):
            out = engine.pipelines[graph].run(feed)
            commit(out)
            last[graph] = out["logits"][0] if not tree else out["logits"][len(ids) % n - 1]
    np.testing.assert_allclose(last["verify"], last["prefill"], atol=1e-4)


# ---------------------------------------------------------------- bad flags

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hybrid_npu.export.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("flags, says", [
    (["--calibration", "{calib}"], "--calibration applies to the NPU graphs of a quantised export"),
    (["--weights", "int8", "--calibration", "{calib}"], "add --weights int8|int4 and an NPU --profile"),
    (["--weights", "int8", "--profile", "{prof}"], "add --calibration FILE"),
    (["--weights", "int8", "--profile", "{prof}", "--calibration", "{missing}"], "no such file"),
    (["--weights", "int8", "--profile", "{prof}", "--calibration", "{empty}"], "is empty"),
    (["--weights", "int8", "--profile", "{prof}", "--calibration", "{binary}"], "is not UTF-8 text"),
    (["--weights", "int4", "--profile", "{prof}", "--npu-quant", "nbits", "--calibration", "{calib}"],
     "drop it with --npu-quant nbits"),
    (["--npu-quant", "nbits"], "--npu-quant applies to the NPU graphs"),
])
def test_bad_quantisation_flags_get_one_line_and_exit_2(flags, says, text_tied, htp_profile, calib, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 10)
    values = {"calib": calib, "prof": htp_profile, "missing": tmp_path / "nope.txt", "empty": tmp_path / "empty.txt",
              "binary": tmp_path / "binary.txt"}
    out = tmp_path / "out"
    proc = run_cli(text_tied.src, out, *[f.format(**values) for f in flags])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------- real size
def _random_feeds(path, free_dims, count=2):
    """Inputs of the graph's declared shapes (free dims as given): activation ranges only need to
    be plausible for a placement check."""
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(count):
        feed = {}
        for i in session.get_inputs():
            shape = [free_dims.get(d, d) if isinstance(d, str) else d for d in i.shape]
            feed[i.name] = (np.zeros(shape, np.float32) if i.name == "attn_mask"
                            else np.ones(shape, np.float32) if i.name.startswith("recurrent_scale.")  # state units
                            else rng.standard_normal(shape).astype(np.float32))
        yield feed


@pytest.mark.parametrize("name, bits", [("gdn_layer", 8), ("attention_layer", 4)])
def test_real_qwen35_08b_qdq_layers_place_entirely_on_the_htp(name, bits, tmp_path):
    """A real Qwen3.5-0.8B GDN layer (w8a16) and attention layer (w4a16) in QDQ form, at the shipped
    X Elite profile's T_max, CPU fallback disabled: the quantised path keeps 100% HTP coverage."""
    from real_size import qwen35_text_config, write_graph
    from test_npu_export import REAL_GRAPHS

    from hybrid_npu.export.npu.check import compile_on_npu
    from hybrid_npu.export.npu.qdq import quantize_graph
    from hybrid_npu.profiles.loader import load_profile
    from hybrid_npu.runtime.npu_sessions import MASK_DIM, PAST_DIM

    cfg, spec = qwen35_text_config("0.8B"), REAL_GRAPHS[name]
    src = write_graph(cfg, spec, tmp_path / "float", name, quantizable=True)
    dst = tmp_path / f"{name}.qdq.onnx"
    done, kept = quantize_graph(src, dst, _random_feeds(src, {PAST_DIM: 16, MASK_DIM: 16 + spec.n}), bits)
    assert done == 4 and kept == (1 if name == "gdn_layer" else 0)  # qkvz or qkv, out/o_proj, gate_up, down; ba float
    prof = load_profile("snapdragon-x-elite")
    t = prof.attention_capacity
    r = compile_on_npu(dst, {**prof.qnn_provider_options(), "htp_graph_finalization_optimization_mode": "1"},
                       {PAST_DIM: t, MASK_DIM: t + spec.n})
    print(f"\n{name} w{bits}a16: {r['nodes']} nodes, {r['on_htp']} on HTP, compile {r.get('compile_s')} s")
    assert r["ok"], r
    assert r["on_htp"] == r["nodes"]
