"""--weights int8/int4: block-wise quantised linear layers through ORT's MatMulNBits.

Three layers of evidence:
* numpy: quantise -> dequantise is within scale/2 per element (K not a multiple of the block too);
* one MatMulNBits node reads our packing exactly as numpy dequantises it (fp32 compute), and the
  shipped int8-activation compute (accuracy_level 4) stays within the activation rounding bound;
* whole exports: with int8 activations switched off they equal transformers running the same
  dequantised weights (1e-4, like the float parity tests), and as shipped they stay within what
  the weight rounding itself moves the fp32 model's logits (measured on the same fixture).

The tiny random fixtures are far more sensitive than a trained model (a 1e-3 relative weight change
moves text_tied's logits by ~0.4, 20% of their std: GDN layer 3 normalises a near-zero output), so
end-to-end tolerances are expressed relative to the fixture's own response to the rounding.
"""
import copy
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import CHUNK

import fixtures
import hybrid_npu
from hybrid_npu.config import ModelConfig
from hybrid_npu import integrity
from hybrid_npu.export.cli import main as export_cli
from hybrid_npu.export.exporter import export
from hybrid_npu.export.parity import QUANTISED_REL, check_parity
from hybrid_npu.export.quantize import dequantize_blockwise, quantize_blockwise
from hybrid_npu.kernels.graph import GraphBuilder

MODES = {"int8": dict(weights="int8"), "int4": dict(weights="int4"),
         # hidden 48 = 3 blocks of 16: an odd block count, so each row's packed zero points end half-used
         "int4-asym-b16": dict(weights="int4", block_size=16, asymmetric=True),
         "int8-head4": dict(weights="int8", head_bits=4)}  # --head-bits 4: the lm_head at int4


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed + n).integers(0, 300, n)]


def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


# ---------------------------------------------------------------- numpy round trip
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("k,block", [(48, 32), (48, 16), (256, 64), (100, 128)])
def test_round_trip_error_is_at_most_half_a_step(bits, symmetric, k, block):
    rng = np.random.default_rng(bits + k + block)
    w = rng.standard_normal((37, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (37, 1)).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 0 must not divide by zero
    w[5, :] = np.abs(w[5, :])  # one-signed rows: the asymmetric range still holds 0 exactly
    packed, scales, zeros = quantize_blockwise(w, bits, block, symmetric)
    n_blocks = -(-k // block)
    assert packed.shape == (37, n_blocks, block * bits // 8) and packed.dtype == np.uint8
    assert scales.shape == (37, n_blocks)
    assert (zeros is None) == symmetric
    if zeros is not None:
        assert zeros.shape == (37, -(-n_blocks * bits // 8))
    back = dequantize_blockwise(packed, scales, zeros, bits, k)
    step = np.repeat(scales, block, axis=1)[:, :k]  # each element's block scale
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(back[3] == 0.0)
    assert np.abs(back - w).max() > 0  # it did quantise
    levels = {4: 16, 8: 256}[bits]  # the block's extreme is reached: the full range is used
    assert np.allclose(np.abs(w).max(axis=1)[[0, 1, 2]], np.abs(back).max(axis=1)[[0, 1, 2]],
                       rtol=2.0 / levels)


# ---------------------------------------------------------------- one MatMulNBits node
def _nbits_session(w, x_rows, bits, block, symmetric, accuracy_level):
    n, k = w.shape
    packed, scales, zeros = quantize_blockwise(w, bits, block, symmetric)
    g = GraphBuilder("one_linear")
    x = g.input("x", np.float32, [x_rows, k])
    g.initializers.update({"B": packed, "scales": scales, **({"zp": zeros} if zeros is not None else {})})
    y = g.matmul_nbits(x, "B", "scales", "zp" if zeros is not None else None, k=k, n=n, bits=bits, block_size=block)
    next(a for a in g.nodes[-1].attribute if a.name == "accuracy_level").i = accuracy_level
    g.output(y, "y", np.float32, [x_rows, n])
    sess = ort.InferenceSession(g.model({}).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess, dequantize_blockwise(packed, scales, zeros, bits, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("k,block", [(48, 32), (48, 16), (96, 32)])
def test_matmul_nbits_reads_our_packing(bits, symmetric, k, block):
    rng = np.random.default_rng(k + block + bits)
    w = rng.standard_normal((40, k)).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    exact, deq = _nbits_session(w, 5, bits, block, symmetric, accuracy_level=0)
    want = x @ deq.T
    assert np.abs(exact.run(None, {"x": x})[0] - want).max() <= 1e-5 * np.abs(want).max()
    # As shipped, x is rounded to int8 per block (step <= max|x_row|/127): bounded by half a step
    # times the row's absolute weight sum.
    shipped, _ = _nbits_session(w, 5, bits, block, symmetric, accuracy_level=4)
    bound = (np.abs(x).max(axis=1, keepdims=True) / 254) * np.abs(deq).sum(axis=1)[None, :]
    assert np.all(np.abs(shipped.run(None, {"x": x})[0] - want) <= bound * (1 + 1e-4) + 1e-5)


# ---------------------------------------------------------------- whole exports
@pytest.fixture(scope="module")
def quantized(text_tied, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    for name, kw in MODES.items():  # the fp32 cache: what these tests hold apart is the weights' rounding
        export(text_tied.src, root / name, chunk=CHUNK, kv_cache="fp32", **kw)
    return root


@pytest.fixture(scope="module")
def untied_int4(text_untied, tmp_path_factory):
    out = tmp_path_factory.mktemp("untied") / "int4"
    export(text_untied.src, out, chunk=CHUNK, weights="int4")
    return out


def fp32_compute_copy(export_dir, dest):
    """The same export with MatMulNBits multiplying in fp32 (accuracy_level 0), weights untouched."""
    shutil.copytree(export_dir, dest)
    fixtures.fp32_compute(dest / "graphs")
    manifest = json.loads((dest / "model.json").read_text())
    manifest["integrity"] = integrity.record(dest)  # the graphs were edited on purpose: hash them again
    (dest / "model.json").write_text(json.dumps(manifest))
    return dest


def fake_quantized_reference(ref, weights: dict):
    """transformers with every weight the export quantises replaced by its dequantised value: the
    GDN gate projections in_proj_a/b stay float, the embedding rounds to fp16, the head is int8."""
    bits, block, symmetric = weights["bits"], weights["block_size"], weights["symmetric"]

    def round_trip(w, b):
        w = w.detach().numpy()
        return torch.tensor(dequantize_blockwise(*quantize_blockwise(w, b, block, symmetric), b, w.shape[1]))

    model = copy.deepcopy(ref)
    with torch.no_grad():
        head = round_trip(model.lm_head.weight, weights["head_bits"])
        model.lm_head.weight = torch.nn.Parameter(head)  # unties a tied head from the table
        table = model.model.embed_tokens.weight
        table.copy_(table.half().float())
        for name, module in model.named_modules():
            kept_float = name == "lm_head" or name.endswith(("in_proj_a", "in_proj_b"))
            if isinstance(module, torch.nn.Linear) and not kept_float:
                module.weight.copy_(round_trip(module.weight, bits))
    return model


def last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("mode", list(MODES))
def test_export_equals_transformers_on_the_dequantised_weights(text_tied, quantized, tmp_path, mode):
    manifest = json.loads((quantized / mode / "model.json").read_text())
    engine = hybrid_npu.load_engine(fp32_compute_copy(quantized / mode, tmp_path / mode))
    ref = fake_quantized_reference(text_tied.ref, manifest["weights"])
    for n in (1, CHUNK, 3 * CHUNK + 7):
        ids = prompt(n)
        want = last_logits(ref, ids)
        assert np.abs(engine.prefill_logits(ids) - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), (mode, n)
    ids = prompt(CHUNK + 3, seed=7)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert engine.generate(ids, 24, stop_at_eos=False) == hf


def test_untied_head_is_quantised_from_lm_head(text_untied, untied_int4, tmp_path):
    manifest = json.loads((untied_int4 / "model.json").read_text())
    engine = hybrid_npu.load_engine(fp32_compute_copy(untied_int4, tmp_path / "copy"))
    ref = fake_quantized_reference(text_untied.ref, manifest["weights"])
    ids = prompt(2 * CHUNK + 1)
    want = last_logits(ref, ids)
    assert np.abs(engine.prefill_logits(ids) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("mode", list(MODES))
def test_shipped_logits_stay_within_the_weight_rounding_effect(text_tied, quantized, mode):
    """As shipped (int8 activations too), the distance to the fp32 export is at most twice the
    distance the weight rounding alone puts between transformers fp32 and its dequantised copy:
    int8 activation rounding is a second error of at most the int8 weights' size."""
    manifest = json.loads((quantized / mode / "model.json").read_text())
    ref = fake_quantized_reference(text_tied.ref, manifest["weights"])
    shipped, fp32 = hybrid_npu.load_engine(quantized / mode), hybrid_npu.load_engine(text_tied.out)
    for n in (1, CHUNK - 1, 3 * CHUNK + 7):
        ids = prompt(n, seed=3)
        base = fp32.prefill_logits(ids)
        weight_effect = rms(last_logits(ref, ids) - last_logits(text_tied.ref, ids))
        got = rms(shipped.prefill_logits(ids) - base)
        assert 0 < got <= 2 * weight_effect + 0.02 * base.std(), (mode, n, got, weight_effect)


def test_int8_decode_mostly_picks_the_fp32_token(text_tied, quantized):
    """Teacher-forced on the fp32 greedy continuation through the decode graph: int8 agrees on most
    next tokens (a free-running comparison diverges for good at the first near-tie)."""
    ids = prompt(CHUNK + 3, seed=11)
    continuation = hybrid_npu.load_engine(text_tied.out).generate(ids, 32, stop_at_eos=False)
    engine = hybrid_npu.load_engine(quantized / "int8")
    logits = engine.prefill_logits(ids)
    agree = 0
    for token in continuation:
        agree += int(np.argmax(logits) == token)
        logits = engine.decode(token)
    assert agree >= 0.6 * len(continuation), agree


class ChainDrafter:
    """Proposes the plain greedy continuation as a chain: the verify graph scores all of it."""

    def __init__(self, engine, sequence):
        self.engine, self.sequence = engine, sequence

    def reset(self):
        pass

    def observe(self, tokens, taps):
        pass

    def propose(self, root, top_k, depth, total_tokens):
        pos = self.engine.state.position + 1
        tokens = self.sequence[pos: pos + min(depth, total_tokens)]
        return tokens, list(range(-1, len(tokens) - 1))


def test_quantised_parity_is_relative_and_still_catches_a_frozen_conv_state(quantized, tmp_path):
    """Quantised exports are held to a relative L2 bound (MLAS's one-row and many-row int8 activation
    paths differ slightly, and every layer amplifies it): the shipped int4 export passes it, and the
    same export with a wiring fault (decode never shifts its conv windows) fails it."""
    out = shutil.copytree(quantized / "int4", tmp_path / "broken")
    manifest = json.loads((out / "model.json").read_text())
    report = check_parity(out, manifest)
    assert not report.problems and report.logits_rel < QUANTISED_REL and report.state_rel < QUANTISED_REL
    path = out / "graphs/decode.onnx"
    model = onnx.load(str(path), load_external_data=False)
    frozen = 0
    for node in model.graph.node:
        if node.op_type == "Identity" and node.output[0].startswith("conv_state_out."):
            node.input[0] = node.output[0].replace("conv_state_out.", "conv_state.")
            frozen += 1
    assert frozen == sum(t == "linear_attention" for t in manifest["config"]["layer_types"])
    onnx.save_model(model, str(path))
    report = check_parity(out, manifest)
    assert any("relative L2" in p for p in report.problems), report.line()


def test_npu_profile_on_a_quantised_export_without_npu_parts_runs_on_the_cpu(quantized, htp_profile):
    """Its CPU graphs cannot go to the HTP whole (MatMulNBits there takes 2-D inputs, refused): the
    engine says so and runs on the CPU. A graph the HTP refuses is NpuUnavailable, never a crash."""
    pytest.importorskip("onnxruntime_qnn")
    from hybrid_npu.profiles.loader import load_profile
    from hybrid_npu.runtime.npu_sessions import open_npu_pipeline
    from hybrid_npu.runtime.qnn import NpuUnavailable

    engine = hybrid_npu.load_engine(quantized / "int8", profile=htp_profile)
    assert "no NPU prefill graphs" in engine.notice and "npu_prefill" not in engine.pipelines
    assert len(engine.generate(prompt(12), 3, stop_at_eos=False)) == 3
    manifest = json.loads((quantized / "int8" / "model.json").read_text())
    manifest["weights"]["mode"] = "float"  # forces the whole CPU prefill graph onto the HTP
    with pytest.raises(NpuUnavailable, match="the HTP refused graphs/prefill.onnx"):
        open_npu_pipeline(quantized / "int8", manifest, load_profile(htp_profile))


def test_verify_graph_runs_quantised(quantized):
    """Speculating with the export's own greedy continuation: the verify graph (MatMulNBits over a
    token tree) accepts it and the output is the plain greedy output."""
    ids = prompt(CHUNK + 5, seed=5)
    plain = hybrid_npu.load_engine(quantized / "int4").generate(ids, 20, stop_at_eos=False)
    engine = hybrid_npu.load_engine(quantized / "int4")
    engine.drafter = ChainDrafter(engine, ids + plain)
    engine.adaptive = False  # a round every step: the acceptance bound must not hang on the policy's timings
    assert engine.generate(ids, 20, stop_at_eos=False) == plain
    assert engine.last_stats["rounds"] > 0 and engine.last_stats["acceptance_length"] > 2


# ---------------------------------------------------------------- what the export holds
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_graphs_hold_matmul_nbits_and_no_float_copy(text_tied, quantized, mode):
    cfg = ModelConfig.from_dict(json.loads((quantized / mode / "model.json").read_text())["config"])
    model = onnx.load(str(quantized / mode / "graphs" / "decode.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 4 * cfg.num_layers + 1  # 4 per layer + the head
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == cfg.layer_types.count("linear_attention")  # only the float in_proj_ba
    assert all(n.input[1].endswith("in_proj_ba") for n in gemms)
    floats = {t.name: list(t.dims) for t in model.graph.initializer
              if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and len(t.dims) == 2}
    k_in = {cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim,
            cfg.linear_num_value_heads * cfg.linear_value_head_dim}
    big = {name: dims for name, dims in floats.items()
           if dims[1] in k_in and not name.endswith(("in_proj_ba", ".scales")) and name != "embed_tokens.weight"}
    assert not big, big  # no float [N, K] matrix next to a quantised one
    assert any(d.domain == "com.microsoft" for d in model.opset_import)


@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4", 4)])
def test_weights_file_is_the_quantised_size(text_tied, quantized, mode, bits):
    manifest = json.loads((quantized / mode / "model.json").read_text())
    w = manifest["weights"]
    assert (w["mode"], w["bits"], w["block_size"], w["symmetric"]) == (mode, bits, 32, True)
    file_bytes = (quantized / mode / "graphs" / "weights.bin").stat().st_size
    assert w["bytes"] == file_bytes
    # Every linear: N·K fp32 in the float export; here N·ceil(K/32)·(32·bits/8 + 4 scale bytes).
    model = onnx.load(str(quantized / mode / "graphs" / "verify.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    fp32_linear = quantised = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.input[1] != "lm_head.q8":
            a = {x.name: x.i for x in node.attribute}
            fp32_linear += 4 * a["N"] * a["K"]
            b, s = (int(np.prod(inits[node.input[i]].dims)) for i in (1, 2))
            assert b == a["N"] * -(-a["K"] // 32) * 32 * bits // 8 and s == a["N"] * -(-a["K"] // 32)
            quantised += b + 4 * s
    padded = 64 / 48  # hidden 48 pads to 64 (block 32); other K (60, 88, 96) differ, so compare loosely
    assert quantised <= fp32_linear * (bits / 32 + 4 / (4 * 32)) * padded
    assert quantised >= fp32_linear * bits / 32
    float_file = (text_tied.out / "graphs" / "weights.bin").stat().st_size
    assert file_bytes < float_file * {8: 0.5, 4: 0.35}[bits]


def matmul_nbits_bytes(graph) -> int:
    """Bytes of the MatMulNBits weights (B, scales, zero points) a graph reads from weights.bin."""
    model = onnx.load(str(graph), load_external_data=False)
    length = {t.name: int({e.key: e.value for e in t.external_data}["length"]) for t in model.graph.initializer
              if t.external_data}
    return sum(length[name] for name in {i for node in model.graph.node if node.op_type == "MatMulNBits"
                                         for i in node.input[1:] if i})


class AnyDrafter:
    """Any object with reset/observe/propose turns speculation on (never called here)."""
    def reset(self): ...
    def observe(self, *args): ...
    def propose(self, *args): ...


def test_memory_plan_charges_the_quantised_weights(text_tied, quantized):
    """The engine's memory plan counts the quantised weights file (prefill and decode share one CPU
    session, the any-N graph), plus the verify session's own prepacked copy of the MatMulNBits
    matrices once speculation runs on the CPU; the same budget holds more context than fp32's."""
    import hybrid_npu

    fp32 = hybrid_npu.load_engine(text_tied.out)
    budget = fp32.memory_report()["weights_bytes"] + fp32.memory_report()["state_bytes"] + (1 << 20)
    params = json.loads((text_tied.out / "model.json").read_text())["weights"]["params"]
    # a float export this small prepacks (runtime/memory.py): an fp32 copy of its parameters in its one session
    assert fp32.memory_report()["weights_bytes"] == (text_tied.out / "graphs" / "weights.bin").stat().st_size + 4 * params
    plans = {"float": hybrid_npu.load_engine(text_tied.out, memory=budget).memory_report()["max_context"]}
    for mode in ("int8", "int4"):
        path = quantized / mode
        manifest = json.loads((path / "model.json").read_text())
        packed = manifest["weights"]["prepacked_bytes"]
        assert packed == matmul_nbits_bytes(path / "graphs" / "decode.onnx") > 0
        file = (path / "graphs" / "weights.bin").stat().st_size
        report = hybrid_npu.load_engine(path, memory=budget).memory_report()
        assert report["weights_bytes"] == file
        plans[mode] = report["max_context"]
        speculating = hybrid_npu.load_engine(path, memory=budget, drafter=AnyDrafter()).memory_report()
        assert speculating["weights_bytes"] == file + packed  # verify: a second CPU session
    assert plans["float"] < plans["int8"] < plans["int4"]


# ---------------------------------------------------------------- bad flags: one line, exit 2
@pytest.mark.parametrize("flags,says", [
    (["--weights", "int3"], "invalid choice"),
    (["--weights", "int4", "--block-size", "7"], "power of two"),
    (["--weights", "int4", "--block-size", "48"], "power of two"),
    (["--weights", "int8", "--block-size", "8"], "power of two"),
    (["--block-size", "32"], "add --weights"),
    (["--asymmetric"], "add --weights"),
    (["--head-bits", "4"], "add --weights"),
    (["--weights", "int8", "--head-bits", "6"], "invalid choice"),
    (["--weights", "int4", "--profile", "snapdragon-x-elite"], "add --calibration FILE"),
    (["--drafter-weights", "int8"], "add --drafter mtp or --drafter DIR"),
    (["--drafter-weights", "int2"], "invalid choice"),
])
def test_bad_quantisation_flags_exit_2_in_one_line(text_tied, tmp_path, capsys, flags, says):
    code = export_cli([str(text_tied.src), str(tmp_path / "out"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def _eagle3_drafter(tmp_path):
    """A small EAGLE-3 drafter checkpoint for text_tied (it shares the target's embedding)."""
    import drafter_fixtures

    return drafter_fixtures.write_eagle3(tmp_path / "eagle3", drafter_fixtures.drafter_weights(seed=1, hidden_size=48,
                                                                                              embed=False), hidden_size=48)


def _assert_rounds_give_the_plain_output(export_dir):
    """A round every step on this export speculates, and emits the target's own greedy tokens."""
    engine = hybrid_npu.load_engine(export_dir)
    engine.adaptive = False  # a round every step
    ids = prompt(2 * CHUNK + 3, seed=5)
    spec = engine.generate(ids, 32, stop_at_eos=False)
    assert engine.last_stats["rounds"] > 0
    assert spec == engine.generate(ids, 32, stop_at_eos=False, speculative=False)


def test_a_quantised_export_ships_its_drafter_quantised_alike(text_tied, tmp_path):
    """--weights int4 with an EAGLE-3 drafter: the drafter's linear layers are int4 too (a float
    drafter at the real size reads more a draft level than the int4 target's decode step), and
    speculation with both quantised is still the target's own greedy output."""
    src = _eagle3_drafter(tmp_path)
    export(text_tied.src, tmp_path / "out", chunk=CHUNK, weights="int4", drafter=src)
    target = json.loads((tmp_path / "out" / "model.json").read_text())["weights"]
    drafter = json.loads((tmp_path / "out" / "drafter" / "drafter.json").read_text())["weights"]
    assert drafter["quant"]["bits"] == 4 and drafter["quant"]["block_size"] == target["block_size"]
    _assert_rounds_give_the_plain_output(tmp_path / "out")


@pytest.mark.parametrize("weights,drafter_weights,bits", [(None, "int8", 8), ("int4", "float", None)],
                         ids=["float-target-int8-drafter", "int4-target-float-drafter"])
def test_drafter_weights_set_the_drafters_precision_apart_from_the_targets(text_tied, tmp_path, weights,
                                                                          drafter_weights, bits):
    """--drafter-weights: the drafter's weights whatever the target's (a drafter only proposes, so a
    float target may draft with int8 weights). The target is exported as without the flag, the drafter
    graph computes with MatMulNBits exactly when quantised, and speculation stays the target's output."""
    src = _eagle3_drafter(tmp_path)
    export(text_tied.src, tmp_path / "out", chunk=CHUNK, weights=weights, drafter=src, drafter_weights=drafter_weights)
    target = json.loads((tmp_path / "out" / "model.json").read_text())["weights"]
    drafter = json.loads((tmp_path / "out" / "drafter" / "drafter.json").read_text())["weights"]
    assert target["mode"] == (weights or "float")
    assert (drafter["quant"] or {}).get("bits") == bits
    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "drafter" / "drafter.onnx"), load_external_data=False).graph.node}
    assert ("MatMulNBits" in ops) == (bits is not None)
    _assert_rounds_give_the_plain_output(tmp_path / "out")


def test_int4_summary_counts_a_tied_embedding_once_and_names_its_fp16_storage(text_tied, tmp_path):
    """The closing table's parameter count is the model's (transformers counts a tied embedding once),
    though the int4 export stores the table (fp16) and an int8 lm_head copy of it; and it names each
    storage instead of calling everything but the linear layers --dtype."""
    from hybrid_npu.export.summary import summary_lines

    out = tmp_path / "int4"
    export(text_tied.src, out, chunk=CHUNK, weights="int4")
    manifest = json.loads((out / "model.json").read_text(encoding="utf-8"))
    line = next(x for x in summary_lines(out, manifest) if x.startswith("weights"))
    assert f" ({text_tied.ref.num_parameters():,} params, " in line
    assert "int4 linear layers, int8 lm_head (a copy of the tied embedding), fp16 embedding, fp32 rest" in line
