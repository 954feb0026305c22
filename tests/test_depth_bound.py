"""scripts/bench/depth_bound.py: the bytes it counts must be the ones a decode step really touches.

The weights against the graph's own initializers loaded with their data (the embedding, which only
a Gather reads, apart), the state against the engine's own arrays, the K/V against the engine's
buffers once a context of that length is filled; the bounds against their definitions.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CHUNK
from onnx import numpy_helper

import hybrid_npu
from hybrid_npu.export.exporter import export

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "bench"
import depth_bound  # noqa: E402
from bench_context import fill_context  # noqa: E402


@pytest.fixture(scope="module")
def int4_export(text_tied, tmp_path_factory):
    out = tmp_path_factory.mktemp("depth_bound") / "int4"
    export(text_tied.src, out, chunk=CHUNK, weights="int4", block_size=16)
    return out


def test_bytes_are_what_a_step_touches(int4_export):
    context = 300
    b = depth_bound.step_bytes(int4_export, context)
    graph = onnx.load(str(int4_export / "graphs" / "decode.onnx"))  # with weights.bin
    gathered = {n.input[0] for n in graph.graph.node if n.op_type == "Gather"}
    other = {i for n in graph.graph.node if n.op_type != "Gather" for i in n.input}
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in graph.graph.initializer}
    assert b["embedding_gathered"] == sum(v for k, v in sizes.items() if k in gathered - other) > 0
    assert b["weights_read"] == sum(v for k, v in sizes.items() if k not in gathered - other) > 0

    engine = hybrid_npu.load_engine(int4_export)
    fill_context(engine, context, np.random.default_rng(0))
    engine.decode(1)  # a step at this context: its buffers are the ones the graph reads
    state = engine.state
    assert b["state_read_and_written"] == 2 * sum(g.recurrent.nbytes + g.conv.nbytes for g in state.gdn.values())
    assert b["kv_at_context"] == sum(a.key.nbytes + a.value.nbytes for a in state.attention.values())
    assert b["kv_capacity_rows"] == state.capacity >= context + 1
    engine.reset()
    engine.decode(1)
    assert b["kv_at_0"] == sum(a.key.nbytes + a.value.nbytes for a in engine.state.attention.values())


def test_bounds_follow_their_definitions():
    b = {"weights_read": 400, "state_read_and_written": 40, "kv_at_0": 10, "kv_at_context": 210, "kv_itemsize": 4}
    got = depth_bound.bound(b, 0.85)
    assert got["depth_ratio_bound"] == round(450 / 650, 4)
    allowed = 450 / 0.85 - 440  # K/V bytes at the context that keep exactly the goal, by bytes
    assert got["kv_bytes_allowed"] == int(allowed)
    assert got["kv_bits_allowed"] == pytest.approx(32 * allowed / 210, abs=0.01)

    b = dict(b, weights_read=400e6, state_read_and_written=40e6, kv_at_0=10e6, kv_at_context=210e6)
    m = depth_bound.measured_bound(b, 20.0, 0.85, [40.0, 30.0])  # 25 ms at 0; 200 MB more at 20 GB/s: 10 ms
    assert m["step_at_0_ms"] == 25.0 and m["measured_depth_ratio"] == 0.75
    assert m["kv_added_read_ms_at_rate"] == 10.0
    assert m["depth_ratio_bound_at_read_rate"] == round(25 / 35, 4)
    assert m["kv_read_ms_allowed"] == round(25 * (1 / 0.85 - 1), 2)
    # the allowed read time at 20 GB/s holds this many bits an element (the context-0 rows included)
    bits = 32 * (m["kv_read_ms_allowed"] * 1e-3 * 20e9 + 10e6) / 210e6
    assert m["kv_bits_allowed_at_read_rate"] == pytest.approx(bits, abs=0.01)


def test_cli_prints_json_and_refuses_bad_input(int4_export, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPTS / "depth_bound.py"), *a],  # noqa: E731
                                    capture_output=True, text=True)
    p = run(str(int4_export), "--context", "512", "--no-measure")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["bytes_at_context"] > out["bytes_at_0"] and 0 < out["depth_ratio_bound"] < 1
    assert "read_rate" not in out
    for bad in ([str(tmp_path)], [str(int4_export), "--goal", "1.5"], [str(int4_export), "--context", "0"]):
        p = run(*bad, "--no-measure")
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
