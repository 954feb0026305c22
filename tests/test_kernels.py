"""Each kernel three ways: numpy reference, transformers' own torch function, ONNX on the CPU EP.

Shapes differ on every axis (Hk != Hv, Dk != Dv, odd token counts) so a transposed or swapped
axis cannot pass by accident.
"""
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx_helpers import run_graph
from transformers.models.qwen3_5 import modeling_qwen3_5 as M5

from hybrid_npu.kernels import attention, conv, delta_rule, norms, rope
from hybrid_npu.kernels.graph import GraphBuilder

HK, HV, DK, DV = 2, 6, 12, 10


def gdn_inputs(n, seed=0, dtype=np.float32):
    r = np.random.default_rng(seed)
    q = r.standard_normal((n, HK, DK)).astype(dtype)
    k = r.standard_normal((n, HK, DK)).astype(dtype)
    v = r.standard_normal((n, HV, DV)).astype(dtype)
    g = -np.abs(r.standard_normal((n, HV))).astype(dtype) * 0.5
    beta = (1 / (1 + np.exp(-r.standard_normal((n, HV))))).astype(dtype)
    S = (r.standard_normal((HV, DK, DV)) * 0.3).astype(dtype)
    return q, k, v, g, beta, S


def hf_delta(fn, q, k, v, g, beta, S, **kw):
    t = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta)]
    o, s = fn(*t[:3], g=t[3], beta=t[4], initial_state=torch.from_numpy(S)[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)
    return o[0].numpy(), s[0].numpy()


def emit_delta_graph(n, tree=False, fp16_guards=True):
    g = GraphBuilder("delta")
    q = g.input("q", np.float32, [n, HK, DK])
    k = g.input("k", np.float32, [n, HK, DK])
    v = g.input("v", np.float32, [n, HV, DV])
    gate = g.input("g", np.float32, [n, HV])
    beta = g.input("beta", np.float32, [n, HV])
    S = g.input("S", np.float32, [HV, DK, DV])
    m = g.input("M", np.float32, [n, n])
    strict = g.op("Mul", m, g.const(1 - np.eye(n, dtype=np.float32)))
    o, s_after, (ck, cu, cg) = delta_rule.emit_gated_delta(g, q, k, v, gate, beta, S, m, g.transpose(m, [1, 0]),
                                                           strict, n=n, hk=HK, hv=HV, dk=DK, dv=DV,
                                                           chain_state=not tree, fp16_guards=fp16_guards)
    g.output(o, "o", np.float32, [n, HV, DV])
    if tree:
        g.output(ck, "ck", np.float32, [n, HV, DK])
        g.output(cu, "cu", np.float32, [n, HV, DV])
        g.output(cg, "cg", np.float32, [n, HV])
    else:
        g.output(s_after, "S_out", np.float32, [HV, DK, DV])
    return g


@pytest.mark.parametrize("fp16_guards", [True, False])  # False: the CPU verify graph's form (no σ scaling)
@pytest.mark.parametrize("n", [1, 5, 37])
def test_delta_rule_numpy_vs_transformers_vs_onnx(n, fp16_guards):
    q, k, v, g, beta, S = gdn_inputs(n, seed=n)
    o_ref, s_ref = delta_rule.gated_delta_recurrent_ref(*(x.astype(np.float64) for x in (q, k, v, g, beta, S)))
    o_hf, s_hf = hf_delta(M5.torch_recurrent_gated_delta_rule, q, k, v, g, beta, S)
    np.testing.assert_allclose(o_hf, o_ref, atol=2e-5)
    np.testing.assert_allclose(s_hf, s_ref, atol=2e-5)
    if n > 1:
        o_chunk, s_chunk = hf_delta(M5.torch_chunk_gated_delta_rule, q, k, v, g, beta, S)
        np.testing.assert_allclose(o_chunk, o_ref, atol=2e-5)
    causal = np.tril(np.ones((n, n)))
    o_masked, commit = delta_rule.gated_delta_masked_ref(*(x.astype(np.float64) for x in (q, k, v, g, beta, S)), causal)
    np.testing.assert_allclose(o_masked, o_ref, atol=1e-10)
    np.testing.assert_allclose(delta_rule.commit_state_ref(S.astype(np.float64), commit, list(range(n))), s_ref,
                               atol=1e-10)
    o_onnx, s_onnx = run_graph(emit_delta_graph(n, fp16_guards=fp16_guards),
                               dict(q=q, k=k, v=v, g=g, beta=beta, S=S, M=causal.astype(np.float32)))
    np.testing.assert_allclose(o_onnx, o_ref, atol=2e-5)
    np.testing.assert_allclose(s_onnx, s_ref, atol=2e-5)


def cpu_delta_graph(n):
    gb = GraphBuilder("delta_cpu")
    names = [gb.input(name, np.float32, shape) for name, shape in
             (("qk", [n, 2 * HK * DK]), ("v", [n, HV * DV]), ("g", [n, HV]), ("beta", [n, HV]), ("S", [HV, DK, DV]))]
    o, s_after = delta_rule.emit_gated_delta_cpu(gb, *names, n=n, hk=HK, hv=HV, dk=DK, dv=DV)
    gb.output(o, "o", np.float32, [n, HV * DV])
    gb.output(gb.op("Squeeze", s_after, gb.ints([0])), "S_out", np.float32, [HV, DK, DV])
    return gb


def run_cpu_delta(gb, q, k, v, g, beta, S):
    n = len(q)
    return run_graph(gb, dict(qk=np.concatenate([q.reshape(n, -1), k.reshape(n, -1)], axis=1), v=v.reshape(n, -1),
                              g=g, beta=beta, S=S))


def test_cpu_delta_rule_matches_reference_and_transformers():
    """The CPU graphs' form (ORT's LinearAttention, emit_gated_delta_cpu): one token at a time with
    its state fed back (decode) and a 7-token chunk with a padded tail (beta = g = 0, as the graph
    feeds padding), against the token loop and transformers' recurrent kernel."""
    q, k, v, g, beta, S = gdn_inputs(7, seed=11)
    o_ref, s_ref = delta_rule.gated_delta_recurrent_ref(*(x.astype(np.float64) for x in (q, k, v, g, beta, S)))
    o_hf, s_hf = hf_delta(M5.torch_recurrent_gated_delta_rule, q, k, v, g, beta, S)
    np.testing.assert_allclose(o_hf, o_ref, atol=2e-5)
    np.testing.assert_allclose(s_hf, s_ref, atol=2e-5)
    step, state, outs = cpu_delta_graph(1), S, []
    for t in range(7):
        o_t, state = run_cpu_delta(step, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o_t.reshape(HV, DV))
    np.testing.assert_allclose(np.stack(outs), o_ref, atol=2e-5)
    np.testing.assert_allclose(state, s_ref, atol=2e-5)
    pad = 3  # the chunk graph at n = 10 with 3 padded tokens: the state is the 7 valid tokens'
    padded = [np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) for x in (q, k, v, g, beta)]
    padded[0][7:], padded[1][7:], padded[2][7:] = 1.0, 1.0, 1.0  # whatever the padding rows hold
    o_chunk, s_chunk = run_cpu_delta(cpu_delta_graph(10), *padded, S)
    np.testing.assert_allclose(o_chunk[:7].reshape(7, HV, DV), o_ref, atol=2e-5)
    np.testing.assert_allclose(s_chunk, s_ref, atol=2e-5)


def tree_parents():
    # 12 nodes in topological order, depth up to 5, several branches
    return [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 9, 4]


def root_path(parents, m):
    path = []
    while m >= 0:
        path.append(m)
        m = parents[m]
    return path[::-1]


def ancestor_mask(parents):
    n = len(parents)
    M = np.zeros((n, n))
    for i in range(n):
        for j in root_path(parents, i):
            M[i, j] = 1
    return M


@pytest.mark.parametrize("fp16_guards", [True, False])
def test_tree_delta_rule_matches_recurrence_along_every_path(fp16_guards):
    parents = tree_parents()
    n = len(parents)
    q, k, v, g, beta, S = gdn_inputs(n, seed=3)
    M = ancestor_mask(parents)
    o_onnx, ck, cu, cg = run_graph(emit_delta_graph(n, tree=True, fp16_guards=fp16_guards),
                                   dict(q=q, k=k, v=v, g=g, beta=beta, S=S, M=M.astype(np.float32)))
    for m in range(n):
        path = root_path(parents, m)
        o_path, s_path = delta_rule.gated_delta_recurrent_ref(
            *(x[path].astype(np.float64) for x in (q, k, v, g, beta)), S.astype(np.float64))
        np.testing.assert_allclose(o_onnx[m], o_path[-1], atol=2e-5)
        s_commit = delta_rule.commit_state_ref(S.astype(np.float64), (ck, cu, cg), path)
        np.testing.assert_allclose(s_commit, s_path, atol=2e-5)


@pytest.mark.parametrize("n", [64, 128])
def test_delta_rule_stress_near_parallel_keys(n):
    """Near-parallel keys, g ≈ 0, β ≈ 1: where high powers of A blow up (docs/qwen35-model.md trap 8)."""
    r = np.random.default_rng(n)
    base = r.standard_normal((1, HK, DK))
    k = (base + 1e-2 * r.standard_normal((n, HK, DK))).astype(np.float32)
    q = r.standard_normal((n, HK, DK)).astype(np.float32)
    v = r.standard_normal((n, HV, DV)).astype(np.float32)
    g = (-1e-4 * np.abs(r.standard_normal((n, HV)))).astype(np.float32)
    beta = np.full((n, HV), 0.999, np.float32)
    S = (r.standard_normal((HV, DK, DV)) * 0.3).astype(np.float32)
    o_ref, s_ref = delta_rule.gated_delta_recurrent_ref(*(x.astype(np.float64) for x in (q, k, v, g, beta, S)))
    o, s = run_graph(emit_delta_graph(n), dict(q=q, k=k, v=v, g=g, beta=beta, S=S,
                                               M=np.tril(np.ones((n, n), np.float32))))
    assert np.abs(o - o_ref).max() / np.abs(o_ref).max() <= 1e-4
    assert np.abs(s - s_ref).max() / np.abs(s_ref).max() <= 1e-4


def test_unit_lower_solve_is_exact_for_ragged_sizes():
    for n in (3, 8, 13, 20):
        r = np.random.default_rng(n)
        A = np.tril(r.standard_normal((2, n, n)) * 0.5, -1).astype(np.float32)
        R = r.standard_normal((2, n, 4)).astype(np.float32)
        g = GraphBuilder("solve")
        a, rr = g.input("A", np.float32, [2, n, n]), g.input("R", np.float32, [2, n, 4])
        g.output(delta_rule.emit_unit_lower_solve(g, a, rr, 2, n, 4), "U", np.float32, [2, n, 4])
        (U,) = run_graph(g, {"A": A, "R": R})
        want = np.linalg.solve(np.eye(n) + A.astype(np.float64), R.astype(np.float64))
        np.testing.assert_allclose(U, want, atol=1e-4, rtol=1e-4)


def correlated_solve_case(n: int, seed: int, heads: int = 4, d: int = 32):
    """A [H, n, n] as the masked delta rule builds it, from keys nearly all alike (the hard case
    for a product of powers: N^k grows to ~C(n, k) before it cancels), and R [H, n, 4]."""
    r = np.random.default_rng(seed)
    k = 0.95 * r.standard_normal((heads, 1, d)) + 0.05 * r.standard_normal((heads, n, d))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.cumsum(-r.uniform(0, 0.05, (heads, n)), axis=1)
    decay = np.exp(g[:, :, None] - g[:, None, :]) * np.tril(np.ones((n, n)), -1)
    A = (r.uniform(0.5, 1.0, (heads, n, 1)) * (k @ k.transpose(0, 2, 1)) * decay).astype(np.float32)
    return A, r.standard_normal((heads, n, 4)).astype(np.float32)


@pytest.mark.parametrize("most", [delta_rule.SOLVE_BLOCK, 2 * delta_rule.SOLVE_BLOCK])
def test_unit_lower_solve_for_any_count_is_exact_at_every_count(most):
    """One graph for any count (the CPU verify's core): up to SOLVE_BLOCK nodes one block, up to twice
    that its two diagonal blocks, the second empty in a smaller call; every count against numpy's
    solve, on keys nearly all alike (where one 16-row product is ~30x less exact)."""
    b = delta_rule.SOLVE_BLOCK
    g = GraphBuilder("solve_any")
    a, rr = g.input("A", np.float32, [4, "n", "n"]), g.input("R", np.float32, [4, "n", 4])
    eye = g.op("EyeLike", g.op("Gather", a, g.const(np.int64(0), np.int64), axis=0))
    if most > b:
        eye = delta_rule.emit_solve_eye_blocks(g, eye)
    g.output(delta_rule.emit_unit_lower_solve(g, a, rr, 4, None, 4, eye=eye), "U", np.float32, [4, "n", 4])
    sess = ort.InferenceSession(g.model({}).SerializeToString(), providers=["CPUExecutionProvider"])
    for n in range(1, most + 1):
        A, R = correlated_solve_case(n, n)
        (U,) = sess.run(None, {"A": A, "R": R})
        want = np.linalg.solve(np.eye(n) + A.astype(np.float64), R.astype(np.float64))
        assert U.shape == want.shape
        # the blocked form's error here is <= 1e-6 of the largest entry; one 16-row product's 2-4e-5
        assert np.abs(U - want).max() <= 5e-6 * max(1.0, np.abs(want).max()), n


# ---------------------------------------------------------------- conv

C_CONV, K_CONV = 11, 4


def conv_case(n: int, seed: int):
    """x [n, C], state [C, K-1], w [C, K]."""
    r = np.random.default_rng(seed)
    return (r.standard_normal((n, C_CONV)).astype(np.float32),
            r.standard_normal((C_CONV, K_CONV - 1)).astype(np.float32),
            r.standard_normal((C_CONV, K_CONV)).astype(np.float32))


def hf_conv(x, state, w):
    """transformers' decode-time conv, one token at a time: (y [n, C], state [C, K-1]). It keeps a
    K-column state whose first column is never read."""
    hf_state = torch.from_numpy(np.concatenate([np.zeros((C_CONV, 1), np.float32), state], 1))[None].clone()
    ys = [M5.causal_conv1d_update(torch.from_numpy(x[t])[None, :, None], hf_state, torch.from_numpy(w), None, "silu")
          for t in range(len(x))]
    return torch.cat(ys, -1)[0].T.numpy(), hf_state[0, :, 1:].numpy()


def test_short_conv_numpy_vs_transformers_vs_onnx():
    n = 9
    x, state, w = conv_case(n, seed=0)
    y_ref, new_ref = conv.short_conv_ref(x, state, w)
    hf_y, hf_state = hf_conv(x, state, w)
    np.testing.assert_allclose(hf_y, y_ref, atol=1e-5)
    np.testing.assert_allclose(hf_state, new_ref, atol=1e-6)
    g = GraphBuilder("conv")
    xi, si = g.input("x", np.float32, [n, C_CONV]), g.input("s", np.float32, [C_CONV, K_CONV - 1])
    sel = g.input("sel", np.float32, [K_CONV - 1, K_CONV - 1 + n])
    y, new = conv.emit_short_conv(g, xi, si, g.const(w.T.copy()), n, K_CONV, sel, None)
    g.output(y, "y", np.float32, [n, C_CONV])
    g.output(new, "new", np.float32, [C_CONV, K_CONV - 1])
    for valid in (n, 5):
        y_o, new_o = run_graph(g, {"x": x, "s": state, "sel": conv.chain_state_select(valid, n, K_CONV)})
        np.testing.assert_allclose(y_o, y_ref, atol=1e-5)
        np.testing.assert_allclose(new_o, conv.short_conv_ref(x, state, w, valid)[1], atol=1e-6)


def test_short_conv_cpu_step_matches_reference_and_transformers():
    """The decode graph's CausalConvWithState form over consecutive tokens, state carried between."""
    n = 5
    x, state, w = conv_case(n, seed=3)
    hf_y, hf_state = hf_conv(x, state, w)
    y_ref, state_ref = conv.short_conv_ref(x, state, w)
    g = GraphBuilder("conv_cpu")
    xi, si = g.input("x", np.float32, [1, C_CONV]), g.input("s", np.float32, [C_CONV, K_CONV - 1])
    y, new = conv.emit_short_conv_step_cpu(g, xi, si, g.const(w.T.copy()))
    g.output(y, "y", np.float32, [1, C_CONV])
    g.output(new, "new", np.float32, [C_CONV, K_CONV - 1])
    assert any(node.op_type == "CausalConvWithState" for node in g.nodes)
    ys, s = [], state
    for t in range(n):
        y_t, s = run_graph(g, {"x": x[t: t + 1], "s": s})
        ys.append(y_t[0])
    np.testing.assert_allclose(np.stack(ys), hf_y, atol=1e-5)
    np.testing.assert_allclose(np.stack(ys), y_ref, atol=1e-5)
    np.testing.assert_allclose(s, state_ref, atol=1e-6)
    np.testing.assert_allclose(s, hf_state, atol=1e-6)


def test_short_conv_cpu_any_n_matches_reference_and_transformers():
    """The any-N CPU graph's form (plain slices counted from the end, the state picked among the
    valid inputs): one graph with N dynamic, run for a 9-token chunk (all valid, and 5 valid then
    padding) and for one token, against the definition and transformers' decode-time conv."""
    n = 9
    x, state, w = conv_case(n, seed=5)
    hf_y, hf_state = hf_conv(x, state, w)
    g = GraphBuilder("conv_any_n")
    xi, si = g.input("x", np.float32, ["n", C_CONV]), g.input("s", np.float32, [C_CONV, K_CONV - 1])
    sel = g.input("sel", np.float32, [K_CONV - 1, "k_minus_1_plus_n"])
    y, new = conv.emit_short_conv_cpu(g, xi, si, g.const(w.T.copy()), sel, K_CONV)
    g.output(y, "y", np.float32, ["n", C_CONV])
    g.output(new, "new", np.float32, [C_CONV, K_CONV - 1])
    for valid in (n, 5):
        y_o, new_o = run_graph(g, {"x": x, "s": state, "sel": conv.chain_state_select(valid, n, K_CONV)})
        np.testing.assert_allclose(y_o[:valid], hf_y[:valid], atol=1e-5)
        np.testing.assert_allclose(new_o, conv.short_conv_ref(x, state, w, valid)[1], atol=1e-6)
    np.testing.assert_allclose(new_o, hf_conv(x[:5], state, w)[1], atol=1e-6)
    y1, new1 = run_graph(g, {"x": x[:1], "s": state, "sel": conv.chain_state_select(1, 1, K_CONV)})
    np.testing.assert_allclose(y1, hf_y[:1], atol=1e-5)
    np.testing.assert_allclose(new1, hf_conv(x[:1], state, w)[1], atol=1e-6)


def test_tree_conv_reads_each_nodes_own_path():
    parents = tree_parents()
    n = len(parents)
    x, state, w = conv_case(n, seed=1)
    y_tree = conv.tree_conv_ref(x, state, w, parents)
    g = GraphBuilder("tconv")
    xi, si = g.input("x", np.float32, [n, C_CONV]), g.input("s", np.float32, [C_CONV, K_CONV - 1])
    ts = g.input("ts", np.float32, [K_CONV - 1, n, K_CONV - 1 + n])
    y, _ = conv.emit_short_conv(g, xi, si, g.const(w.T.copy()), n, K_CONV, None, ts)
    g.output(y, "y", np.float32, [n, C_CONV])
    (y_onnx,) = run_graph(g, {"x": x, "s": state, "ts": conv.tree_conv_select(parents, K_CONV)})
    for m in range(n):
        path = root_path(parents, m)
        y_chain, _ = conv.short_conv_ref(x[path], state, w)
        np.testing.assert_allclose(y_tree[m], y_chain[-1], atol=1e-6)
        np.testing.assert_allclose(y_onnx[m], y_chain[-1], atol=1e-5)


# ---------------------------------------------------------------- norms, rope, attention

def test_norms_numpy_vs_transformers_vs_onnx():
    r = np.random.default_rng(2)
    x = r.standard_normal((7, 3, 10)).astype(np.float32)
    z = r.standard_normal((7, 3, 10)).astype(np.float32)
    w = (r.standard_normal(10) * 0.3).astype(np.float32)
    hf1 = M5.Qwen3_5RMSNorm(10, eps=1e-6)
    hf1.weight.data = torch.from_numpy(w)
    hfg = M5.Qwen3_5RMSNormGated(10, eps=1e-6)
    hfg.weight.data = torch.from_numpy(1 + w)
    with torch.no_grad():
        want1 = hf1(torch.from_numpy(x)).numpy()
        wantg = hfg(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(norms.rmsnorm_1p_ref(x, w, 1e-6), want1, atol=1e-5)
    np.testing.assert_allclose(norms.gated_rmsnorm_ref(x, z, 1 + w, 1e-6), wantg, atol=1e-5)
    g = GraphBuilder("norms")
    xi, zi = g.input("x", np.float32, [7, 3, 10]), g.input("z", np.float32, [7, 3, 10])
    g.output(norms.emit_rmsnorm_1p(g, xi, g.const(w), 1e-6), "a", np.float32, [7, 3, 10])
    g.output(norms.emit_gated_rmsnorm(g, xi, zi, g.const(1 + w), 1e-6), "b", np.float32, [7, 3, 10])
    a, b = run_graph(g, {"x": x, "z": z})
    np.testing.assert_allclose(a, want1, atol=1e-5)
    np.testing.assert_allclose(b, wantg, atol=1e-5)


def test_cpu_kernel_norms_match_reference_and_transformers():
    """The CPU graphs' fused forms: RMSNormalization, SkipSimplifiedLayerNormalization
    (residual add + norm) and GatedRMSNorm on packed heads [N, H·Dv]."""
    r = np.random.default_rng(4)
    x, d, z = (r.standard_normal((7, 3, 10)).astype(np.float32) for _ in range(3))
    w = (r.standard_normal(10) * 0.3).astype(np.float32)
    hf1, hfg = M5.Qwen3_5RMSNorm(10, eps=1e-6), M5.Qwen3_5RMSNormGated(10, eps=1e-6)
    hf1.weight.data, hfg.weight.data = torch.from_numpy(w), torch.from_numpy(1 + w)
    with torch.no_grad():
        want1 = hf1(torch.from_numpy(x)).numpy()
        want_sum = hf1(torch.from_numpy(x + d)).numpy()
        wantg = hfg(torch.from_numpy(x), torch.from_numpy(z)).numpy().reshape(7, 30)
    g = GraphBuilder("norms_cpu")
    xi, di, zi = (g.input(k, np.float32, [7, 3, 10]) for k in "xdz")
    g.output(norms.emit_rmsnorm_1p_cpu(g, xi, g.const(w), 1e-6), "a", np.float32, [7, 3, 10])
    total, normed = norms.emit_add_rmsnorm_1p_cpu(g, xi, di, g.const(w), 1e-6)
    g.output(total, "total", np.float32, [7, 3, 10])
    g.output(normed, "normed", np.float32, [7, 3, 10])
    packed = norms.emit_gated_rmsnorm_cpu(g, g.reshape(xi, [7, 30]), g.reshape(zi, [7, 30]), g.const(1 + w), 1e-6, 10)
    g.output(packed, "b", np.float32, [7, 30])
    assert {n.op_type for n in g.nodes} >= {"RMSNormalization", "SkipSimplifiedLayerNormalization"}
    a, tot, nd, b = run_graph(g, {"x": x, "d": d, "z": z})
    np.testing.assert_allclose(a, want1, atol=1e-5)
    np.testing.assert_allclose(a, norms.rmsnorm_1p_ref(x, w, 1e-6), atol=1e-5)
    np.testing.assert_allclose(tot, x + d, atol=1e-6)
    np.testing.assert_allclose(nd, want_sum, atol=1e-5)
    np.testing.assert_allclose(b, wantg, atol=1e-5)
    np.testing.assert_allclose(b, norms.gated_rmsnorm_ref(x, z, 1 + w, 1e-6).reshape(7, 30), atol=1e-5)


def test_cpu_softplus_is_exact_where_the_decay_needs_it():
    """CPU graphs take ONNX Runtime's Softplus for the decay (the NPU graphs carry their own, the
    HTP's being off by ~9%): exact to fp32 rounding over the range the gate input spans."""
    x = np.linspace(-40, 40, 4001, dtype=np.float32)
    g = GraphBuilder("softplus")
    g.output(g.op("Softplus", g.input("x", np.float32, [x.size])), "y", np.float32, [x.size])
    (y,) = run_graph(g, {"x": x})
    want = np.logaddexp(0.0, x.astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-30)


def test_rope_rows_from_a_kept_block_are_the_rows_computed_alone():
    rows = rope.RopeRows(6, 1e7)
    # a decode run across block edges, a chain crossing one, a jump back and one far ahead
    asks = [(p, 1) for p in range(0, 2 * rope.ROPE_BLOCK + 3)] + [(rope.ROPE_BLOCK - 2, 5), (3, 4),
                                                                   (70000, 1), (70000 + rope.ROPE_BLOCK - 1, 600)]
    for start, n in asks:
        cos, sin = rows(start, n)
        want_cos, want_sin = rope.rope_tables(np.arange(start, start + n), 6, 1e7)
        assert cos.shape == (n, 6) and np.array_equal(cos, want_cos) and np.array_equal(sin, want_sin), (start, n)
    with pytest.raises(ValueError):  # the kept block is shared: nobody may write into it
        rows(5, 1)[0][0, 0] = 1.0


def test_partial_rope_numpy_vs_transformers_vs_onnx():
    from transformers import Qwen3_5TextConfig

    hd, theta = 24, 1e7
    cfg = Qwen3_5TextConfig(hidden_size=48, num_attention_heads=4, head_dim=hd, rope_parameters={
        "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 1],
        "mrope_interleaved": True})
    positions = np.array([0, 1, 7, 1000, 70000])
    emb = M5.Qwen3_5TextRotaryEmbedding(cfg)
    x = np.random.default_rng(4).standard_normal((5, 3, hd)).astype(np.float32)
    with torch.no_grad():
        cos_t, sin_t = emb(torch.zeros(1), torch.from_numpy(positions)[None])
        q_hf, _ = M5.apply_rotary_pos_emb(torch.from_numpy(x).transpose(0, 1)[None], torch.from_numpy(x).transpose(0, 1)[None],
                                          cos_t, sin_t)
    cos, sin = rope.rope_tables(positions, 6, theta)
    # transformers' angle (position x inv_freq, both fp32), its cos/sin evaluated in float64
    inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, 6, 2).astype(np.float32) / np.float32(6)))
    angles = (positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(np.concatenate([angles, angles], -1)), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(np.concatenate([angles, angles], -1)), atol=1e-6)
    # torch's vectorised fp32 cos/sin lose accuracy on huge arguments (70,000 rad: 3e-5 to 5e-5 seen,
    # by CPU); below that they agree to 1e-6
    short = positions < 4096
    np.testing.assert_allclose(cos[short], cos_t[0].numpy()[short], atol=1e-6)
    np.testing.assert_allclose(sin[short], sin_t[0].numpy()[short], atol=1e-6)
    np.testing.assert_allclose(cos, cos_t[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(sin, sin_t[0].numpy(), atol=1e-4)
    want = q_hf[0].transpose(0, 1).numpy()
    np.testing.assert_allclose(rope.partial_rope_ref(x, cos, sin)[short], want[short], atol=1e-5)
    np.testing.assert_allclose(rope.partial_rope_ref(x, cos, sin), want, atol=1e-3)
    g = GraphBuilder("rope")
    xi = g.input("x", np.float32, [5, 3, hd])
    c, s = g.input("c", np.float32, [5, 6]), g.input("s", np.float32, [5, 6])
    g.output(rope.emit_partial_rope(g, xi, g.unsqueeze(c, [1]), g.unsqueeze(s, [1]), hd, 6), "y", np.float32, [5, 3, hd])
    (y,) = run_graph(g, {"x": x, "c": cos, "s": sin})
    np.testing.assert_allclose(y, rope.partial_rope_ref(x, cos, sin), atol=1e-6)  # the graph is the reference's
    np.testing.assert_allclose(y[short], want[short], atol=1e-5)


@pytest.mark.parametrize("n", [1, 5, attention.VALUE_ROWS_MAX_N + 3])  # both forms of the values' product
def test_gqa_attention_numpy_vs_torch_vs_onnx(n):
    r = np.random.default_rng(5)
    nh, nkv, hd, past = 6, 2, 8, 9
    q = r.standard_normal((n, nh, hd)).astype(np.float32)
    keys = r.standard_normal((nkv, past + n, hd)).astype(np.float32)
    values = r.standard_normal((nkv, past + n, hd)).astype(np.float32)
    mask = np.zeros((n, past + n), np.float32)
    mask[:, 3:past] = attention.MASKED  # some past rows invalid
    mask[:, past:] = np.where(np.tril(np.ones((n, n))) > 0, 0, attention.MASKED)
    ref = attention.gqa_attention_ref(q, keys, values, mask)
    kt = M5.repeat_kv(torch.from_numpy(keys)[None], nh // nkv)
    vt = M5.repeat_kv(torch.from_numpy(values)[None], nh // nkv)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1)[None], kt, vt, attn_mask=torch.from_numpy(mask))[0].transpose(0, 1).numpy()
    np.testing.assert_allclose(ref, want, atol=1e-5)
    g = GraphBuilder("attn")
    qi = g.input("q", np.float32, [n, nh, hd])
    pk, pv = g.input("pk", np.float32, [nkv, past, hd]), g.input("pv", np.float32, [nkv, hd, past])  # values transposed
    nk, nv = g.input("nk", np.float32, [nkv, n, hd]), g.input("nv", np.float32, [nkv, n, hd])
    mi = g.input("m", np.float32, [n, past + n])
    g.output(attention.emit_gqa_attention(g, qi, pk, pv, nk, nv, mi, n=n, nh=nh, nkv=nkv, hd=hd), "o", np.float32,
             [n, nh, hd])
    (o,) = run_graph(g, {"q": q, "pk": keys[:, :past], "pv": values[:, :past].transpose(0, 2, 1).copy(), "nk": keys[:, past:],
                         "nv": values[:, past:], "m": mask})
    np.testing.assert_allclose(o, want, atol=1e-5)
    assert math.isfinite(float(o.sum()))


def test_prescaled_norm_is_the_definition_on_massive_and_tiny_rows():
    """The NPU norms divide each row by its max|x| before squaring (fp16-safe): in fp32 that is the
    definition, on rows with channels at 300..60,000, unit rows, tiny rows and a zero row."""
    r = np.random.default_rng(5)
    x = r.standard_normal((6, 48)).astype(np.float32)
    x[0, 3], x[1, 17], x[2, 30] = 300.0, -20000.0, 60000.0
    x[3] *= 1e-5
    x[4] = 0.0
    w = (r.standard_normal(48) * 0.3).astype(np.float32)
    hf = M5.Qwen3_5RMSNorm(48, eps=1e-6)
    hf.weight.data = torch.from_numpy(w)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(norms._normalize_prescaled(x.astype(np.float64), 1e-6) * (1 + w), want, atol=1e-5)
    g = GraphBuilder("norm_massive")
    g.output(norms.emit_rmsnorm_1p(g, g.input("x", np.float32, [6, 48]), g.const(w), 1e-6), "a", np.float32, [6, 48])
    (a,) = run_graph(g, {"x": x})
    np.testing.assert_allclose(a, want, atol=1e-5)


def test_plain_rmsnorm_numpy_vs_transformers_vs_onnx():
    """The drafter's Llama RMSNorm (x̂·w): numpy, transformers' LlamaRMSNorm and the ONNX graph."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (np.random.default_rng(5).standard_normal((7, 32)) * 3).astype(np.float32)
    w = np.random.default_rng(6).standard_normal(32).astype(np.float32)
    ref = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        want = ref(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(norms.rmsnorm_ref(x, w, 1e-5), want, atol=1e-5)
    g = GraphBuilder("rms")
    xi, wi = g.input("x", np.float32, [7, 32]), g.input("w", np.float32, [32])
    g.output(norms.emit_rmsnorm(g, xi, wi, 1e-5), "y", np.float32, [7, 32])
    (y,) = run_graph(g, {"x": x, "w": w})
    np.testing.assert_allclose(y, want, atol=1e-5)
