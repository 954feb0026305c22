"""Attention over the past in fixed tiles of B key rows, merged with flash-attention's online softmax.

The NPU's attention core (docs/long-context.md): a chunk's queries q [nKV, G·N, hd] (query head h
reads KV head h // G, its N rows together) meet the context in tiles of B rows, keys
[nKV, B, hd] and values transposed [nKV, hd, B] (the State's layout, runtime/state.py), with an
additive mask [N, B] (0 visible, MASKED hidden). One tile call returns the tile's own softmax
statistics: m [nKV, G·N, 1] (row max of the scaled scores), l [nKV, G·N, 1] (sum of exp(s - m),
<= B) and o [nKV, G·N, hd], the tile's attention already normalised by l (a convex mix of its
values, so bounded by the largest |value| whatever B is: fp16-safe on the HTP). The host merges
the tiles in fp32 (merge_ref): the running sum grows with the context (262k rows pass fp16's
65,504) and the merge is a few [nKV, G·N, hd] element-wise ops, so it stays off the NPU.

The tile has no weights: one compiled graph serves every attention layer.
"""
from __future__ import annotations

import math

import numpy as np

from .attention import MASKED
from .graph import GraphBuilder

# The context wholly before a chunk's own tile is read BULK_TILES tiles per call by the same graph built
# for BULK_TILES·B rows: its calls per layer fall 8-fold (0.8B at 262k tokens: 102 tile calls a chunk, not 774), and
# the chunk's own end of the context, where the rows in use grow, keeps the small tile's waste.
BULK_TILES = 8
TILE_INPUTS = ("tile_q", "tile_key", "tile_value", "tile_mask")
TILE_OUTPUTS = ("tile_max", "tile_sum", "tile_out")


def tile_step_ref(q, keys, values_t, mask):
    """One tile: q [nKV, G·N, hd], keys [nKV, B, hd], values_t [nKV, hd, B], mask [N, B] -> (m, l, o)."""
    nkv, rows, hd = q.shape
    n = mask.shape[0]
    s = np.einsum("krd,kbd->krb", q, keys) / math.sqrt(hd)
    s = (s.reshape(nkv, rows // n, n, -1) + mask).reshape(nkv, rows, -1)
    m = s.max(-1, keepdims=True)
    p = np.exp(np.maximum(s - m, -60.0))
    l = p.sum(-1, keepdims=True)
    return m, l, np.einsum("krb,kdb->krd", p / l, values_t)


def merge_ref(a, b):
    """Two tiles' (m, l, o) -> the (m, l, o) of both together (flash-attention's rescaled merge)."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = np.maximum(ma, mb)
    wa, wb = la * np.exp(ma - m), lb * np.exp(mb - m)
    l = wa + wb
    return m, l, (oa * wa + ob * wb) / l


def tiled_attention_ref(q, keys, values_t, mask, tile: int):
    """Attention of q over keys [nKV, T, hd] / values_t [nKV, hd, T] (mask [N, T]) tile by tile: what
    the NPU path computes, T padded with hidden rows to whole tiles. Returns o [nKV, G·N, hd]."""
    t = keys.shape[1]
    pad = -t % tile
    keys = np.pad(keys, ((0, 0), (0, pad), (0, 0)))
    values_t = np.pad(values_t, ((0, 0), (0, 0), (0, pad)))
    mask = np.pad(mask, ((0, 0), (0, pad)), constant_values=MASKED)
    acc = None
    for start in range(0, t + pad, tile):
        step = tile_step_ref(q, keys[:, start:start + tile], values_t[:, :, start:start + tile],
                             mask[:, start:start + tile])
        acc = step if acc is None else merge_ref(acc, step)
    return acc[2]


def emit_attention_tile(g: GraphBuilder, *, n: int, group: int, nkv: int, hd: int, tile: int) -> None:
    """The tile graph (tile_step_ref as ONNX), inputs TILE_INPUTS and outputs TILE_OUTPUTS declared on g.
    Exp's input is clamped at -60 (kernels/graph.safe_exp): the HTP returns garbage far below it."""
    rows = group * n
    q = g.input("tile_q", np.float32, [nkv, rows, hd])
    k = g.input("tile_key", np.float32, [nkv, tile, hd])
    vt = g.input("tile_value", np.float32, [nkv, hd, tile])
    mask = g.input("tile_mask", np.float32, [n, tile])
    qs = g.op("Mul", q, g.const(1.0 / math.sqrt(hd)))  # scale the G·N query rows, not the G·N·B scores
    s = g.matmul(qs, g.transpose(k, [0, 2, 1]))
    s = g.reshape(g.op("Add", g.reshape(s, [nkv, group, n, tile]), mask), [nkv, rows, tile])
    m = g.op("ReduceMax", s, g.ints([-1]), keepdims=1)
    p = g.safe_exp(g.op("Sub", s, m))
    l = g.op("ReduceSum", p, g.ints([-1]), keepdims=1)
    o = g.matmul(g.op("Mul", p, g.op("Reciprocal", l)), g.transpose(vt, [0, 2, 1]))
    g.output(m, "tile_max", np.float32, [nkv, rows, 1])
    g.output(l, "tile_sum", np.float32, [nkv, rows, 1])
    g.output(o, "tile_out", np.float32, [nkv, rows, hd])
