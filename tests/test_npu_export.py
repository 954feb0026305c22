"""NPU exports: parts, precompiled QNN context binaries, --check-npu, and real-size coverage, on
onnxruntime-qnn's x86_64 HTP emulator (CPU fallback disabled everywhere)."""
import json
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from conftest import CHUNK
from real_size import qwen35_text_config, write_graph

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.export.npu.check import compile_on_npu
from hybrid_npu.export.npu.parts import htp_itemsize, layer_weight_bytes, plan_parts
from hybrid_npu.export.step_graph import Kind, StepSpec
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime.npu_sessions import MASK_DIM, PAST_DIM
from hybrid_npu.runtime.pipeline import Pipeline
from hybrid_npu.runtime.state import State
from hybrid_npu.runtime.step_inputs import chain_feed

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")


def derived_profile(base_path, tmp_path, name, **values):
    text = open(base_path).read()
    for key, value in {"name": f'"{name}"', **values}.items():
        text = re.sub(rf"(?m)^{key}\s*=\s*\S+", f"{key} = {value}", text)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def split_export(text_tied, htp_profile, tmp_path_factory):
    """The tiny fixture cut into >= 3 NPU parts, with context binaries compiled on the emulator."""
    tmp = tmp_path_factory.mktemp("split")
    prof = derived_profile(htp_profile, tmp, "test-split", part_weight_bytes=100_000)
    out = tmp / "export"
    export(text_tied.src, out, chunk=CHUNK, profile=prof)
    return out, prof


def test_parts_give_the_same_outputs_as_unsplit(split_export):
    out, prof = split_export
    manifest = json.loads((out / "model.json").read_text())
    parts = manifest["npu"]["test-split"]["parts"]
    assert len(parts) >= 3
    layers = [p["layers"] for p in parts]
    # contiguous, a segment that resumes after an attention core starting at the layer the one before ended in
    assert layers[0][0] == 0 and all(a[1] == b[0] + q["after_attention"] for a, b, q in zip(layers, layers[1:], parts[1:]))
    engine = hybrid_npu.load_engine(out)  # CPU sessions of the whole graph, and the config
    import onnxruntime as ort
    split = Pipeline([ort.InferenceSession(str(out / p["file"]), providers=["CPUExecutionProvider"]) for p in parts],
                     "CPU")
    state = State.fresh(engine.config)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 300, CHUNK - 2)]
    feed = chain_feed(engine.config, state, ids, CHUNK)
    # the unsplit prefill graph itself (the engine's CPU session is the any-N graph, fused norms)
    whole = Pipeline([ort.InferenceSession(str(out / manifest["graphs"]["prefill"]["file"]),
                                           providers=["CPUExecutionProvider"])], "CPU").run(feed)
    got = split.run(feed)
    assert set(got) == set(whole)
    for name in whole:
        np.testing.assert_allclose(got[name], whole[name], atol=1e-5, err_msg=name)
    for p in parts:  # each part carries only its own layers' state
        names = {i["name"] for i in p["inputs"]}
        own = {int(n.split(".")[1]) for n in names if n.startswith(("conv_state.", "recurrent_state.", "past_key."))}
        assert own <= set(range(*p["layers"]))


def test_context_binaries_load_and_match_the_onnx_graphs(split_export, text_tied):
    out, prof = split_export
    manifest = json.loads((out / "model.json").read_text())
    ctx = manifest["npu"]["test-split"]["context"]
    assert ctx["soc_model"] == 60 and ctx["htp_arch"] == 73 and ctx["qnn_version"]
    assert all((out / f).exists() for f in ctx["files"]) and list((out / "ctx" / "test-split").glob("*.bin"))
    from_ctx = hybrid_npu.load_engine(out, profile=prof, prefill="npu")
    assert from_ctx.pipelines["npu_prefill"].from_context and len(from_ctx.pipelines["npu_prefill"].sessions) >= 3
    no_ctx = out.parent / "no_ctx"
    shutil.copytree(out, no_ctx, ignore=shutil.ignore_patterns("ctx"))
    m = json.loads((no_ctx / "model.json").read_text())
    m["npu"]["test-split"]["context"] = None
    (no_ctx / "model.json").write_text(json.dumps(m))
    compiled = hybrid_npu.load_engine(no_ctx, profile=prof, prefill="npu")
    assert not compiled.pipelines["npu_prefill"].from_context
    ids = list(range(7, 7 + 2 * CHUNK + 1))
    a, b = from_ctx.prefill_logits(ids), compiled.prefill_logits(ids)
    assert from_ctx.prefill_devices == "QNN/HTP"
    np.testing.assert_array_equal(a, b)
    cpu = hybrid_npu.load_engine(out).prefill_logits(ids)
    assert np.abs(a - cpu).max() < 0.05 * np.abs(cpu).max()  # fp16 HTP vs fp32 CPU


def _copy_export(out, dest):
    shutil.copytree(out, dest)
    return dest


def test_mismatched_context_is_rebuilt_with_a_message(split_export, tmp_path, capsys):
    out, prof = split_export
    other = _copy_export(out, tmp_path / "other")
    m = json.loads((other / "model.json").read_text())
    m["npu"]["test-split"]["context"]["htp_arch"] = 79
    (other / "model.json").write_text(json.dumps(m))
    engine = hybrid_npu.load_engine(other, profile=prof, prefill="npu")
    assert "built for htp_arch 79" in capsys.readouterr().err
    assert not engine.pipelines["npu_prefill"].from_context
    assert np.isfinite(engine.prefill_logits([1, 2, 3])).all()


def test_truncated_context_is_rebuilt_with_a_message(split_export, tmp_path, capsys):
    out, prof = split_export
    other = _copy_export(out, tmp_path / "trunc")
    binary = next((other / "ctx" / "test-split").glob("*.bin"))
    binary.write_bytes(binary.read_bytes()[: binary.stat().st_size // 3])
    engine = hybrid_npu.load_engine(other, profile=prof, prefill="npu")
    err = capsys.readouterr().err
    assert "context binary unusable" in err and "compiling from the ONNX graphs" in err
    assert np.isfinite(engine.prefill_logits([1, 2, 3])).all()


def test_context_with_flipped_bytes_is_rebuilt_not_trusted(split_export, tmp_path, capsys, monkeypatch):
    """The QNN binary might load and compute garbage: its recorded hash decides, before it is opened."""
    monkeypatch.setenv("HYBRID_NPU_CACHE", str(tmp_path / "cache"))
    out, prof = split_export
    other = _copy_export(out, tmp_path / "flipped")
    binary = next((other / "ctx" / "test-split").glob("*.bin"))
    data = bytearray(binary.read_bytes())
    data[len(data) // 2] ^= 0x01
    binary.write_bytes(bytes(data))
    engine = hybrid_npu.load_engine(other, profile=prof, prefill="npu")
    err = capsys.readouterr().err
    assert "differs from what the export recorded" in err and "compiling from the ONNX graphs" in err
    assert not engine.pipelines["npu_prefill"].from_context


def test_export_without_the_profiles_graphs_names_the_fix(text_tied, htp_profile, tmp_path):
    prof = derived_profile(htp_profile, tmp_path, "tiny-parts", part_weight_bytes=100_000)
    with pytest.raises(UserError, match=r"re-export with: export-hybrid SOURCE .* --profile tiny-parts"):
        hybrid_npu.load_engine(text_tied.out, profile=prof, prefill="npu")


def test_check_npu_cli_reports_every_graph_on_the_htp(split_export):
    out, prof = split_export
    exe = shutil.which("export-hybrid", path=sysconfig.get_path("scripts"))
    proc = subprocess.run([exe, "--check-npu", out, "--profile", prof], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    entry = json.loads((out / "model.json").read_text())["npu"]["test-split"]
    # the prefill's segments and the attention tile graphs (a tile, and BULK_TILES tiles a call)
    parts = entry["parts"] + [{"file": entry["tile"][k]} for k in ("file", "bulk_file")]
    assert len(lines) == len(parts)
    for line in lines:
        n, on = re.search(r"(\d+) nodes, (\d+) on HTP \(all on HTP\)", line).groups()
        assert n == on
    for k, p in enumerate(parts, 1):  # progress on stderr before and after each graph's compile
        assert f"compiling {p['file']} for test-split on the HTP" in proc.stderr
        assert f"({k}/{len(parts)})" in proc.stderr
        assert f"{Path(p['file']).name}: all on HTP" in proc.stderr


def test_check_npu_names_the_first_unsupported_node(tmp_path):
    """A graph the HTP refuses (Erf) is reported with the node and the EP's reason."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Sigmoid", ["x"], ["a"], name="sig"), helper.make_node("Erf", ["a"], ["y"], name="erf")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "erf.onnx")
    r = compile_on_npu(tmp_path / "erf.onnx", load_profile("snapdragon-x-elite").qnn_provider_options())
    assert not r["ok"] and r["on_htp"] == 1 and r["nodes"] == 2
    assert r["first_unsupported"]["op"] == "Erf" and r["first_unsupported"]["node"] == "erf"
    assert "not supported" in r["first_unsupported"]["reason"]


# ---------------------------------------------------------------- real size

REAL_GRAPHS = {  # one graph per distinct shape: all GDN layers share one, all attention layers another
    "gdn_layer": StepSpec(Kind.PREFILL, 128, first_layer=1, end_layer=2),
    "attention_layer": StepSpec(Kind.PREFILL, 128, first_layer=3, end_layer=4),
    "gdn_layer_verify": StepSpec(Kind.VERIFY, 64, first_layer=1, end_layer=2),
    "attention_layer_verify": StepSpec(Kind.VERIFY, 64, first_layer=3, end_layer=4),
    "embedding": StepSpec(Kind.PREFILL, 128, first_layer=0, end_layer=0),
    # the tiled prefill's segments around an attention core (the core itself: test below)
    "to_attention_core": StepSpec(Kind.PREFILL, 128, first_layer=1, end_layer=4, npu=True, to_attention=True),
    "after_attention_core": StepSpec(Kind.PREFILL, 128, first_layer=3, end_layer=5, npu=True, after_attention=True),
    "head": StepSpec(Kind.PREFILL, 128, first_layer=24, end_layer=24),
}


@pytest.mark.parametrize("name", list(REAL_GRAPHS))
def test_real_qwen35_08b_graphs_place_entirely_on_the_htp(name, tmp_path):
    """Real Qwen3.5-0.8B text config (random weights), the shipped X Elite profile's T_max, CPU
    fallback disabled, each compile in its own process. Finalization mode 1 for CI time (placement
    does not depend on it; docs/htp-traps.md)."""
    cfg = qwen35_text_config("0.8B")
    prof = load_profile("snapdragon-x-elite")
    path = write_graph(cfg, REAL_GRAPHS[name], tmp_path, name)
    opts = {**prof.qnn_provider_options(), "htp_graph_finalization_optimization_mode": "1"}
    t = prof.attention_capacity
    r = compile_on_npu(path, opts, {PAST_DIM: t, MASK_DIM: t + REAL_GRAPHS[name].n})
    print(f"\n{name}: {r['nodes']} nodes, {r['on_htp']} on HTP, compile {r.get('compile_s')} s")
    assert r["ok"], r
    assert r["on_htp"] == r["nodes"]


@pytest.mark.parametrize("tiles", [1, 8])
def test_real_qwen35_08b_attention_tile_places_entirely_on_the_htp(tiles, tmp_path):
    """The shipped X Elite profile's tile (2,048 rows) and its bulk form (BULK_TILES = 8 tiles a call) at
    the 0.8B's attention shapes (128 queries, 2 KV heads of 4 query heads, hd 256): every node on the HTP."""
    import onnx

    from hybrid_npu.kernels.attention_tile import BULK_TILES, emit_attention_tile
    from hybrid_npu.kernels.graph import GraphBuilder

    assert tiles in (1, BULK_TILES)
    cfg = qwen35_text_config("0.8B")
    prof = load_profile("snapdragon-x-elite")
    g = GraphBuilder("tile")
    emit_attention_tile(g, n=prof.prefill_chunk, group=cfg.num_attention_heads // cfg.num_key_value_heads,
                        nkv=cfg.num_key_value_heads, hd=cfg.head_dim, tile=tiles * prof.attention_tile)
    onnx.save(g.model(), tmp_path / "tile.onnx")
    r = compile_on_npu(tmp_path / "tile.onnx", {**prof.qnn_provider_options(),
                                                "htp_graph_finalization_optimization_mode": "1"})
    print(f"\nattention tile ({tiles * prof.attention_tile} rows): {r['nodes']} nodes, {r['on_htp']} on HTP, "
          f"compile {r.get('compile_s')} s")
    assert r["ok"], r
    assert r["on_htp"] == r["nodes"]


def test_real_qwen35_4b_splits_into_parts_under_the_profile_ceiling():
    cfg = qwen35_text_config("4B")
    prof = load_profile("snapdragon-x-elite")
    parts = plan_parts(cfg, prof.part_weight_bytes, htp_itemsize(prof))
    embed, per_layer, head = layer_weight_bytes(cfg, htp_itemsize(prof))
    assert parts[0][0] == 0 and parts[-1][1] == cfg.num_layers
    for a, b in parts:
        size = sum(per_layer[a:b]) + (embed if a == 0 and b > 0 else 0) + (head if b == cfg.num_layers and
                                                                           (a, b) == parts[-1] else 0)
        assert size <= prof.part_weight_bytes, (a, b, size)
    print(f"\nQwen3.5-4B at {prof.part_weight_bytes / 1e9} GB per part (fp16 on the HTP): {len(parts)} parts {parts}")
    assert len(parts) >= 5  # ~8.4 GB of fp16 text weights (embedding twice, tied head) in 1.5 GB parts
