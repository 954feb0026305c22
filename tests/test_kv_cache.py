"""The K/V cache's dtype (export-hybrid --kv-cache; docs/kv-cache.md): the tiled attention kernel
against numpy and torch, fp16 and int8 caches against the fp32 cache and transformers, the memory
plan's per-token charge against the bytes the cache holds, and snapshots across cache dtypes."""
import json

import numpy as np
import pytest
import torch
from conftest import CHUNK
from onnx_helpers import run_graph
from transformers.models.qwen3_5 import modeling_qwen3_5 as M5

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.format import MANIFEST, manifest_hash
from hybrid_npu.kernels import attention
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.runtime.snapshot import save_state
from hybrid_npu.runtime.state import quantize_rows


def torch_attention(q, keys, values, mask, nh, nkv):
    """transformers' GQA (repeat_kv) through torch's attention: q [N, nH, hd], keys/values [nKV, T, hd]."""
    kt = M5.repeat_kv(torch.from_numpy(keys)[None], nh // nkv)
    vt = M5.repeat_kv(torch.from_numpy(values)[None], nh // nkv)
    return torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1)[None], kt, vt, attn_mask=torch.from_numpy(mask))[0].transpose(0, 1).numpy()


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("n,past,tile", [(1, 37, 8), (5, 37, 8), (attention.VALUE_ROWS_MAX_N + 3, 20, 16),
                                         (3, 0, 8), (None, 19, 4)])  # None: the graph built for any count
def test_tiled_attention_numpy_vs_torch_vs_onnx(cache, n, past, tile):
    r = np.random.default_rng(7)
    rows = 4 if n is None else n
    nh, nkv, hd = 6, 2, 8
    q = r.standard_normal((rows, nh, hd)).astype(np.float32)
    new_k, new_v = (r.standard_normal((nkv, rows, hd)).astype(np.float32) for _ in range(2))
    past_k32, past_v32 = (r.standard_normal((nkv, past, hd)).astype(np.float32) for _ in range(2))
    k_scale = v_scale = None
    if cache == "int8":
        (past_k, ks), (past_v, vs) = quantize_rows(past_k32, -1), quantize_rows(past_v32, -1)
        k_scale, v_scale = ks.transpose(0, 2, 1).copy(), vs.transpose(0, 2, 1).copy()  # [nKV, 1, P]
        seen_k, seen_v = past_k * ks, past_v * vs  # what the cache holds, widened
    else:
        dtype = np.float16 if cache == "fp16" else np.float32
        past_k, past_v = past_k32.astype(dtype), past_v32.astype(dtype)
        seen_k, seen_v = past_k.astype(np.float32), past_v.astype(np.float32)
    mask = np.zeros((rows, past + rows), np.float32)
    mask[:, past // 2: past] = attention.MASKED  # some past rows hidden: a tile can be all hidden
    mask[:, past:] = np.where(np.tril(np.ones((rows, rows))) > 0, 0, attention.MASKED)
    want = torch_attention(q, np.concatenate([seen_k, new_k], 1), np.concatenate([seen_v, new_v], 1), mask, nh, nkv)
    past_v_t = past_v.transpose(0, 2, 1).copy()
    ref = attention.tiled_gqa_attention_ref(q, past_k, past_v_t, new_k, new_v, mask, tile, k_scale, v_scale)
    np.testing.assert_allclose(ref, want, atol=1e-5)
    g = GraphBuilder("tiled")
    dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[cache]
    dim = "n" if n is None else n
    qi = g.input("q", np.float32, [dim, nh, hd])
    pk, pv = g.input("pk", dtype, [nkv, "P", hd]), g.input("pv", dtype, [nkv, hd, "P"])
    nk, nv = g.input("nk", np.float32, [nkv, dim, hd]), g.input("nv", np.float32, [nkv, dim, hd])
    mi = g.input("m", np.float32, [dim, "T"])
    feed = {"q": q, "pk": past_k, "pv": past_v_t, "nk": new_k, "nv": new_v, "m": mask}
    scales = (None, None)
    if cache == "int8":
        scales = (g.input("ks", np.float32, [nkv, 1, "P"]), g.input("vs", np.float32, [nkv, 1, "P"]))
        feed.update(ks=k_scale, vs=v_scale)
    g.output(attention.emit_tiled_gqa_attention(g, qi, pk, pv, nk, nv, mi, n=n, nh=nh, nkv=nkv, hd=hd, tile=tile,
                                                widen=cache != "fp32", k_scale=scales[0], v_scale=scales[1]),
             "o", np.float32, [dim, nh, hd])
    (o,) = run_graph(g, feed)
    np.testing.assert_allclose(o, ref, atol=1e-6)
    np.testing.assert_allclose(o, want, atol=1e-5)


@pytest.mark.parametrize("cache", ["fp16", "int8"])
@pytest.mark.parametrize("n,past", [(1, 12), (1, 13), (1, 40), (4, 40), (None, 25), (None, 8)])
def test_few_rows_attention_either_branch_against_torch(cache, n, past):
    """emit_few_rows_attention with widen_rows 12: a past of up to 12 rows is widened whole, a longer one
    read in tiles of 12 (the last one partial); both against torch over the rows the cache holds."""
    r = np.random.default_rng(past)
    rows, nh, nkv, hd = (3 if n is None else n), 4, 2, 8
    q = r.standard_normal((rows, nh, hd)).astype(np.float32)
    new_k, new_v = (r.standard_normal((nkv, rows, hd)).astype(np.float32) for _ in range(2))
    past_k32, past_v32 = (r.standard_normal((nkv, past, hd)).astype(np.float32) * 3 for _ in range(2))
    if cache == "int8":
        (past_k, ks), (past_v, vs) = quantize_rows(past_k32, -1), quantize_rows(past_v32, -1)
        seen_k, seen_v = past_k * ks, past_v * vs
        k_scale, v_scale = ks.transpose(0, 2, 1).copy(), vs.transpose(0, 2, 1).copy()
    else:
        past_k, past_v = past_k32.astype(np.float16), past_v32.astype(np.float16)
        seen_k, seen_v = past_k.astype(np.float32), past_v.astype(np.float32)
    mask = np.zeros((rows, past + rows), np.float32)
    mask[:, 1:past:3] = attention.MASKED
    mask[:, past:] = np.where(np.tril(np.ones((rows, rows))) > 0, 0, attention.MASKED)
    want = torch_attention(q, np.concatenate([seen_k, new_k], 1), np.concatenate([seen_v, new_v], 1), mask, nh, nkv)
    g = GraphBuilder("few")
    dtype = np.int8 if cache == "int8" else np.float16
    dim = "n" if n is None else n
    qi = g.input("q", np.float32, [dim, nh, hd])
    pk, pv = g.input("pk", dtype, [nkv, "P", hd]), g.input("pv", dtype, [nkv, hd, "P"])
    nk, nv = g.input("nk", np.float32, [nkv, dim, hd]), g.input("nv", np.float32, [nkv, dim, hd])
    mi = g.input("m", np.float32, [dim, "T"])
    feed = {"q": q, "pk": past_k, "pv": past_v.transpose(0, 2, 1).copy(), "nk": new_k, "nv": new_v, "m": mask}
    scales = (None, None)
    if cache == "int8":
        scales = (g.input("ks", np.float32, [nkv, 1, "P"]), g.input("vs", np.float32, [nkv, 1, "P"]))
        feed.update(ks=k_scale, vs=v_scale)
    g.output(attention.emit_few_rows_attention(g, qi, pk, pv, nk, nv, mi, n=n, nh=nh, nkv=nkv, hd=hd, widen_rows=12,
                                               k_scale=scales[0], v_scale=scales[1]), "o", np.float32, [dim, nh, hd])
    (o,) = run_graph(g, feed)
    np.testing.assert_allclose(o, want, atol=1e-5)


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
def test_new_rows_enter_attention_as_the_cache_gives_them_back(cache):
    """kernels/attention.emit_as_cached equals its numpy reference and what the State returns for rows
    written into a cache of that dtype (runtime/state.py: the rows a later call reads)."""
    from hybrid_npu.runtime.state import AttentionLayerState

    r = np.random.default_rng(11)
    nkv, n, hd = 2, 9, 16
    rows = [r.standard_normal((nkv, n, hd)).astype(np.float32) * s for s in (1.0, 300.0)]
    rows[0][1, 4] = 0.0  # an all-zero row
    for x in rows:
        dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[cache]
        layer = AttentionLayerState(np.zeros((nkv, n, hd), dtype), np.zeros((nkv, hd, n), dtype),
                                    *((np.zeros((nkv, 1, n), np.float32),) * 2 if cache == "int8" else ()))
        layer.write(0, x, x)
        keys = layer.key.astype(np.float32) * (layer.key_scale.transpose(0, 2, 1) if cache == "int8" else 1)
        g = GraphBuilder("as_cached")
        xi = g.input("x", np.float32, [nkv, n, hd])
        g.output(attention.emit_as_cached(g, xi, cache), "o", np.float32, [nkv, n, hd])
        (o,) = run_graph(g, {"x": x})
        ref = attention.as_cached_ref(x, cache)
        np.testing.assert_array_equal(o, ref)
        np.testing.assert_array_equal(ref, keys)


def test_int8_rows_are_within_half_a_scale():
    x = np.random.default_rng(3).standard_normal((2, 50, 16)).astype(np.float32) * 7
    x[0, 3] = 0.0  # an all-zero row stays zero
    q, s = quantize_rows(x, -1)
    assert q.dtype == np.int8 and s.shape == (2, 50, 1)
    assert np.all(np.abs(q.astype(np.float32) * s - x) <= s / 2 * (1 + 1e-6))
    assert np.all(np.abs(q).max(-1)[x.any(-1)] == 127) and not q[0, 3].any()


@pytest.fixture(scope="module")
def caches(text_tied, tmp_path_factory):
    """The fixture checkpoint exported once per cache dtype (fp32: the session fixture's export)."""
    root = tmp_path_factory.mktemp("kv_caches")
    out = {"fp32": text_tied.out}
    for kv in ("fp16", "int8"):
        export(text_tied.src, root / kv, chunk=CHUNK, kv_cache=kv)
        out[kv] = root / kv
    return out


def greedy(engine, token: int, n: int) -> list[int]:
    """n greedy tokens decoded after feeding `token` to the engine's context."""
    out = []
    for _ in range(n):
        token = int(np.argmax(engine.decode(token)))
        out.append(token)
    return out


def prompt(n, seed=0, vocab=300):
    return [int(t) for t in np.random.default_rng(seed + n).integers(0, vocab, n)]


# the logits' max abs error against transformers, as a fraction of max|logits|: fp32 is held to 1e-4
# (tests/test_export_parity.py); an fp16 row is off by <= 2^-11 of itself, an int8 row by half its scale
# (1/254 of its largest element), and these fixtures' 4 layers carry that to the logits
BOUND = {"fp32": 1e-4, "fp16": 2e-3, "int8": 2e-2}


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_cache_logits_and_greedy_against_fp32_and_transformers(text_tied, caches, kv):
    engine, fp32 = hybrid_npu.load_engine(caches[kv]), hybrid_npu.load_engine(caches["fp32"])
    assert json.loads((caches[kv] / MANIFEST).read_text())["kv_cache"] == kv == engine.kv_cache
    assert next(iter(engine.state.attention.values())).key.dtype == {"fp16": np.float16, "int8": np.int8}[kv]
    for n in (1, CHUNK, 3 * CHUNK + 7, 10 * CHUNK):  # up to 80 rows: past tiles of the CPU graphs' attention
        ids = prompt(n)
        with torch.no_grad():
            want = text_tied.ref(torch.tensor([ids])).logits[0, -1].numpy()
        got, base = engine.prefill_logits(ids), fp32.prefill_logits(ids)
        scale = np.abs(want).max()
        assert scale > 1.0  # the reference is not flat: the comparison can fail
        assert np.abs(base - want).max() <= BOUND["fp32"] * scale
        assert np.abs(got - want).max() <= BOUND[kv] * scale, (n, np.abs(got - want).max() / scale)
        assert np.abs(got - base).max() <= BOUND[kv] * scale
    ids = prompt(CHUNK + 3, seed=7)
    with torch.no_grad():
        hf = text_tied.ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(hf)) > 3
    assert engine.generate(ids, 24, stop_at_eos=False) == hf == fp32.generate(ids, 24, stop_at_eos=False)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "int8"])
def test_plan_charges_a_token_exactly_what_the_cache_holds(caches, kv):
    """The plan's per-token charge, the manifest's, and the bytes the State's arrays grow by per token."""
    engine = hybrid_npu.load_engine(caches[kv])
    manifest = json.loads((caches[kv] / MANIFEST).read_text())
    per_token = engine.memory.kv_bytes_per_token
    assert manifest["state"]["kv_bytes_per_token"] == per_token
    engine.prefill(prompt(2 * CHUNK + 5))
    arrays = [a for layer in engine.state.attention.values() for a in (layer.key, layer.value, layer.key_scale,
                                                                      layer.value_scale) if a is not None]
    capacity = engine.state.capacity
    assert sum(a.nbytes for a in arrays) == capacity * per_token  # every byte the arrays hold, per row
    assert engine.state.kv_bytes_in_use() == engine.state.position * per_token
    cfg = engine.config
    elem = {"fp32": 4, "fp16": 2, "int8": 1}[kv]
    assert per_token == len(cfg.full_layers) * 2 * cfg.num_key_value_heads * (cfg.head_dim * elem + 4 * (kv == "int8"))


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_an_fp32_snapshot_loads_into_a_narrower_cache(caches, kv, tmp_path):
    """A snapshot of an fp32 cache (the State and save path every snapshot before the option used),
    saved for this export, loads into its fp16 / int8 cache and continues as a fresh prefill does."""
    ids = prompt(2 * CHUNK + 3, seed=11)
    fp32 = hybrid_npu.load_engine(caches["fp32"])
    fp32.prefill(ids)
    assert fp32.state.attention[next(iter(fp32.state.attention))].key.dtype == np.float32
    path = tmp_path / "fp32.safetensors"
    save_state(fp32.state, path, manifest_hash(caches[kv]))
    from safetensors.numpy import load_file
    assert all(t.dtype == np.float32 for name, t in load_file(path).items() if name.startswith("attention."))
    resumed = hybrid_npu.load_engine(caches[kv])
    resumed.load_state(path)
    assert resumed.state.position == len(ids) and resumed.state.tokens == ids
    fresh = hybrid_npu.load_engine(caches[kv])
    fresh.prefill(ids)
    for i, layer in resumed.state.attention.items():  # the rows a fresh run of this cache would hold
        a, b = layer.rows(len(ids)), fresh.state.attention[i].rows(len(ids))
        widened = [x.astype(np.float32) * (1 if s is None else s[..., None]) for x, s in ((a[0], a[2]), (a[1], a[3]))]
        fresh_w = [x.astype(np.float32) * (1 if s is None else s[..., None]) for x, s in ((b[0], b[2]), (b[1], b[3]))]
        # a fresh int8 prefill attends to its own rows rounded to 8 bits (emit_as_cached), so its
        # later layers' rows carry that rounding beside the fp32 run's: twice fp16's bound
        for x, y in zip(widened, fresh_w):
            np.testing.assert_allclose(x, y, atol=(2e-2 if kv == "fp16" else 4e-2) * np.abs(y).max())
    assert greedy(resumed, 7, 12) == greedy(fresh, 7, 12)


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_a_snapshot_round_trips_in_its_own_dtype(caches, kv, tmp_path):
    engine = hybrid_npu.load_engine(caches[kv])
    engine.prefill(prompt(CHUNK + 5, seed=2))
    engine.save_state(tmp_path / "s.safetensors")
    other = hybrid_npu.load_engine(caches[kv])
    other.load_state(tmp_path / "s.safetensors")
    for i, layer in engine.state.attention.items():
        for a, b in zip(layer.rows(engine.state.position), other.state.attention[i].rows(engine.state.position)):
            if a is not None:
                assert a.dtype == b.dtype and np.array_equal(a, b)  # exactly what the cache held
    assert greedy(other, 5, 8) == greedy(engine, 5, 8)


def test_an_int8_cache_with_an_npu_profile_is_refused(text_tied, tmp_path, htp_profile):
    with pytest.raises(UserError, match="--kv-cache int8 is for the CPU.*--kv-cache fp16"):
        export(text_tied.src, tmp_path / "x", chunk=CHUNK, kv_cache="int8", profile=htp_profile)


def test_an_unknown_cache_dtype_is_refused(text_tied, tmp_path):
    with pytest.raises(UserError, match="--kv-cache 'bf16' is not supported; choose one of fp32, fp16, int8"):
        export(text_tied.src, tmp_path / "x", chunk=CHUNK, kv_cache="bf16")


def test_an_fp16_cache_feeds_the_npu_parts(caches, htp_profile):
    """The NPU parts read fp32 past K/V; an fp16 cache's rows are widened for them per call
    (runtime/pipeline.py): the HTP prefill then CPU decode gives the CPU-only fp16 engine's tokens."""
    pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")
    npu = hybrid_npu.load_engine(caches["fp16"], profile=htp_profile, prefill="npu")
    cpu = hybrid_npu.load_engine(caches["fp16"])
    ids = prompt(4 * CHUNK, seed=5)
    want = cpu.generate(ids, 8, stop_at_eos=False)
    assert npu.generate(ids, 8, stop_at_eos=False) == want
    assert npu.last_stats["prefill_device"] == "QNN/HTP"
    assert next(iter(npu.state.attention.values())).key.dtype == np.float16
