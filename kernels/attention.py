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
