"""The tile kernel (kernels/attention_tile.py): its numpy reference merged over tiles equals full
attention (torch's scaled_dot_product_attention), and its ONNX graph equals the reference, on
the CPU and on onnxruntime-qnn's HTP emulator with CPU fallback off (fp16)."""
import math

import numpy as np
import pytest
import torch
from onnx_helpers import run_graph
from transformers.models.qwen3_5 import modeling_qwen3_5 as M5

from hybrid_npu.kernels import attention_tile as at
from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.kernels.graph import GraphBuilder

NKV, G, N, HD = 2, 3, 5, 16


def case(t: int, pos: int, seed: int = 0, v_peak: float = 1.0):
    """Queries of a chunk of N rows at positions pos.. against a context of t >= pos + N rows."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((NKV, G * N, HD)).astype(np.float32)
    keys = r.standard_normal((NKV, t, HD)).astype(np.float32)
    values = r.standard_normal((NKV, t, HD)).astype(np.float32) * v_peak
    mask = np.where(np.arange(t)[None] <= pos + np.arange(N)[:, None], 0.0, MASKED).astype(np.float32)
    return q, keys, values, mask


def torch_attention(q, keys, values, mask):
    qh = torch.from_numpy(q).reshape(NKV * G, N, HD)[None]  # query head h = k·G + j reads KV head k
    k = M5.repeat_kv(torch.from_numpy(keys)[None], G)
    v = M5.repeat_kv(torch.from_numpy(values)[None], G)
    out = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=torch.from_numpy(mask))
    return out[0].reshape(NKV, G * N, HD).numpy()


def tile_graph(tile: int):
    g = GraphBuilder("tile")
    at.emit_attention_tile(g, n=N, group=G, nkv=NKV, hd=HD, tile=tile)
    return g


@pytest.mark.parametrize("t,pos,tile", [(37, 32, 8), (64, 59, 8), (9, 4, 16), (200, 195, 16)])
def test_tiled_reference_is_full_attention(t, pos, tile):
    q, keys, values, mask = case(t, pos)
    want = torch_attention(q, keys, values, mask)
    got = at.tiled_attention_ref(q, keys, values.transpose(0, 2, 1), mask, tile)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_tile_graph_is_the_reference_on_the_cpu():
    q, keys, values, mask = case(40, 35, seed=1)
    tile = 16
    feed = {"tile_q": q, "tile_key": keys[:, 16:32].copy(), "tile_value": values[:, 16:32].transpose(0, 2, 1).copy(),
            "tile_mask": mask[:, 16:32].copy()}
    got = run_graph(tile_graph(tile), feed)
    want = at.tile_step_ref(q, feed["tile_key"], feed["tile_value"], feed["tile_mask"])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tile_graph_on_the_htp_merges_to_full_attention(tmp_path, htp_profile):
    """>= 8 tiles, values up to 20,000 (massive activations reach V): fp16 on the HTP, merged on the host
    in fp32, within fp16's relative tolerance of float64 attention."""
    pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")
    from hybrid_npu.profiles.loader import load_profile
    from hybrid_npu.runtime.qnn import qnn_session, qnn_session_options

    tile, t = 16, 8 * 16 + 3
    pos = t - N
    q, keys, values, mask = case(t, pos, seed=2, v_peak=1.0)
    values[:, ::7, 3] = 20000.0  # a massive channel in some rows
    path = tmp_path / "tile.onnx"
    import onnx
    onnx.save(tile_graph(tile).model(), path)
    so = qnn_session_options(load_profile(htp_profile).qnn_provider_options())
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    sess = qnn_session(str(path), so)
    pad = -t % tile
    kp = np.pad(keys, ((0, 0), (0, pad), (0, 0)))
    vp = np.pad(values, ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1)
    mp = np.pad(mask, ((0, 0), (0, pad)), constant_values=MASKED)
    acc, calls = None, 0
    for s in range(0, t + pad, tile):
        step = sess.run(None, {"tile_q": q, "tile_key": np.ascontiguousarray(kp[:, s:s + tile]),
                               "tile_value": np.ascontiguousarray(vp[:, :, s:s + tile]),
                               "tile_mask": np.ascontiguousarray(mp[:, s:s + tile])})
        calls += 1
        acc = step if acc is None else at.merge_ref(acc, step)
    assert calls >= 8
    want = torch_attention(q.astype(np.float64), keys.astype(np.float64), values.astype(np.float64), mask.astype(np.float64))
    rel = float(np.abs(acc[2] - want).max() / np.abs(want).max())
    print(f"\nHTP tiles ({calls} calls of {tile} rows): rel max error {rel:.2e}")
    assert rel < 5e-3 and math.isfinite(rel)


@pytest.mark.parametrize("pos", [0, 5, 16, 37, 70])
@pytest.mark.parametrize("cache", [np.float32, np.float16])
def test_host_tiles_from_the_state_are_full_attention(pos, cache):
    """runtime/npu_attention.TileAttention (the tile graphs on the CPU here): bulk calls of 32 rows over the
    context before the chunk, then tiles of 8: the State's rows, the chunk's own new rows, a short last
    tile; an fp16 cache read as it lies."""
    import onnxruntime as ort
    from hybrid_npu.runtime.npu_attention import POSITION, TileAttention

    tile, bulk, cap = 8, 32, pos + 11  # the State holds more rows than are in use
    q, keys, values, mask = case(pos + N, pos, seed=pos)
    keys, values = keys.astype(cache).astype(np.float32), values.astype(cache).astype(np.float32)
    past_k = np.zeros((NKV, cap, HD), cache)
    past_vt = np.zeros((NKV, HD, cap), cache)
    past_k[:, :pos], past_vt[:, :, :pos] = keys[:, :pos], values[:, :pos].transpose(0, 2, 1)
    sess, bulk_sess = (ort.InferenceSession(tile_graph(rows).model().SerializeToString(),
                                            providers=["CPUExecutionProvider"]) for rows in (tile, bulk))
    result = {"attn_q.3": q, "new_key.3": keys[:, pos:], "new_value.3": values[:, pos:]}
    feed = {"past_key.3": past_k, "past_value.3": past_vt, POSITION: pos}
    runner = TileAttention(sess, tile, N, (bulk_sess, bulk))
    got = runner(3, result, feed)
    whole = pos // bulk
    assert runner.calls == runner.tiles(pos) == whole + -(-(pos + N - whole * bulk) // tile)
    assert "attn_q.3" not in result
    np.testing.assert_allclose(got, torch_attention(q, keys, values, mask), atol=2e-5)
