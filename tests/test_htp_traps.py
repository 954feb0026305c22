"""The HTP traps of docs/htp-traps.md, each guarded on a shape where it bites, run on the
emulator with CPU fallback disabled against the same graph on the CPU EP."""
import numpy as np
import onnxruntime as ort
import pytest

from hybrid_npu.kernels import delta_rule
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.profiles.loader import load_profile

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")
from hybrid_npu.runtime.qnn import qnn_session_options  # noqa: E402


def run_both(g, feeds):
    data = g.model({}).SerializeToString()
    cpu = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    opts = load_profile("snapdragon-x-elite").qnn_provider_options()
    opts["htp_graph_finalization_optimization_mode"] = "1"
    htp = ort.InferenceSession(data, qnn_session_options(opts)).run(None, feeds)
    return cpu, htp


def test_strong_decay_stays_finite_on_the_htp():
    """Cumulative log-decay over 64 tokens reaches -320: unclamped, the HTP's Exp returns +-1.3e5
    below -88 and the state comes out 1e5 wrong (bug 1)."""
    n, hk, hv, dk, dv = 64, 2, 4, 16, 16
    r = np.random.default_rng(0)
    q = r.standard_normal((n, hk, dk)).astype(np.float32)
    k = r.standard_normal((n, hk, dk)).astype(np.float32)
    v = r.standard_normal((n, hv, dv)).astype(np.float32)
    g_in = np.full((n, hv), -5.0, np.float32)
    beta = np.full((n, hv), 0.5, np.float32)
    S = r.standard_normal((hv, dk, dv)).astype(np.float32)
    gb = GraphBuilder("decay")
    ins = [gb.input(name, np.float32, a.shape) for name, a in
           (("q", q), ("k", k), ("v", v), ("g", g_in), ("beta", beta), ("S", S))]
    causal = np.tril(np.ones((n, n), np.float32))
    o, s_after, _ = delta_rule.emit_gated_delta(gb, *ins, gb.const(causal), gb.const(causal.T),
                                                gb.const(np.tril(causal, -1)), n=n, hk=hk, hv=hv, dk=dk, dv=dv,
                                                chain_state=True)
    gb.output(o, "o", np.float32, [n, hv, dv])
    gb.output(s_after, "S_out", np.float32, [hv, dk, dv])
    (o_cpu, s_cpu), (o_htp, s_htp) = run_both(gb, dict(q=q, k=k, v=v, g=g_in, beta=beta, S=S))
    o_ref, s_ref = delta_rule.gated_delta_recurrent_ref(*(x.astype(np.float64) for x in (q, k, v, g_in, beta, S)))
    np.testing.assert_allclose(o_cpu, o_ref, atol=1e-4)
    assert np.isfinite(o_htp).all() and np.isfinite(s_htp).all()
    assert np.abs(s_htp - s_ref).max() <= 2e-2 * np.abs(s_ref).max()
    assert np.abs(o_htp - o_ref).max() <= 2e-2 * np.abs(o_ref).max()


def test_softplus_is_accurate_where_the_htp_op_is_not():
    """The HTP's Softplus is ~9% off near x = -2 and garbage below -88; ours is relu + log1p(e^-|x|)."""
    x = np.concatenate([np.linspace(-100, 20, 241), np.linspace(-3, -1, 41)]).astype(np.float32)[None]
    gb = GraphBuilder("softplus")
    gb.output(gb.softplus(gb.input("x", np.float32, x.shape)), "y", np.float32, x.shape)
    (cpu,), (htp,) = run_both(gb, {"x": x})
    want = np.logaddexp(0, x.astype(np.float64))
    clamped = x < -60  # Exp inputs are clamped at -60 for the HTP: e^-60 stands in for smaller values
    np.testing.assert_allclose(cpu[~clamped], want[~clamped], rtol=1e-5)
    assert np.abs(cpu[clamped]).max() < 1e-25
    near = (x > -3) & (x < -1)
    assert np.abs(htp[near] - want[near]).max() / want[near].max() < 1e-2
    assert np.isfinite(htp).all() and np.abs(htp[x < -88]).max() < 1e-3
    assert np.abs(htp - want).max() < 1e-2 * max(1.0, np.abs(want).max())


def test_norms_on_tiny_head_shapes_are_right_on_the_htp():
    """The fused RMSNorm gave wrong, varying values on [64,2,16]-like shapes (bug 2); ours are plain ops."""
    from hybrid_npu.kernels.norms import emit_gated_rmsnorm, emit_rmsnorm_1p, gated_rmsnorm_ref, rmsnorm_1p_ref

    r = np.random.default_rng(1)
    x = r.standard_normal((64, 2, 16)).astype(np.float32)
    z = r.standard_normal((64, 2, 16)).astype(np.float32)
    w = (0.3 * r.standard_normal(16)).astype(np.float32)
    gb = GraphBuilder("norms")
    xi, zi = gb.input("x", np.float32, x.shape), gb.input("z", np.float32, z.shape)
    gb.output(emit_rmsnorm_1p(gb, xi, gb.const(w), 1e-6), "a", np.float32, x.shape)
    gb.output(emit_gated_rmsnorm(gb, xi, zi, gb.const(1 + w), 1e-6), "b", np.float32, x.shape)
    _, (a, b) = run_both(gb, {"x": x, "z": z})
    _, (a2, b2) = run_both(gb, {"x": x, "z": z})
    np.testing.assert_array_equal(a, a2)  # not varying from run to run
    assert np.abs(a - rmsnorm_1p_ref(x, w, 1e-6)).max() < 2e-2
    assert np.abs(b - gated_rmsnorm_ref(x, z, 1 + w, 1e-6)).max() < 2e-2


def test_norms_survive_massive_activations_on_the_htp():
    """Rows with one channel at 300..60,000 (massive activations): x·x overflows fp16 past ~256, so
    the plain-op norm squares x/max|x| instead (kernels/norms.py)."""
    from hybrid_npu.kernels.norms import emit_gated_rmsnorm, emit_rmsnorm_1p, gated_rmsnorm_ref, rmsnorm_1p_ref

    r = np.random.default_rng(2)
    x = r.standard_normal((6, 48)).astype(np.float32)
    for row, value in enumerate((300.0, -1200.0, 5000.0, 20000.0, 60000.0)):
        x[row, 30] = value
    z = r.standard_normal((6, 48)).astype(np.float32)
    w = (0.3 * r.standard_normal(48)).astype(np.float32)
    gb = GraphBuilder("norms_massive")
    xi, zi = gb.input("x", np.float32, x.shape), gb.input("z", np.float32, z.shape)
    gb.output(emit_rmsnorm_1p(gb, xi, gb.const(w), 1e-6), "a", np.float32, x.shape)
    gb.output(emit_gated_rmsnorm(gb, xi, zi, gb.const(1 + w), 1e-6), "b", np.float32, x.shape)
    _, (a, b) = run_both(gb, {"x": x, "z": z})
    want_a, want_b = rmsnorm_1p_ref(x, w, 1e-6), gated_rmsnorm_ref(x, z, 1 + w, 1e-6)
    assert np.abs(a - want_a).max() < 2e-2 * np.abs(want_a).max()
    assert np.abs(b - want_b).max() < 2e-2 * np.abs(want_b).max()
