"""Grouped-query attention with an additive mask (docs/qwen35-model.md, gated attention).

q [N, nH, hd] (normed, rotated); keys/values [nKV, T, hd] = past rows then the N new rows (the graph
takes the past values transposed, [nKV, hd, T]: emit_gqa_attention); mask
[N, T] additive (0 = visible, MASKED = hidden): the host builds it (causal, padding, tree
ancestors). Query head h uses KV head h // (nH/nKV) (transformers' repeat_kv).
Explicit MatMul/Softmax: the ONNX Attention op with past inputs misbehaves on the HTP
(docs/htp-traps.md) and the explicit form compiles faster.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from .graph import GraphBuilder

MASKED = -30000.0  # finite: exact 0 after softmax in fp32 and still representable in fp16


def gqa_attention_ref(q, keys, values, mask):
    n, nh, hd = q.shape
    group = nh // keys.shape[0]
    k = np.repeat(keys, group, axis=0)  # [nH, T, hd]
    v = np.repeat(values, group, axis=0)
    scores = np.einsum("nhd,htd->hnt", q, k) / math.sqrt(hd) + mask[None]
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("hnt,htd->nhd", p, v)


# Up to this many new tokens the values are read as the product's rows (below); measured with the past
# values of 6 layers at 8k tokens, 2 threads (docs/performance.md): 1 / 2 / 4 / 8 / 16 tokens 8.1 / 9.0 /
# 11.1 / 15.8 / 23.0 ms as P·V against 5.4 / 5.4 / 5.4 / 8.9 / 17.4 ms as (Vᵀ·Pᵀ)ᵀ; a chunk of 128
# 147 ms as P·V, 140 ms as P·(Vᵀ)ᵀ (MLAS's transposed-B GEMM), 153 ms as (Vᵀ·Pᵀ)ᵀ.
VALUE_ROWS_MAX_N = 16


def emit_gqa_attention(g: GraphBuilder, q: str, past_keys: str, past_values_t: str, new_keys: str, new_values: str,
                       mask: str, *, n: int, nh: int, nkv: int, hd: int) -> str:
    """Returns [N, nH, hd]. Keys arrive as the past buffer [nKV, T, hd], values transposed as
    [nKV, hd, T] (the State's layout, runtime/state.py; T dynamic on the CPU, static on the NPU), and
    the N new rows of each [nKV, N, hd]; they are never concatenated, so no call copies the whole
    past: scores against each are joined instead, and the probabilities split back at the constant
    offset -N (a constant Slice, NPU-safe).

    Why values transposed: a decode step's P·V has 4 rows (the query heads of a KV head) against
    T×hd values, and MLAS repacks the whole value operand of such a GEMM on every call; as
    Vᵀ·Pᵀ the values are the product's rows, read once as they lie."""
    group = nh // nkv
    any_n = n is None  # any count up to VALUE_ROWS_MAX_N (the CPU verify's small trees): shapes from the call
    qh = g.reshape(g.transpose(q, [1, 0, 2]), [nkv, -1 if any_n else group * n, hd])  # heads of one KV group together
    qh = g.op("Mul", qh, g.const(1.0 / math.sqrt(hd)))
    scores = g.op("Concat", g.matmul(qh, g.transpose(past_keys, [0, 2, 1])),
                  g.matmul(qh, g.transpose(new_keys, [0, 2, 1])), axis=-1)
    if any_n:
        by_head = g.op("Concat", g.ints([nkv, group, -1]), g.op("Shape", scores, start=2, end=3), axis=0)
        scores, flat = g.op("Add", g.op("Reshape", scores, by_head), mask), g.op("Shape", scores)
        probs = g.op("Reshape", g.op("Softmax", scores, axis=-1), flat)
        split = g.op("Shape", past_keys, start=1, end=2)  # the new rows' probabilities start after the past's
    else:
        scores = g.op("Add", g.reshape(scores, [nkv, group, n, -1]), mask)
        probs = g.reshape(g.op("Softmax", scores, axis=-1), [nkv, group * n, -1])
        split = g.ints([-n])
    big = np.iinfo(np.int64).max
    p_past = g.op("Slice", probs, g.ints([0]), split, g.ints([2]))
    p_new = g.op("Slice", probs, split, g.ints([big]), g.ints([2]))
    if any_n or n <= VALUE_ROWS_MAX_N:
        from_past = g.transpose(g.matmul(past_values_t, g.transpose(p_past, [0, 2, 1])), [0, 2, 1])
    else:
        from_past = g.matmul(p_past, g.transpose(past_values_t, [0, 2, 1]))
    out = g.op("Add", from_past, g.matmul(p_new, new_values))
    return g.transpose(g.reshape(out, [nh, -1 if any_n else n, hd]), [1, 0, 2])


def emit_dynamic_gqa(g: GraphBuilder, q: str, past_k: str, past_v: str, new_k: str, new_v: str, mask: str,
                     *, nh: int, nkv: int, hd: int) -> str:
    """kernels/attention.emit_gqa_attention with N dynamic (it slices at the constant -N): q [N, nH, hd],
    past [nKV, P, hd], new [nKV, N, hd], mask [N, P+N] -> [N, nH·hd]. Past and new are never concatenated;
    the probabilities split back at P = Shape(past_k)[1]."""
    group = nh // nkv
    qh = g.reshape(g.transpose(q, [1, 0, 2]), [nkv, group, -1, hd])          # [nKV, g, N, hd]
    qh = g.op("Mul", qh, g.const(1.0 / math.sqrt(hd)))
    pk, nk = g.unsqueeze(past_k, [1]), g.unsqueeze(new_k, [1])              # [nKV, 1, T, hd]
    scores = g.op("Concat", g.matmul(qh, g.transpose(pk, [0, 1, 3, 2])),
                  g.matmul(qh, g.transpose(nk, [0, 1, 3, 2])), axis=-1)      # [nKV, g, N, P+N]
    probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
    p = g.op("Shape", past_k, start=1, end=2)
    big = g.ints([np.iinfo(np.int64).max])
    p_past = g.op("Slice", probs, g.ints([0]), p, g.ints([3]))
    p_new = g.op("Slice", probs, p, big, g.ints([3]))
    out = g.op("Add", g.matmul(p_past, g.unsqueeze(past_v, [1])), g.matmul(p_new, g.unsqueeze(new_v, [1])))
    out = g.transpose(g.reshape(out, [nh, -1, hd]), [1, 0, 2])              # [N, nH, hd]
    return g.reshape(out, [-1, nh * hd])


# Past rows per tile of the CPU graphs' attention (emit_tiled_gqa_attention): the scores a call holds
# are [nH·N, KV_TILE] whatever the context, so no memory grows with it beyond the cache itself.
KV_TILE = 2048

# A few new rows (decode, small CPU-verify trees) over an fp16 / int8 cache: up to this many past rows
# the whole past is widened once and read untiled, past it a Loop of tiles this size. An ONNX Slice
# copies, so every tile costs a copy beside its Cast: at 8k rows, 0.8B's 6 layers, the tiled form took
# 2.0x the untiled fp32 attention (Slice 13 ms, Cast 8, MatMul 12) where widening the whole past took
# 1.2x (docs/kv-cache.md). The widened copy is bounded by this constant (0.8B: 64 MiB), not the context.
WIDEN_ROWS = 16384


def tiled_gqa_attention_ref(q, past_k, past_v_t, new_k, new_v, mask, tile: int = KV_TILE, k_scale=None,
                            v_scale=None):
    """emit_tiled_gqa_attention in numpy: q [N, nH, hd]; past keys [nKV, P, hd] and values transposed
    [nKV, hd, P] in the cache's dtype (int8 rows times k_scale / v_scale [nKV, 1, P]); new rows
    [nKV, N, hd] fp32; mask [N, P+N]. The new rows first, then the past in tiles of `tile` rows,
    merged by the online softmax (running max m, sum l, weighted values acc)."""
    n, nh, hd = q.shape
    nkv, p_len = past_k.shape[0], past_k.shape[1]
    group = nh // nkv
    qh = q.transpose(1, 0, 2).reshape(nkv, group * n, hd).astype(np.float32) * np.float32(1.0 / math.sqrt(hd))
    mask_g = np.tile(mask, (group, 1))  # query row r of a KV group is token r % N
    s = qh @ new_k.transpose(0, 2, 1) + mask_g[:, p_len:]
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l, acc = e.sum(-1, keepdims=True), e @ new_v
    for start in range(0, p_len, tile):
        end = min(start + tile, p_len)
        s = qh @ past_k[:, start:end].astype(np.float32).transpose(0, 2, 1)
        if k_scale is not None:
            s = s * k_scale[:, :, start:end]
        s = s + mask_g[:, start:end]
        m_new = np.maximum(m, s.max(-1, keepdims=True))
        alpha, e = np.exp(m - m_new), np.exp(s - m_new)
        l = l * alpha + e.sum(-1, keepdims=True)
        if v_scale is not None:
            e = e * v_scale[:, :, start:end]
        acc = acc * alpha + e @ past_v_t[:, :, start:end].astype(np.float32).transpose(0, 2, 1)
        m = m_new
    return (acc / l).reshape(nh, n, hd).transpose(1, 0, 2)


def as_cached_ref(rows: np.ndarray, kv_cache: str) -> np.ndarray:
    """fp32 rows [..., hd] as the cache gives them back (runtime/state.py stores them, a later call
    reads them): fp16-rounded, or int8 with one scale per row (max|row| / 127, runtime/state.quantize_rows)
    times that scale; fp32 rows unchanged."""
    rows = np.asarray(rows, np.float32)
    if kv_cache == "fp16":
        return rows.astype(np.float16).astype(np.float32)
    if kv_cache == "int8":
        peak = np.abs(rows).max(axis=-1, keepdims=True)
        scale = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
        return np.clip(np.rint(rows / scale), -127, 127) * scale
    return rows


def emit_as_cached(g: GraphBuilder, rows: str, kv_cache: str) -> str:
    """as_cached_ref in ONNX. A call's own new rows enter its attention as the cache will hold them, so
    a row weighs the same in the call that makes it as in every later call that reads it back:
    a verified tree then scores exactly what plain decoding does (speculation stays lossless over a
    lossy cache)."""
    if kv_cache == "fp16":
        return g.op("Cast", g.op("Cast", rows, to=TensorProto.FLOAT16), to=TensorProto.FLOAT)
    if kv_cache == "int8":
        peak = g.op("ReduceMax", g.op("Abs", rows), g.ints([-1]), keepdims=1)
        scale = g.op("Where", g.op("Greater", peak, g.const(0.0)), g.op("Div", peak, g.const(127.0)), g.const(1.0))
        q = g.op("Clip", g.op("Round", g.op("Div", rows, scale)), g.const(-127.0), g.const(127.0))
        return g.op("Mul", q, scale)
    return rows


def widen_past(g: GraphBuilder, past_keys: str, past_values_t: str, k_scale: str | None = None,
                v_scale: str | None = None) -> tuple[str, str]:
    """An fp16 / int8 past as fp32 rows (int8 times its row scales [nKV, 1, P]): a copy of the whole past."""
    k, v = g.op("Cast", past_keys, to=TensorProto.FLOAT), g.op("Cast", past_values_t, to=TensorProto.FLOAT)
    if k_scale is not None:
        k, v = g.op("Mul", k, g.transpose(k_scale, [0, 2, 1])), g.op("Mul", v, v_scale)
    return k, v


def emit_few_rows_attention(g: GraphBuilder, q: str, past_keys: str, past_values_t: str, new_keys: str,
                            new_values: str, mask: str, *, n: int | None, nh: int, nkv: int, hd: int,
                            widen_rows: int = WIDEN_ROWS, k_scale: str | None = None,
                            v_scale: str | None = None) -> str:
    """emit_gqa_attention's result for up to VALUE_ROWS_MAX_N new rows over an fp16 / int8 past: an If
    on the past's length. Up to `widen_rows` rows, the whole past widened once (widen_past) and read
    untiled; past it, emit_tiled_gqa_attention with tiles of `widen_rows`. Either way what the call
    holds beside the cache is at most `widen_rows` widened rows (WIDEN_ROWS: why)."""
    past = g.op("Shape", past_keys, start=1, end=2)
    small = g.op("Squeeze", g.op("LessOrEqual", past, g.ints([widen_rows])), g.ints([0]))
    with g.capture() as whole:
        out_whole = emit_gqa_attention(g, q, *widen_past(g, past_keys, past_values_t, k_scale, v_scale),
                                       new_keys, new_values, mask, n=n, nh=nh, nkv=nkv, hd=hd)
    with g.capture() as tiles:
        out_tiles = emit_tiled_gqa_attention(g, q, past_keys, past_values_t, new_keys, new_values, mask, n=n, nh=nh,
                                             nkv=nkv, hd=hd, tile=widen_rows, widen=True, k_scale=k_scale,
                                             v_scale=v_scale)
    return g.if_(small, (whole, [out_whole]), (tiles, [out_tiles]))[0]


def emit_tiled_gqa_attention(g: GraphBuilder, q: str, past_keys: str, past_values_t: str, new_keys: str,
                             new_values: str, mask: str, *, n: int | None, nh: int, nkv: int, hd: int,
                             tile: int = KV_TILE, widen: bool = False, k_scale: str | None = None,
                             v_scale: str | None = None) -> str:
    """emit_gqa_attention's result, computed the way tiled_gqa_attention_ref is: the new rows, then
    a Loop over the past in tiles of `tile` rows with an online-softmax carry. No [N, P] scores and
    no fp32 copy of a non-fp32 cache exist at once: each tile is widened (Cast; int8 rows scaled
    after the products, on the [nH·N, tile] scores and probabilities, not on the rows) as it is
    read. For the CPU graphs (a Loop with runtime Slice starts: not for the HTP). n None: any count;
    widen: the past is not fp32 (fp16, or int8 with its scales [nKV, 1, P])."""
    group = nh // nkv
    rows = -1 if n is None else group * n
    qh = g.reshape(g.transpose(q, [1, 0, 2]), [nkv, rows, hd])
    qh = g.op("Mul", qh, g.const(1.0 / math.sqrt(hd)))
    big = np.iinfo(np.int64).max
    past = g.op("Shape", past_keys, start=1, end=2)
    group_rows = g.ints([group, 1])
    s = g.op("Add", g.matmul(qh, g.transpose(new_keys, [0, 2, 1])),
             g.op("Tile", g.op("Slice", mask, past, g.ints([big]), g.ints([1])), group_rows))
    m = g.op("ReduceMax", s, g.ints([-1]), keepdims=1)
    e = g.op("Exp", g.op("Sub", s, m))
    l, acc = g.op("ReduceSum", e, g.ints([-1]), keepdims=1), g.matmul(e, new_values)
    rows_first = n is None or n <= VALUE_ROWS_MAX_N

    def step(i, m, l, acc):
        start = g.op("Mul", i, g.ints([tile]))
        end = g.op("Min", g.op("Add", start, g.ints([tile])), past)  # the mask's new-row columns follow
        kt = g.op("Slice", past_keys, start, end, g.ints([1]))
        vt = g.op("Slice", past_values_t, start, end, g.ints([2]))
        if widen:
            kt, vt = g.op("Cast", kt, to=TensorProto.FLOAT), g.op("Cast", vt, to=TensorProto.FLOAT)
        if rows_first:  # the keys as the product's rows too: no transposed copy of the tile
            s = g.transpose(g.matmul(kt, g.transpose(qh, [0, 2, 1])), [0, 2, 1])
        else:
            s = g.matmul(qh, g.transpose(kt, [0, 2, 1]))
        if k_scale is not None:
            s = g.op("Mul", s, g.op("Slice", k_scale, start, end, g.ints([2])))
        s = g.op("Add", s, g.op("Tile", g.op("Slice", mask, start, end, g.ints([1])), group_rows))
        m_new = g.op("Max", m, g.op("ReduceMax", s, g.ints([-1]), keepdims=1))
        alpha, e = g.op("Exp", g.op("Sub", m, m_new)), g.op("Exp", g.op("Sub", s, m_new))
        l = g.op("Add", g.op("Mul", l, alpha), g.op("ReduceSum", e, g.ints([-1]), keepdims=1))
        if v_scale is not None:
            e = g.op("Mul", e, g.op("Slice", v_scale, start, end, g.ints([2])))
        if rows_first:  # the values as the product's rows (emit_gqa_attention: why)
            pv = g.transpose(g.matmul(vt, g.transpose(e, [0, 2, 1])), [0, 2, 1])
        else:
            pv = g.matmul(e, g.transpose(vt, [0, 2, 1]))
        return [m_new, l, g.op("Add", g.op("Mul", acc, alpha), pv)]
    trips = g.op("Div", g.op("Add", past, g.ints([tile - 1])), g.ints([tile]))
    _, l, acc = g.loop(trips, [m, l, acc], step)
    out = g.op("Div", acc, l)
    return g.transpose(g.reshape(out, [nh, -1 if n is None else n, hd]), [1, 0, 2])
