"""Gated delta rule over N new tokens (docs/qwen35-model.md; docs/delta-rule.md).

Inputs per token, token-major: q, k [N, Hk, Dk], v [N, Hv, Dv], g (log decay, <= 0) and β [N, Hv];
incoming state S [Hv, Dk, Dv] (fp32). Key heads serve Hv/Hk consecutive value heads
(repeat_interleave, docs/qwen35-model.md trap 4); q̂ = l2n(q)·Dk^-1/2, k̂ = l2n(k).

Masked form for an ancestor mask M (M[i,j] = 1 iff j = i or j is an ancestor of i; causal =
lower-triangular ones), one value head:
    G = M·g                   D[i,j] = exp(G_i - G_j) where M[i,j] else 0
    A = β ⊙rows ((K̂K̂ᵀ) ⊙ D ⊙ strict(M))
    U = (I + A)⁻¹ · β ⊙rows (V - e^G ⊙rows (K̂·S))
    O = e^G ⊙rows (Q̂·S) + ((Q̂K̂ᵀ) ⊙ D) · U
    S_after(path ending at m) = e^{G_m}·S + Σ_{j ∈ path(m)} e^{G_m - G_j} k̂_j u_jᵀ
(I + A) is unit lower-triangular in topological order; the ONNX form solves it by 8×8 diagonal
blocks (exact nilpotent product inside a block) merged by block forward substitution, never by
high powers of A over the whole chunk (docs/qwen35-model.md trap 8: fp32 blows up on correlated keys).
"""
from __future__ import annotations

import math

import numpy as np

from .graph import MS_DOMAIN, GraphBuilder

L2_EPS = 1e-6
STATE_SCALED_PEAK = 64.0  # the largest |S| or |V| entry the chunked form computes with (see emit_gated_delta)


def _l2n(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def normalize_qk(q, k, num_v_heads: int):
    """q̂, k̂ [N, Hv, Dk]: l2-normalised, q scaled by Dk^-1/2, key heads repeated to value heads."""
    r = num_v_heads // q.shape[1]
    qh = np.repeat(_l2n(q), r, axis=1) / math.sqrt(q.shape[-1])
    kh = np.repeat(_l2n(k), r, axis=1)
    return qh, kh


def gated_delta_recurrent_ref(q, k, v, g, beta, S):
    """Token loop, the definition: returns (o [N, Hv, Dv], S_final)."""
    qh, kh = normalize_qk(q, k, v.shape[1])
    S = S.copy()
    out = np.zeros_like(v)
    for t in range(v.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", S, kh[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + kh[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, qh[t])
    return out, S


def gated_delta_masked_ref(q, k, v, g, beta, S, M):
    """The masked N-token form. Returns (o [N, Hv, Dv], commit) with commit = (k̂ [N,Hv,Dk],
    u [N,Hv,Dv], G [N,Hv]) for commit_state_ref."""
    qh, kh = normalize_qk(q, k, v.shape[1])
    n = v.shape[0]
    M = M.astype(v.dtype)
    strict = M * (1 - np.eye(n, dtype=v.dtype))
    out = np.zeros_like(v)
    U = np.zeros_like(v)
    G = (M @ g)  # [N, Hv]
    for h in range(v.shape[1]):
        Gh = G[:, h]
        D = np.where(M > 0, np.exp(np.where(M > 0, Gh[:, None] - Gh[None, :], 0.0)), 0.0)
        Kh, Qh = kh[:, h], qh[:, h]
        A = beta[:, h, None] * ((Kh @ Kh.T) * D * strict)
        R = beta[:, h, None] * (v[:, h] - np.exp(Gh)[:, None] * (Kh @ S[h]))
        U[:, h] = np.linalg.solve(np.eye(n, dtype=v.dtype) + A, R)
        out[:, h] = np.exp(Gh)[:, None] * (Qh @ S[h]) + ((Qh @ Kh.T) * D) @ U[:, h]
    return out, (kh, U, G)


def commit_state_ref(S, commit, path: list[int], out=None):
    """State after the tokens on `path` (root first): e^{G_m}·S + Σ_j e^{G_m - G_j} k̂_j u_jᵀ, in the
    dtype of its inputs. The runtime commits a verified path with this very function
    (runtime/speculative.commit_path); the tests hold it against the sequential recurrence.
    With `out` (which may be S itself) the sum is written there instead of into new arrays."""
    kh, U, G = commit
    m, idx = path[-1], np.asarray(path)
    w = np.exp(G[m][None, :] - G[idx])  # [len, Hv]: the decay after each token on the path
    # Σ_j w_j k̂_j u_jᵀ per head as one batched product [Hv, Dk, len] @ [Hv, len, Dv]: 4-5x faster than
    # the three-operand einsum (0.8B shapes: 0.71 -> 0.17 ms a layer, 18 layers a round)
    weighted = (kh[idx] * w[:, :, None]).transpose(1, 2, 0)
    update = weighted @ U[idx].transpose(1, 0, 2)
    decay = np.exp(G[m])[:, None, None]
    if out is None:
        return decay * S + update
    # in place: no fresh [Hv, Dk, Dv] arrays a layer (18 layers of the 0.8B, a
    # 2-node path, ~2.3 -> ~1.8 ms in a /tmp timing)
    np.multiply(S, decay, out=out)
    out += update
    return out


# ---------------------------------------------------------------- ONNX formulation

def _emit_l2n(g: GraphBuilder, x: str) -> str:
    ss = g.op("ReduceSum", g.op("Mul", x, x), g.ints([-1]), keepdims=1)
    return g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", ss, g.const(L2_EPS)))))


def _emit_l2n_fused(g: GraphBuilder, x: str, d: int, scale: float = 1.0) -> str:
    """scale·l2n(x) over the last axis (length d) in one RMSNormalization (opset 23, fp32 graphs):
    l2n(x) = x / sqrt(Σx² + ε) = RMSNorm(x; ε/d)·d^-1/2."""
    g.require_opset(23)
    return g.op("RMSNormalization", x, g.const(np.full(d, scale / math.sqrt(d), np.float32)), axis=-1,
                epsilon=L2_EPS / d)


def _emit_repeat_heads(g: GraphBuilder, x: str, n: int | None, hk: int, r: int, d: int) -> str:
    """n None: any token count (Expand broadcasts the token axis)."""
    if r == 1:
        return x
    rows = -1 if n is None else n
    x4 = g.reshape(x, [rows, hk, 1, d])
    return g.reshape(g.op("Expand", x4, g.ints([1 if n is None else n, hk, r, d])), [rows, hk * r, d])


SOLVE_BLOCK = 8  # the masked solve's diagonal blocks; a core for any count takes up to twice this many rows
SLICE_END = 2**62  # a Slice's end past any row: to the end, whatever the count


def emit_solve_eye_blocks(g: GraphBuilder, eye: str) -> tuple[str, str]:
    """The call's [n, n] identity as emit_unit_lower_solve takes it for up to 2·SOLVE_BLOCK nodes: its
    first SOLVE_BLOCK rows and columns, and the rest (empty in a smaller call)."""
    b = SOLVE_BLOCK
    return g.slice(g.slice(eye, 0, b, 0), 0, b, 1), g.slice(g.slice(eye, b, SLICE_END, 0), b, SLICE_END, 1)


def _emit_block_inverse(g: GraphBuilder, a: str, eye: str, size: int) -> str:
    """(I + a)⁻¹ of strictly lower-triangular blocks of up to `size` rows: (I-N)(I+N²)...(I+N^(size/2)),
    N = a, exact since N^size = 0."""
    neg = g.op("Neg", a)
    inv, power = g.op("Add", eye, neg), neg
    for _ in range(int(math.log2(size)) - 1):
        power = g.matmul(power, power)
        inv = g.matmul(inv, g.op("Add", eye, power))
    return inv


def emit_unit_lower_solve(g: GraphBuilder, A: str, R: str, heads: int, n: int | None, dv: int, block: int = SOLVE_BLOCK,
                          eye: str | tuple[str, str] | None = None) -> str:
    """U = (I + A)⁻¹ R for A [H, n, n] strictly lower-triangular, R [H, n, dv].

    Diagonal b×b blocks are inverted at once (batched) by the exact product (I-N)(I+N²)(I+N⁴),
    which stays bounded inside a block; the blocks are then merged by forward substitution.
    n None: any count, the shapes the call's. `eye` the call's [n, n] identity: up to `block`
    nodes, one block as it comes (N^block = 0 for any such n, so the same product is exact). `eye`
    a pair, the identity's first `block` rows and columns and the rest: up to 2·`block` nodes, the
    rows past `block` (none in a smaller call: empty tensors) a second block, merged as above. Not
    one 16-row product: on keys nearly all alike its powers grow to ~C(16, 8) before they cancel,
    and its error was 30-80x the blocked form's (2-4e-5 against 5-7e-7 of the largest entry).
    """
    if n is None:
        if eye is None:
            raise ValueError("a solve for any count needs the call's identity (eye)")

        if isinstance(eye, str):
            return g.matmul(_emit_block_inverse(g, A, eye, block), R)
        head = lambda t, axis: g.slice(t, 0, block, axis)  # noqa: E731  (clamped: every row of a smaller call)
        tail = lambda t, axis: g.slice(t, block, SLICE_END, axis)  # noqa: E731
        u_top = g.matmul(_emit_block_inverse(g, head(head(A, 1), 2), eye[0], block), head(R, 1))
        rhs = g.op("Sub", tail(R, 1), g.matmul(head(tail(A, 1), 2), u_top))
        u_low = g.matmul(_emit_block_inverse(g, tail(tail(A, 1), 2), eye[1], block), rhs)
        return g.op("Concat", u_top, u_low, axis=1)
    if n == 1:
        return R
    b = min(block, 1 << (n - 1).bit_length())
    nb = -(-n // b)
    m = nb * b
    if m != n:  # pad with an identity tail: the padded rows solve to 0
        A = g.op("Pad", A, g.ints([0, 0, 0, 0, m - n, m - n]))
        R = g.op("Pad", R, g.ints([0, 0, 0, 0, m - n, 0]))
    eye_blocks = np.eye(nb, dtype=np.float32).reshape(1, nb, 1, nb, 1)
    diag = g.op("ReduceSum", g.op("Mul", g.reshape(A, [heads, nb, b, nb, b]), g.const(eye_blocks)),
                g.ints([3]), keepdims=0)  # [H, nb, b, b]
    inv = _emit_block_inverse(g, diag, g.const(np.eye(b, dtype=np.float32)), b)
    inv_blocks = g.split(inv, [1] * nb, axis=1) if nb > 1 else [inv]
    r_blocks = g.split(R, [b] * nb, axis=1) if nb > 1 else [R]
    solved: list[str] = []
    for i in range(nb):
        t_i = g.reshape(inv_blocks[i], [heads, b, b])
        rhs = r_blocks[i]
        if i > 0:
            a_row = g.slice(g.slice(A, i * b, (i + 1) * b, axis=1), 0, i * b, axis=2)
            prev = solved[0] if i == 1 else g.op("Concat", *solved, axis=1)
            rhs = g.op("Sub", rhs, g.matmul(a_row, prev))
        solved.append(g.matmul(t_i, rhs))
    U = solved[0] if nb == 1 else g.op("Concat", *solved, axis=1)
    return U if m == n else g.slice(U, 0, n, axis=1)


def emit_gated_delta(g: GraphBuilder, q: str, k: str, v: str, gate: str, beta: str, S: str,
                     mask: str, mask_t: str, strict_mask: str, *, n: int, hk: int, hv: int, dk: int, dv: int,
                     chain_state: bool, state_unit: str | None = None, fp16_guards: bool = True,
                     eye: str | tuple[str, str] | None = None):
    """Returns (o [N, Hv, Dv], S_after of the last token or None, commit (k̂, u, G) token-major).

    mask / mask_t / strict_mask [N, N]: M, Mᵀ and M without its diagonal (constants for a chain,
    graph inputs for a tree). chain_state: emit S_after for the last token (chain graphs).
    state_unit [Hv, 1, 1] (>= 1): S comes in these units per head and o, S_after and u go out in
    them (the host picks it so the state it feeds stays below 64: a state, or a readout, beyond
    fp16's 65,504 never exists inside the HTP; the readout's norm takes the unit into its eps).
    fp16_guards=False (an fp32 CPU graph): no σ scaling, and the l2 norms as RMSNormalization
    (l2n(x) = RMSNorm(x; ε/D)·D^-1/2, as emit_gated_delta_cpu): ~25 fewer nodes a layer, same maths.
    n None: any count up to 2·SOLVE_BLOCK, the shapes the call's; eye its [N, N] identity, or for
    more than SOLVE_BLOCK nodes its two diagonal blocks (emit_unit_lower_solve; made once a call by
    the caller, outside any If).
    """
    r = hv // hk
    if fp16_guards:
        qn = g.op("Mul", _emit_l2n(g, q), g.const(1.0 / math.sqrt(dk)))
        kn = _emit_l2n(g, k)
    else:
        qn, kn = _emit_l2n_fused(g, q, dk, 1.0 / math.sqrt(dk)), _emit_l2n_fused(g, k, dk)
    Q = g.transpose(_emit_repeat_heads(g, qn, n, hk, r, dk), [1, 0, 2])  # [Hv, N, Dk]
    K = g.transpose(_emit_repeat_heads(g, kn, n, hk, r, dk), [1, 0, 2])  # [Hv, N, Dk]
    V = g.transpose(v, [1, 0, 2])  # [Hv, N, Dv]
    if state_unit is not None:  # v into the state's units (by 1/√u twice: 1/u can be subnormal in fp16)
        ru = g.op("Reciprocal", g.op("Sqrt", state_unit))
        V = g.op("Mul", g.op("Mul", V, ru), ru)
    # Work in units of σ = max(1, max(|S|, |V|) / 64) per head (everything below is linear in S
    # and V): the products K̂·S, Q̂·S and K̂ᵀU sum Dk or N terms and overflow fp16 on the HTP once
    # the state holds values in the ten thousands (long low-decay context); scaled, no entry
    # exceeds 64. σ = 1 (same arithmetic as unscaled) while values stay below 64. Divided by √σ
    # twice: 1/σ is subnormal in fp16 past 16,000 and the HTP flushes it to 0.
    if fp16_guards:
        peak = g.op("Max", g.op("ReduceMax", g.op("Abs", S), g.ints([1, 2]), keepdims=1),
                    g.op("ReduceMax", g.op("Abs", V), g.ints([1, 2]), keepdims=1))
        sigma = g.op("Max", g.op("Mul", peak, g.const(1.0 / STATE_SCALED_PEAK)), g.const(1.0))
        root = g.op("Sqrt", sigma)  # [Hv, 1, 1]
        r = g.op("Reciprocal", root)
        S, V = g.op("Mul", g.op("Mul", S, r), r), g.op("Mul", g.op("Mul", V, r), r)
        unscale = lambda t: g.op("Mul", g.op("Mul", t, root), root)  # noqa: E731  back to real units
    else:
        unscale = lambda t: t  # noqa: E731
    gT, bT = g.transpose(gate, [1, 0]), g.transpose(beta, [1, 0])  # [Hv, N]
    G = g.matmul(gT, mask_t)  # G_i = Σ_j M[i,j] g_j
    eG = g.unsqueeze(g.safe_exp(G), [2])  # [Hv, N, 1]
    diff = g.op("Sub", g.unsqueeze(G, [2]), g.unsqueeze(G, [1]))
    D = g.op("Mul", g.safe_exp(g.op("Mul", diff, mask)), mask)  # masked before exp: no overflow
    K_t = g.transpose(K, [0, 2, 1])
    b3 = g.unsqueeze(bT, [2])
    R = g.op("Mul", b3, g.op("Sub", V, g.op("Mul", eG, g.matmul(K, S))))
    if n is None or n > 1:
        A = g.op("Mul", b3, g.op("Mul", g.matmul(K, K_t), g.op("Mul", D, strict_mask)))
        U = emit_unit_lower_solve(g, A, R, hv, n, dv, eye=eye)
    else:
        U = R
    O = unscale(g.op("Add", g.op("Mul", eG, g.matmul(Q, S)), g.matmul(g.op("Mul", g.matmul(Q, K_t), D), U)))
    S_after = None
    if chain_state:  # chains have a static count
        G_last = g.slice(G, n - 1, n, axis=1)  # [Hv, 1]
        w = g.unsqueeze(g.safe_exp(g.op("Sub", G_last, G)), [2])  # [Hv, N, 1]
        decayed = g.op("Mul", g.unsqueeze(g.safe_exp(G_last), [2]), S)
        S_after = unscale(g.op("Add", decayed, g.matmul(g.transpose(g.op("Mul", K, w), [0, 2, 1]), U)))
    commit = (g.transpose(K, [1, 0, 2]), g.transpose(unscale(U), [1, 0, 2]), g.transpose(G, [1, 0]))
    return g.transpose(O, [1, 0, 2]), S_after, commit


def emit_gated_delta_cpu(g: GraphBuilder, qk: str, v: str, gate: str, beta: str, S: str, *,
                         n: int, hk: int, hv: int, dk: int, dv: int) -> tuple[str, str]:
    """N tokens of a chain (one, or a chunk) through ONNX Runtime's CPU kernel LinearAttention
    (com.microsoft, update_rule gated_delta: the recurrence of gated_delta_recurrent_ref, token by
    token); the CPU graphs only, the HTP has no such op. qk [N, 2·Hk·Dk] (q then k, as the conv
    gives them), v [N, Hv·Dv], gate / beta [N, Hv], S [Hv, Dk, Dv]; returns (o [N, Hv·Dv], S_after).

    l2n(x) = x / sqrt(Σx² + ε) = RMSNorm(x; ε/D)·D^-1/2: q and k are normalised by one node, and
    the op's own scale (Dk^-1/2) is q's factor. Measured on Qwen3.5-0.8B shapes (2 threads, 18 or 6
    layers, docs/performance.md): as fast as the hand-written one-token step with ~25 fewer nodes a
    layer, and 2.7x faster than the masked chunk form at N = 128 (the recurrence itself, no N×N
    system). LinearAttention's GQA shares a state among query heads, the reverse of Qwen3.5 (one
    key head serves Hv/Hk value heads, each with its own state), so the key heads are repeated."""
    g.require_opset(23)
    r = hv // hk
    qk = _emit_l2n_fused(g, g.reshape(qk, [n, 2 * hk, dk]), dk)
    q, k = g.split(g.reshape(qk, [1, n, 2 * hk * dk]), [hk * dk, hk * dk], axis=-1)
    if r > 1:  # Expand broadcasts the token dim: n may be -1 (dynamic)
        q, k = (g.reshape(g.op("Expand", g.reshape(x, [n, hk, 1, dk]), g.ints([1, hk, r, dk])), [1, n, hv * dk])
                for x in (q, k))
    o, S_after = g.op("LinearAttention", q, k, g.reshape(v, [1, n, hv * dv]), g.unsqueeze(S, [0]),
                      g.reshape(gate, [1, n, hv]), g.reshape(beta, [1, n, hv]), n_out=2, domain=MS_DOMAIN,
                      q_num_heads=hv, kv_num_heads=hv, update_rule="gated_delta", scale=1.0 / math.sqrt(dk))
    return g.reshape(o, [n, hv * dv]), S_after
