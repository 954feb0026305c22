"""What magnitudes the residual add and the attention scores survive on onnxruntime-qnn's HTP
emulator (fp16, CPU fallback off), against the same graph on the CPU EP; prints JSON.

    python scripts/htp_magnitudes.py [--out scripts/results/htp_magnitudes.json]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort

from hybrid_npu.kernels.attention import emit_gqa_attention
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime.qnn import qnn_session_options
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def run_both(g, feeds):
    data = g.model({}).SerializeToString()
    cpu = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    opts = load_profile("snapdragon-x-elite").qnn_provider_options()
    opts["htp_graph_finalization_optimization_mode"] = "1"
    return cpu, ort.InferenceSession(data, qnn_session_options(opts)).run(None, feeds)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(a).max()) if np.isfinite(b).all() else None


def residual_add(m: float) -> dict:
    """x [16, 48] with one channel at m, plus a unit-scale delta: the error on the small channels
    (which a norm after the add reads) and on the large one."""
    r = np.random.default_rng(0)
    x = r.standard_normal((16, 48)).astype(np.float32)
    x[:, 30] = m
    d = r.standard_normal((16, 48)).astype(np.float32)
    g = GraphBuilder("add")
    g.output(g.op("Add", g.input("x", np.float32, x.shape), g.input("d", np.float32, d.shape)), "y", np.float32,
             x.shape)
    (cpu,), (htp,) = run_both(g, {"x": x, "d": d})
    small = np.arange(48) != 30
    return {"magnitude": m, "rel_error_large_channel": rel(cpu[:, 30], htp[:, 30]),
            "abs_error_small_channels": float(np.abs(cpu[:, small] - htp[:, small]).max())}


def attention_scores(peak: float) -> dict:
    """One attention call (N = 8 new, 24 past rows, 4 heads over 2 KV heads, hd 24) with q scaled so
    the largest score (after 1/√hd) is `peak`; the output against the CPU EP."""
    n, t, nh, nkv, hd = 8, 24, 4, 2, 24
    r = np.random.default_rng(1)
    q = r.standard_normal((n, nh, hd)).astype(np.float32)
    pk, pv = (r.standard_normal((nkv, t, hd)).astype(np.float32) for _ in range(2))
    nk, nv = (r.standard_normal((nkv, n, hd)).astype(np.float32) for _ in range(2))
    scores = np.einsum("nhd,htd->hnt", q, np.repeat(np.concatenate([pk, nk], 1), 2, 0)) / np.sqrt(hd)
    q *= peak / np.abs(scores).max()
    mask = np.zeros((n, t + n), np.float32)
    mask[:, t:] = np.where(np.tril(np.ones((n, n))) > 0, 0, -30000.0)
    g = GraphBuilder("attn")
    ins = [g.input(k, np.float32, a.shape) for k, a in (("q", q), ("pk", pk), ("pv", pv), ("nk", nk), ("nv", nv),
                                                         ("mask", mask))]
    g.output(emit_gqa_attention(g, *ins, n=n, nh=nh, nkv=nkv, hd=hd), "o", np.float32, [n, nh, hd])
    (cpu,), (htp,) = run_both(g, dict(q=q, pk=pk, pv=pv, nk=nk, nv=nv, mask=mask))
    return {"peak_score": peak, "rel_error": rel(cpu, htp)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = {"emulator": "onnxruntime-qnn HTP x86_64 emulator, fp16, CPU fallback off",
              "residual_add": [residual_add(m) for m in (1e3, 1e4, 3e4, 6e4, 1.2e5)],
              "attention_scores": [attention_scores(p) for p in (10.0, 100.0, 1e3, 1e4, 3e4, 6e4)]}
    bench_json.emit(result, a.out)


if __name__ == "__main__":
    main()
