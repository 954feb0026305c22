"""RMS norms of Qwen3.5 (research/qwen35.md §2.2, gotcha 1).

* RMSNorm1p: x̂·(1+w), zero-centred weight: input/post/final norms and q_norm/k_norm.
* Gated RMSNorm: (w·x̂)·silu(z), plain weight, per value head over Dv: linear_attn.norm.

Written as plain ops in ONNX for the NPU: the fused RMSNormalization gave wrong, varying values
on small shapes on the HTP (research/htp-real-size.md bug 2). CPU graphs use ONNX Runtime's own
fused CPU kernels instead (the `*_cpu` emitters): one node where the plain form takes seven, and a
decode step runs ~100 norms.
"""
from __future__ import annotations

import numpy as np

from .graph import MS_DOMAIN, GraphBuilder


def _normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_1p_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _normalize(x, eps) * (1.0 + w)


def gated_rmsnorm_ref(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _normalize(o, eps) * w * (z / (1.0 + np.exp(-z)))


def _emit_normalize(g: GraphBuilder, x: str, eps: float) -> str:
    mean_sq = g.op("ReduceMean", g.op("Mul", x, x), g.ints([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean_sq, g.const(eps))))
    return g.op("Mul", x, inv)


def emit_rmsnorm_1p(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    return g.op("Mul", _emit_normalize(g, x, eps), g.op("Add", weight, g.const(1.0)))


def emit_gated_rmsnorm(g: GraphBuilder, o: str, z: str, weight: str, eps: float) -> str:
    return g.op("Mul", g.op("Mul", _emit_normalize(g, o, eps), weight), g.silu(z))


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


def emit_gated_rmsnorm_cpu(g: GraphBuilder, o: str, z: str, weight: str, eps: float) -> str:
    """GatedRMSNorm over o, z [..., H·Dv] packed: the norm runs per Dv (the weight's length)."""
    return g.op("GatedRMSNorm", o, weight, z, domain=MS_DOMAIN, activation="silu", epsilon=eps)
