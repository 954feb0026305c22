"""The GDN core over a long, low-decay context whose readout passes fp16, on onnxruntime-qnn's HTP
emulator (fp16, CPU fallback off), against the float64 recurrence; prints JSON. Two ways to feed
the state: in the per-head units the NPU Pipeline picks (what the runtime does), and in real units
(units fixed at 1: only the chunk's own units protect it).

    python scripts/gdn_long_context_htp.py [--tokens 8192] [--out scripts/results/gdn_long_context_htp.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def run(tokens: int, state_units: bool) -> dict:
    import onnxruntime as ort
    from outlier_fixtures import gdn_layer_core, long_low_decay_case

    from hybrid_npu.kernels.delta_rule import gated_delta_recurrent_ref
    from hybrid_npu.kernels.norms import gated_rmsnorm_ref
    from hybrid_npu.profiles.loader import load_profile
    from hybrid_npu.runtime.pipeline import Pipeline
    from hybrid_npu.runtime.qnn import qnn_session_options

    c, hk, hv, dk, dv = 64, 1, 2, 16, 16
    q, k, v, g_in, beta, S0, z, w = long_low_decay_case(tokens, hk, hv, dk, dv)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g_in, beta, S0)
    want = gated_rmsnorm_ref(o_ref, z, w, 1e-6)
    opts = load_profile("snapdragon-x-elite").qnn_provider_options()
    opts["htp_graph_finalization_optimization_mode"] = "1"
    htp = ort.InferenceSession(gdn_layer_core(c, hk, hv, dk, dv).model({}).SerializeToString(),
                               qnn_session_options(opts))
    pipe = Pipeline([htp], "QNN/HTP" if state_units else "CPU")  # a "CPU" pipeline feeds units of 1
    S, outs, t0 = S0.astype(np.float32), [], time.perf_counter()
    for s in range(0, tokens, c):
        feed = dict(q=q[s:s + c], k=k[s:s + c], v=v[s:s + c], g=g_in[s:s + c], beta=beta[s:s + c], z=z[s:s + c], w=w)
        out = pipe.run({**{a: b.astype(np.float32) for a, b in feed.items()}, "recurrent_state.0": S})
        S, _ = out["recurrent_state_out.0"], outs.append(out["normed"])
    got = np.concatenate(outs)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()) if np.isfinite(a).all() else None  # noqa: E731
    return {"state_fed_in": "host-chosen units" if state_units else "real units", "tokens": tokens,
            "max_abs_readout_fp64": float(np.abs(o_ref).max()), "max_abs_state_fp64": float(np.abs(s_ref).max()),
            "rel_error_normed_readout": rel(got, want), "rel_error_state": rel(S, s_ref),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = {"emulator": "onnxruntime-qnn HTP x86_64 emulator, fp16, CPU fallback off",
              "case": "tests/outlier_fixtures.py long_low_decay_case: Hv 2, Dk = Dv 16, C 64, decay e^-1e-6, "
                      "beta 0.9, |v| <= 2e4, initial state up to 3e5 in the key directions no key writes",
              "rows": [run(a.tokens, True), run(a.tokens, False)]}
    bench_json.emit(result, a.out)


if __name__ == "__main__":
    main()
