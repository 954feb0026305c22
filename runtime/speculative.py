"""One speculative round on a hybrid target (docs/speculation.md): verify a whole draft tree in one pass,
accept a path, and commit the state along it from small per-node tensors, with no re-run.

The verify graph returns for every node its logits, the GDN commit tensors (k̂, u, G per layer
and head), its pre-conv input and its new K/V rows. Committing path m:
    S = e^{G_m}·S + Σ_{j ∈ path} e^{G_m - G_j} k̂_j u_jᵀ        (kernels/delta_rule.py)
    conv state = the last K-1 pre-conv inputs along [old state ; path]
    K/V rows of the path's nodes, written at consecutive positions (their rotary positions were
    already P + depth, so they are right where they land).
"""
from __future__ import annotations

import functools
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.kernels.conv import tree_conv_select
from hybrid_npu.kernels.delta_rule import commit_state_ref

from .sampling import Sampler
from .state import State
from .step_inputs import chain_rows, context_feed


# Draft shapes (runtime/drafters/draft_tree.py propose): EAGLE-2 beam trees; a chain is the tree of width 1.
# The default where an export records none (scripts/train/build_embedded_model.py records the one it
# measured best) follows where rounds verify: on the CPU each verify node costs one more row of every
# weight matmul (0.8B int4: a 4-node verify 1.55-1.64 decode steps, 8 nodes 2.3, 16 nodes 3.9-4.4),
# so a chain, which puts every node on the path most likely accepted; on the NPU the verify graph's
# N is static and its extra nodes cost nothing, so a top-4 tree. Measured on the embedded model, CPU
# verify, 8 chat prompts, a round every step (docs/speculation.md): chain
# 1.54-1.76x plain, the top-4 tree 0.52-0.84x (acceptance 5.6-5.9 vs 3.6 a round: at a sized
# verify's budget the tree cuts the chain's deep tail for breadth).
CHAIN_SHAPE = {"top_k": 1, "depth": 6, "total_tokens": 6}
TREE_SHAPE = {"top_k": 4, "depth": 6, "total_tokens": 1 << 30}


def default_draft_shape(npu_verifies: bool) -> dict:
    """The draft shape for an export that records none, by whether rounds verify on the NPU (past
    the NPU's T_max they verify on the CPU, still with the tree)."""
    return dict(TREE_SHAPE if npu_verifies else CHAIN_SHAPE)


@dataclass
class Tree:
    """Node 0 is the root (the last sampled token, not yet in the state); node i > 0 has parent
    parents[i] < i. Padding nodes (parent -1 beyond the real ones) are leaves nobody reads."""
    tokens: list[int]
    parents: list[int]

    @classmethod
    def from_draft(cls, root: int, draft_tokens: list[int], draft_parents: list[int], size: int) -> "Tree":
        if len(draft_tokens) + 1 > size:
            draft_tokens, draft_parents = draft_tokens[: size - 1], draft_parents[: size - 1]
        parents = [-1] + [p + 1 for p in draft_parents]  # draft parent -1 = the root
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"draft node {i - 1} has parent {p - 1}: parents must come first")
        real = len(parents)
        return cls([root] + list(draft_tokens) + [0] * (size - real), parents + [-1] * (size - real)), real

    def paths(self) -> list[list[int]]:
        out = []
        for m in range(len(self.parents)):
            p, path = m, []
            while p >= 0:
                path.append(p)
                p = self.parents[p]
            out.append(path[::-1])
        return out

    def children(self, n_real: int) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {i: [] for i in range(n_real)}
        for i in range(1, n_real):
            kids[self.parents[i]].append(i)
        return kids


def tree_feed(cfg: ModelConfig, state: State, tree: Tree) -> dict[str, np.ndarray]:
    n = len(tree.tokens)
    if tree.parents == list(range(-1, n - 1)):  # a chain (the CPU's drafts): its rows are always the same
        mask, depth, visible, select, valid = _chain_tree(n, cfg.linear_conv_kernel_dim)
        feed = {"input_ids": np.array(tree.tokens, np.int64), "token_valid": valid, "tree_mask": mask,
                "conv_tree_select": select}
        feed.update(context_feed(cfg, state, depth, visible, chain=True))
        return feed
    return general_tree_feed(cfg, state, tree)


@functools.lru_cache(maxsize=32)
def _chain_tree(n: int, k: int) -> tuple[np.ndarray, ...]:
    """tree_feed's structure inputs for a chain of n nodes (read-only, kept): built each round, with
    context_feed's rotary rows, they took 0.19-0.35 ms of the embedded model's ~10 ms chain round."""
    depth, visible = chain_rows(n)
    out = (visible.astype(np.float32), depth, visible, tree_conv_select(list(range(-1, n - 1)), k), np.ones(n, np.float32))
    for a in out:
        a.flags.writeable = False
    return out


def general_tree_feed(cfg: ModelConfig, state: State, tree: Tree) -> dict[str, np.ndarray]:
    """tree_feed for any tree, each input built from its paths."""
    n = len(tree.tokens)
    paths = tree.paths()
    M = np.zeros((n, n), np.float32)
    for i, path in enumerate(paths):
        M[i, path] = 1.0
    depth = np.array([len(p) - 1 for p in paths])
    feed = {"input_ids": np.array(tree.tokens, np.int64), "token_valid": np.ones(n, np.float32), "tree_mask": M,
            "conv_tree_select": tree_conv_select(tree.parents, cfg.linear_conv_kernel_dim)}
    feed.update(context_feed(cfg, state, depth, M > 0))
    return feed


def accept_greedy(logits: np.ndarray, tree: Tree, n_real: int) -> tuple[list[int], int]:
    """Longest path whose every token is the target's argmax after its parent; the target's own
    next token after the path is the bonus."""
    kids, node, path = tree.children(n_real), 0, [0]
    while True:
        want = int(np.argmax(logits[node]))
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def accept_sampled(logits: np.ndarray, tree: Tree, n_real: int, sampler: Sampler, root_position: int
                   ) -> tuple[list[int], int]:
    """The path plain sampling would have taken (docs/reproducibility.md): at each node the token
    the target chooses next is sampler.choose(its logits, its position), the Gumbel-max keyed by
    (seed, position); a child drafting that token is accepted and the walk goes on from it, else
    that token is the bonus. root_position: the root's position in the context (the number of
    tokens before it), so a node at depth d chooses the token at root_position + d + 1.

    Why lossless: the emitted tokens are exactly those plain sampling draws from the same logits and
    noise, whatever the draft; a draft only decides how many of them one verify pass yields. Drafted
    tokens as point masses are accepted with probability p(x) each, as multi-candidate rejection
    accepts them."""
    kids, node, path = tree.children(n_real), 0, [0]
    while True:
        want = sampler.choose(logits[node], root_position + len(path))
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def conv_window(conv: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """The conv state [C, K-1] after the path's last inputs `rows` [<= K-1, C] (oldest first): the
    columns still in the window, then those rows. Filled in place (a concatenate and a contiguous
    copy took ~95 of a layer's ~160 us at the 0.8B's 6,144 channels)."""
    keep = k - 1 - len(rows)
    window = np.empty((conv.shape[0], k - 1), conv.dtype)
    window[:, :keep] = conv[:, k - 1 - keep:]
    window[:, keep:] = rows.T
    return window


def commit_path(state: State, out: dict[str, np.ndarray], tree: Tree, path: list[int], k: int) -> None:
    """Advance the state by the tokens of `path` (root first) from the verify outputs."""
    idx = np.array(path)
    for i, layer in state.gdn.items():
        commit, S = (out[f"commit_k.{i}"], out[f"commit_u.{i}"], out[f"commit_g.{i}"]), layer.recurrent
        if S.dtype == np.float32 and S.flags.writeable and S.flags.c_contiguous:
            commit_state_ref(S, commit, path, out=S)  # in place: the state owns its arrays (a Checkpoint copies)
        else:
            layer.recurrent = commit_state_ref(S, commit, path).astype(np.float32)
        layer.conv = conv_window(layer.conv, out[f"pre_conv.{i}"][idx[-(k - 1):]], k)
    pos = state.position
    state.ensure_capacity(pos + len(path))
    for i, layer in state.attention.items():
        layer.write(pos, out[f"new_key.{i}"][:, idx], out[f"new_value.{i}"][:, idx])
    state.position += len(path)
    state.tokens.extend(int(tree.tokens[j]) for j in path)


# A round's commit runs on a worker thread while the drafter observes the round's tokens (numpy's
# kernels and ONNX Runtime's run both release the GIL; the drafter reads none of the target's state)
# once the GDN states are this large: the 0.8B's 18 MiB took 4.1-4.8 ms to commit and ~3 ms to
# observe, and side by side the two took 1.7-2.0 ms less than one after the other (docs/speculation.md).
# A small model's commit is shorter than the hand-off (~0.1 ms).
COMMIT_BESIDE_MIN_BYTES = 4 << 20


def commit_beside(worker: Executor | None, state: State, out: dict[str, np.ndarray], tree: Tree, path: list[int],
                  k: int, work: Callable[[], object]) -> None:
    """commit_path(state, out, tree, path, k) on `worker` while `work()` runs here (None: one after
    the other). Returns once both are done, so the state is whole whatever either raised; a
    KeyboardInterrupt while waiting is held until the commit has finished (milliseconds), then raised."""
    if worker is None:
        commit_path(state, out, tree, path, k)
        work()
        return
    committing = worker.submit(commit_path, state, out, tree, path, k)
    try:
        work()
    finally:
        interrupted = False
        while True:
            try:
                committing.result()  # raises what the commit raised
                break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
