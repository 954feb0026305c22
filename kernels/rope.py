"""Partial rotary embedding (docs/qwen35-model.md, trap 3).

Only the first rd = head_dim·partial_rotary_factor dims rotate, rotate-half pairs (i, i+rd/2),
inverse frequencies θ^(-2i/rd). For text input Qwen3.5's interleaved MRoPE is plain RoPE.
The host computes the cos/sin rows (cheap there, awkward on the NPU) exactly as transformers
does, in float32, so positions far into a long context round the same way.
"""
from __future__ import annotations

import numpy as np

from .graph import GraphBuilder


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [N, rotary_dim] for integer positions [N] (float32, like transformers)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


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
