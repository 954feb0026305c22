"""RMS norms of Qwen3.5 (docs/qwen35-model.md, trap 1).

* RMSNorm1p: x̂·(1+w), zero-centred weight: input/post/final norms and q_norm/k_norm.
* Gated RMSNorm: (w·x̂)·silu(z), plain weight, per value head over Dv: linear_attn.norm.

Written as plain ops in ONNX for the NPU: the fused RMSNormalization gave wrong, varying values
on small shapes on the HTP (docs/htp-traps.md). CPU graphs use ONNX Runtime's own
fused CPU kernels instead (the `*_cpu` emitters): one node where the plain form takes seven, and a
decode step runs ~100 norms.

The plain form never squares the raw input: the HTP computes in fp16 (max 65,504), and real
models carry residual channels in the thousands (massive activations), whose square overflows
from |x| ≈ 256 (docs/npu-numerics.md). A row above 16 is scaled down to 16 first and the epsilon
rescaled to match: exact in fp32, no square above 256 in fp16.
"""
from __future__ import annotations

import numpy as np

from .graph import MS_DOMAIN, GraphBuilder


# rows whose max|x| exceeds this are scaled down to it before the square (a square <= 256, a sum
# of H of them <= 256·H); rows below it compute exactly as unscaled
SCALED_PEAK = 16.0


def _normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """The definition: x / sqrt(mean(x²) + eps)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _normalize_prescaled(x: np.ndarray, eps: float) -> np.ndarray:
    """What the ONNX form computes (= the definition): σ = max(1, max|x| / 16) per row, r = 1/√σ,
    y = x·r·r (|y| <= 16), out = (x·r)·(r / sqrt(mean(y²) + eps·r⁴)). Every factor stays a normal
    fp16 number (r in [1/64, 1]), no square exceeds 256, and σ = 1 is the unscaled arithmetic."""
    r = 1.0 / np.sqrt(np.maximum(np.abs(x).max(axis=-1, keepdims=True) / SCALED_PEAK, 1.0))
    xr = x * r
    y = xr * r
    return xr * (r / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps * (r * r) * (r * r)))


def rmsnorm_1p_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _normalize(x, eps) * (1.0 + w)


def gated_rmsnorm_ref(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _normalize(o, eps) * w * (z / (1.0 + np.exp(-z)))


def _emit_normalize(g: GraphBuilder, x: str, eps: float, eps_scale: str | None = None) -> str:
    """_normalize_prescaled: the HTP never squares a value above 16 (fp16-safe, exact in fp32). Scaled
    by r = 1/√σ twice, not by 1/σ once: 1/σ would be subnormal in fp16 for the largest rows, and
    the HTP flushes it (and x/σ, a Div) to 0. Rows up to 16 see r = 1: the unscaled arithmetic.
    eps_scale: a tensor the epsilon is multiplied by (x given in units u: eps/u², see emit_gated_delta)."""
    peak = g.op("ReduceMax", g.op("Abs", x), g.ints([-1]), keepdims=1)
    sigma = g.op("Max", g.op("Mul", peak, g.const(1.0 / SCALED_PEAK)), g.const(1.0))
    r = g.op("Reciprocal", g.op("Sqrt", sigma))
    xr = g.op("Mul", x, r)
    y = g.op("Mul", xr, r)
    mean_sq = g.op("ReduceMean", g.op("Mul", y, y), g.ints([-1]), keepdims=1)
    r2 = g.op("Mul", r, r)
    eps_term = g.op("Mul", g.const(eps), g.op("Mul", r2, r2))  # eps/σ²: flushes to 0 where it is negligible
    if eps_scale is not None:
        eps_term = g.op("Mul", eps_term, eps_scale)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean_sq, eps_term)))
    return g.op("Mul", xr, g.op("Mul", r, inv))


def emit_rmsnorm_1p(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    return g.op("Mul", _emit_normalize(g, x, eps), g.op("Add", weight, g.const(1.0)))


def emit_gated_rmsnorm(g: GraphBuilder, o: str, z: str, weight: str, eps: float, eps_scale: str | None = None) -> str:
    """eps_scale: o arrives in units u (the delta rule's state units): normalize(u·o) = normalize(o)
    with eps/u², so a readout beyond fp16 never materialises."""
    return g.op("Mul", g.op("Mul", _emit_normalize(g, o, eps, eps_scale), weight), g.silu(z))


def emit_rmsnorm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    """Llama RMSNorm x̂·w (plain weight, not Qwen3.5's (1+w)), for the EAGLE-3 drafter: it runs on
    the CPU in fp32, so ONNX's RMSNormalization (opset 23), one node where the written-out form
    took seven (a drafter step is mostly per-node overhead: 95 -> 65 nodes)."""
    g.require_opset(23)
    return g.op("RMSNormalization", x, weight, axis=-1, epsilon=eps)


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _normalize(x, eps) * w


# ---------------------------------------------------------------- ONNX Runtime CPU kernels

def emit_rmsnorm_1p_cpu(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    """ONNX RMSNormalization (opset 23) with scale 1 + w (folded at load)."""
    g.require_opset(23)
    return g.op("RMSNormalization", x, g.op("Add", weight, g.const(1.0)), axis=-1, epsilon=eps)


def emit_add_rmsnorm_1p_cpu(g: GraphBuilder, residual: str, delta: str, weight: str, eps: float) -> tuple[str, str]:
    """(residual + delta, its RMSNorm1p) in one SkipSimplifiedLayerNormalization."""
    normed, total = g.op("SkipSimplifiedLayerNormalization", delta, residual, g.op("Add", weight, g.const(1.0)),
                         n_out=4, omit=(1, 2), domain=MS_DOMAIN, epsilon=eps)
    return total, normed


def emit_gated_rmsnorm_cpu(g: GraphBuilder, o: str, z: str, weight: str, eps: float, dv: int) -> str:
    """o [rows, H·Dv] or [rows, H, Dv], z [rows, H·Dv]: RMSNormalization per head (a [rows, H, Dv]
    view), times silu(z); returns [rows, H·Dv].
    Not ORT's contrib GatedRMSNorm, which does the same ~16x slower on the CPU: 18 layers at
    Qwen3.5-0.8B shapes, 59.6 vs 3.7 ms a chunk of 128, 0.64 vs 0.21 ms a token (docs/performance.md)."""
    g.require_opset(23)
    heads = g.reshape(o, [0, -1, dv])
    normed = g.op("RMSNormalization", heads, weight, axis=-1, epsilon=eps)
    return g.op("Mul", g.reshape(normed, [0, -1]), g.silu(z))
