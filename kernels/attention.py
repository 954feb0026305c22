"""Grouped-query attention with an additive mask (research/qwen35.md §2.5 step 4).

q [N, nH, hd] (normed, rotated); keys/values [nKV, T, hd] = past rows then the N new rows; mask
[N, T] additive (0 = visible, MASKED = hidden): the host builds it (causal, padding, tree
ancestors). Query head h uses KV head h // (nH/nKV) (transformers' repeat_kv).
Explicit MatMul/Softmax: the ONNX Attention op with past inputs misbehaves on the HTP
(research/htp-real-size.md bug 3) and the explicit form compiles faster.
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


def emit_gqa_attention(g: GraphBuilder, q: str, keys: str, values: str, mask: str, *,
                       n: int, nh: int, nkv: int, hd: int) -> str:
    """Returns [N, nH, hd]. keys/values carry a dynamic or static T; only nKV and hd are fixed."""
    group = nh // nkv
    qh = g.reshape(g.transpose(q, [1, 0, 2]), [nkv, group * n, hd])  # heads of one KV group together
    scores = g.matmul(g.op("Mul", qh, g.const(1.0 / math.sqrt(hd))), g.transpose(keys, [0, 2, 1]))
    scores = g.op("Add", g.reshape(scores, [nkv, group, n, -1]), mask)
    probs = g.reshape(g.op("Softmax", scores, axis=-1), [nkv, group * n, -1])
    out = g.reshape(g.matmul(probs, values), [nh, n, hd])
    return g.transpose(out, [1, 0, 2])
