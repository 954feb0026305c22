"""The attention cores between the NPU prefill's segments (docs/long-context.md): a segment ends at
an attention layer with its chunk's queries and new K/V; the host runs the core and hands its
output to the next segment (runtime/pipeline.py).

On the NPU the core is the tile graph (kernels/attention_tile.py): the context so far plus the
chunk's own rows, in tiles of B rows read straight from the State (any cache dtype, cast to what
the graph takes), ceil((position + C) / B) calls per layer, merged on the host in fp32.
On the CPU (calibration, tests) it is the reference over the whole feed at once.
"""
from __future__ import annotations

import numpy as np

from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.kernels.attention_tile import merge_ref, tile_step_ref

POSITION = "kv_position"  # the feed's context length before the chunk (the host's, no graph reads it)


def _layer_rows(i: int, result: dict, feed: dict):
    return result.pop(f"attn_q.{i}"), result[f"new_key.{i}"], result[f"new_value.{i}"], feed[f"past_key.{i}"], \
        feed[f"past_value.{i}"]


def feed_attention(i: int, result: dict, feed: dict) -> np.ndarray:
    """The core from a whole chain feed (past K/V buffers and the additive mask over them), in fp32."""
    q, new_k, new_v, past_k, past_vt = _layer_rows(i, result, feed)
    keys = np.concatenate([past_k.astype(np.float32), new_k], axis=1)
    values_t = np.concatenate([past_vt.astype(np.float32), new_v.transpose(0, 2, 1)], axis=2)
    return tile_step_ref(q, keys, values_t, feed["attn_mask"])[2].astype(np.float32)


class TileAttention:
    """The core on the HTP: sessions of the tile graph (B rows, a chunk of n queries) and of its bulk
    form (bulk: (session, rows), BULK_TILES tiles a call, or None), one of each for every layer."""

    def __init__(self, session, rows: int, n: int, bulk=None):
        self.session, self.rows, self.n = session, rows, n
        self.bulk, self.bulk_rows = bulk if bulk else (None, 0)
        self.calls = 0  # tile calls so far, bulk ones included (docs/long-context.md counts them)
        self._visible = {}  # rows -> an all-visible mask: a tile wholly before the chunk

    def tiles(self, position: int) -> int:
        """Tile calls one layer makes for a chunk at `position`: bulk calls over whole bulk tiles of the
        context before it, then tiles of B up to its end."""
        bulk = position // self.bulk_rows if self.bulk is not None else 0
        return bulk + -(-(position + self.n - bulk * self.bulk_rows) // self.rows)

    def _visible_mask(self, rows: int) -> np.ndarray:
        if rows not in self._visible:
            self._visible[rows] = np.zeros((self.n, rows), np.float32)
        return self._visible[rows]

    def __call__(self, i: int, result: dict, feed: dict) -> np.ndarray:
        q, new_k, new_v, past_k, past_vt = _layer_rows(i, result, feed)
        pos, n = int(feed[POSITION]), self.n
        nkv, hd = new_k.shape[0], new_k.shape[2]
        spans = []  # (session, first row, rows)
        t0 = 0
        while self.bulk is not None and t0 + self.bulk_rows <= pos:
            spans.append((self.bulk, t0, self.bulk_rows))
            t0 += self.bulk_rows
        spans += [(self.session, t, self.rows) for t in range(t0, pos + n, self.rows)]
        acc = None
        for session, t0, b in spans:
            end = min(t0 + b, pos + n)
            if end <= pos and past_k.dtype == np.float32 and t0 + b <= past_k.shape[1]:
                keys, values_t = past_k[:, t0:end], past_vt[:, :, t0:end]  # ORT copies the strided view in
            else:  # the tile holding the chunk, a short last tile or a narrower cache: assembled, zero-padded
                keys, values_t = np.zeros((nkv, b, hd), np.float32), np.zeros((nkv, hd, b), np.float32)
                split = min(max(pos, t0), end)
                keys[:, :split - t0], values_t[:, :, :split - t0] = past_k[:, t0:split], past_vt[:, :, t0:split]
                keys[:, split - t0:end - t0] = new_k[:, split - pos:end - pos]
                values_t[:, :, split - t0:end - t0] = new_v[:, split - pos:end - pos].transpose(0, 2, 1)
            if end <= pos and end - t0 == b:
                mask = self._visible_mask(b)
            else:  # key t visible to query c when t <= pos + c (a padded chunk's rows hide behind its real ones)
                mask = np.where(np.arange(t0, t0 + b)[None] <= pos + np.arange(n)[:, None], 0.0, MASKED)
                mask = mask.astype(np.float32)
            step = session.run(None, {"tile_q": q, "tile_key": np.ascontiguousarray(keys),
                                      "tile_value": np.ascontiguousarray(values_t), "tile_mask": mask})
            self.calls += 1
            acc = step if acc is None else merge_ref(acc, step)
        return acc[2].astype(np.float32)
