"""Short causal depthwise conv with state (docs/qwen35-model.md, Gated DeltaNet step 2; docs/delta-rule.md).

Token-major: inputs x [N, C] (pre-conv q|k|v), weight w [C, K], state [C, K-1] with columns
oldest first (transformers keeps K columns and never reads the first; we keep K-1).

Chain: token t reads the K-1 inputs before it, falling back into the state. Tree: node i at
depth d reads its s-th ancestor for s <= d, else state column (K-1) - (s - d).
"""
from __future__ import annotations

import numpy as np

from .graph import MS_DOMAIN, GraphBuilder


def _silu(x):
    return x / (1.0 + np.exp(-x))


def short_conv_ref(x: np.ndarray, state: np.ndarray, w: np.ndarray, n_valid: int | None = None):
    """Chain form. Returns (silu(conv) [N, C], new state [C, K-1] after the first n_valid tokens)."""
    n = x.shape[0] if n_valid is None else n_valid
    k = w.shape[1]
    X = np.concatenate([state.T, x], axis=0)  # [K-1+N, C]
    y = sum(w[:, j] * X[j: j + x.shape[0]] for j in range(k))
    return _silu(y), X[n: n + k - 1].T.copy()


def tree_conv_windows(parents: list[int], k: int) -> np.ndarray:
    """For each node and s = 1..K-1, the row of [state columns ; node inputs] it reads.

    Row r < K-1 is state column r; row K-1+j is node j's input. Shape [K-1, N] (int64).
    """
    n = len(parents)
    rows = np.zeros((k - 1, n), dtype=np.int64)
    for i in range(n):
        anc, depth = [], 0
        p = parents[i]
        while p >= 0:
            anc.append(p)
            p = parents[p]
        depth = len(anc)
        for s in range(1, k):
            rows[s - 1, i] = (k - 1) + anc[s - 1] if s <= depth else (k - 1) - (s - depth)
    return rows


def tree_conv_ref(x: np.ndarray, state: np.ndarray, w: np.ndarray, parents: list[int]) -> np.ndarray:
    k = w.shape[1]
    X = np.concatenate([state.T, x], axis=0)
    rows = tree_conv_windows(parents, k)
    y = w[:, k - 1] * x
    for s in range(1, k):
        y = y + w[:, k - 1 - s] * X[rows[s - 1]]
    return _silu(y)


def tree_conv_select(parents: list[int], k: int) -> np.ndarray:
    """One-hot selection matrices [K-1, N, K-1+N] for the tree form: pure MatMul on the NPU."""
    rows = tree_conv_windows(parents, k)
    n = len(parents)
    sel = np.zeros((k - 1, n, k - 1 + n), dtype=np.float32)
    for s in range(k - 1):
        sel[s, np.arange(n), rows[s]] = 1.0
    return sel


def chain_state_select(n_valid: int, n: int, k: int) -> np.ndarray:
    """[K-1, K-1+N] one-hot rows picking the new state: the last K-1 inputs among the valid ones."""
    sel = np.zeros((k - 1, k - 1 + n), dtype=np.float32)
    sel[np.arange(k - 1), n_valid + np.arange(k - 1)] = 1.0
    return sel


def emit_short_conv(g: GraphBuilder, x: str, state: str, w_kc: str, n: int, k: int,
                    state_select: str | None, tree_select: str | None):
    """x [N, C], state [C, K-1], w_kc [K, C] (transposed at export). Returns (y [N, C], new state or None).

    state_select [K-1, K-1+N] picks the new state (None: N == 1, a constant shift);
    tree_select [K-1, N, K-1+N] switches to the tree form (no state output: the host commits).
    Either may come split already (a graph that runs this under Ifs picks them once, outside):
    w_kc as its K rows [1, C], tree_select as its K-1 selections [N, K-1+N].
    """
    X = g.op("Concat", g.transpose(state, [1, 0]), x, axis=0)  # [K-1+N, C]
    w_rows = w_kc if isinstance(w_kc, list) else [g.slice(w_kc, j, j + 1, axis=0) for j in range(k)]  # each [1, C]
    if tree_select is None:
        terms = [g.op("Mul", g.slice(X, j, j + n, axis=0), w_rows[j]) for j in range(k)]
    else:
        terms = [g.op("Mul", x, w_rows[k - 1])]
        for s in range(1, k):
            pick = tree_select[s - 1] if isinstance(tree_select, list) else \
                g.op("Gather", tree_select, g.const(np.int64(s - 1), np.int64), axis=0)
            picked = g.matmul(pick, X)
            terms.append(g.op("Mul", picked, w_rows[k - 1 - s]))
    y = terms[0]
    for t in terms[1:]:
        y = g.op("Add", y, t)
    y = g.silu(y)
    if tree_select is not None:
        return y, None
    if state_select is None:
        new_state = g.slice(X, n, n + k - 1, axis=0)
    else:
        new_state = g.matmul(state_select, X)
    return y, g.transpose(new_state, [1, 0])


def emit_short_conv_step_cpu(g: GraphBuilder, x: str, state: str, w_kc: str):
    """One token (decode) through ONNX Runtime's CPU kernel CausalConvWithState: the fastest form
    measured for one token (18 layers at Qwen3.5-0.8B shapes: 1.18 ms, against 1.30 for Concat·w +
    ReduceSum and 3.3 for the plain slices; docs/performance.md). Its SiLU is not fused: the kernel's
    own activation="silu" took 0.76-0.88 ms for those 18 layers against 0.53-0.64 ms for the conv
    alone plus Sigmoid·x (ORT's vectorised logistic), same values within 2e-6. x [1, C], state [C, K-1],
    w_kc [K, C]; returns (y [1, C], new state [C, K-1]) as emit_short_conv does."""
    w = g.unsqueeze(g.transpose(w_kc, [1, 0]), [1])  # [C, 1, K]: constant, folded at load
    y, new_state = g.op("CausalConvWithState", g.reshape(x, [1, -1, 1]), w, "", g.unsqueeze(state, [0]), n_out=2,
                        domain=MS_DOMAIN, activation="none")
    return g.silu(g.reshape(y, [1, -1])), g.op("Squeeze", new_state, g.ints([0]))


def emit_short_conv_cpu(g: GraphBuilder, x: str, state: str, w_kc: str, state_select: str, k: int):
    """A chunk of N tokens (the any-N CPU graph's; N may be dynamic) in plain ops, channels-last as x
    lies: y = silu(sum_j X[j : j+N] * w[j]) over X = [state columns; x], each slice's end counted
    from X's end so one graph serves any N. Not CausalConvWithState, whose CPU kernel runs a chunk
    ~4x slower: 18 layers at Qwen3.5-0.8B shapes, N = 128, 120 vs 27 ms (docs/performance.md); for
    one token it is the faster one (emit_short_conv_step_cpu).
    The new state is picked by state_select [K-1, K-1+N] among [state columns; inputs] (a chunk
    may end in padding), as in emit_short_conv.
    x [N, C], state [C, K-1], w_kc [K, C]; returns (y [N, C], new state [C, K-1])."""
    X = g.op("Concat", g.transpose(state, [1, 0]), x, axis=0)  # [K-1+N, C], oldest first
    y = g.op("Mul", x, g.slice(w_kc, k - 1, k, axis=0))  # the last tap's window is x itself: no slice copy
    for j in range(k - 1):
        y = g.op("Add", y, g.op("Mul", g.slice(X, j, j - (k - 1), axis=0), g.slice(w_kc, j, j + 1, axis=0)))
    new_state = g.matmul(state_select, X)
    return g.silu(y), g.transpose(new_state, [1, 0])
