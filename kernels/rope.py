"""Partial rotary embedding (docs/qwen35-model.md, trap 3).

Only the first rd = head_dim·partial_rotary_factor dims rotate, rotate-half pairs (i, i+rd/2),
inverse frequencies θ^(-2i/rd). For text input Qwen3.5's interleaved MRoPE is plain RoPE.
The host computes the cos/sin rows (cheap there, awkward on the NPU) exactly as transformers
does, in float32, so positions far into a long context round the same way.
"""
from __future__ import annotations

import functools

import numpy as np

from .graph import GraphBuilder


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [N, rotary_dim] for integer positions [N] (float32, like transformers)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


ROPE_BLOCK = 256  # positions whose rows RopeRows computes at once


class RopeRows:
    """rope_tables' rows for a run of consecutive positions, from a block of ROPE_BLOCK positions
    computed at once and kept (the same values: each row is computed elementwise, whatever the
    batch). A decode step asks for one position; computing it alone, eight numpy calls right after
    a graph call (caches cold), took ~40 µs of the embedded model's ~1.8 ms step
    (docs/performance.md). The block is replaced as one tuple, so threads sharing
    an instance each read a whole one."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim, self.theta = rotary_dim, theta
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None  # (first position, cos, sin)

    def __call__(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n, rotary_dim] for positions start .. start + n - 1 (views into the block)."""
        block = self._block
        if block is None or not block[0] <= start or start + n > block[0] + len(block[1]):
            first = start - start % ROPE_BLOCK
            cos, sin = rope_tables(np.arange(first, max(first + ROPE_BLOCK, start + n)), self.rotary_dim, self.theta)
            cos.flags.writeable = sin.flags.writeable = False  # shared: a caller may not write into it
            block = self._block = (first, cos, sin)
        i = start - block[0]
        return block[1][i: i + n], block[2][i: i + n]


@functools.lru_cache(maxsize=8)
def rope_rows(rotary_dim: int, theta: float) -> RopeRows:
    """The one RopeRows of a (rotary_dim, theta): the target's chain feeds and the drafter share it."""
    return RopeRows(rotary_dim, theta)


def partial_rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [N, heads, hd]; cos/sin [N, rd]."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = np.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([xr * c + rotated * s, xp], axis=-1)


def emit_partial_rope(g: GraphBuilder, x: str, cos: str, sin: str, head_dim: int, rotary_dim: int) -> str:
    """x [N, heads, hd]; cos/sin [N, 1, rd] (already unsqueezed by the caller, shared by layers)."""
    if rotary_dim == head_dim:
        xr, xp = x, None
    else:
        xr, xp = g.split(x, [rotary_dim, head_dim - rotary_dim], axis=-1)
    x1, x2 = g.split(xr, [rotary_dim // 2, rotary_dim // 2], axis=-1)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    out = g.op("Add", g.op("Mul", xr, cos), g.op("Mul", rotated, sin))
    return out if xp is None else g.op("Concat", out, xp, axis=-1)
