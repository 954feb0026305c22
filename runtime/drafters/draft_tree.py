"""What every drafter does at run time (CPU, ONNX), whatever its layer: stable K/V over the accepted
context, a window, EAGLE-2 trees from the top-k, rewind. TreeDrafter holds it; a kind opens its
graphs and draft vocabulary (eagle3.py: an EAGLE-3 layer over the target's fused taps; mtp.py: the
checkpoint's own MTP head over its last residual). Both graphs take the same inputs
(export/drafters/shared.py drafter_step_inputs).

Spec: docs/eagle3-drafter.md (forward, alignment, stable K/V) and §1.6 (dynamic tree); docs/speculation.md.

Alignment: the drafter pairs the target's fused taps of position t with the token at t+1 and
predicts t+2. `observe(tokens, features)` takes such pairs (features[i] = taps of the position
before tokens[i]) and appends them to the stable K/V; the last observed token is the root of the
next `propose`. The tree's K/V rows are written past the stable rows and simply forgotten:
rolling the drafter back costs nothing.

K/V buffer [nKV, capacity, hd] grows by at least 1/8 at a time. A call reads only the rows it
may see: the last `window` stable rows (DRAFT_WINDOW) and the tree rows of the round so far.
Why a window: reading the whole context each call made the draft grow with the context (depth-6
chain on the embedded drafter: 3.3 ms at 1.5k tokens, 11 ms at 12k, docs/speculation.md), and a
drafter predicts from local context: scripts/train/train_drafter.py trains with the same window.
The target verifies every draft, so the window changes acceptance, never the output. RoPE keeps
absolute positions: relative distances inside the window are what the drafter was trained on.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST as MANIFEST
from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.kernels.rope import rope_rows, rope_tables
from hybrid_npu.manifest import DrafterManifest, DraftVocab, load_drafter_manifest
from hybrid_npu.safe_files import inside, read_bytes, regular_size

from ..session_options import cpu_inference_session, session_options
from ..state import grown_capacity
from ..step_inputs import chain_rows

OBSERVE_CHUNK = 64  # positions per observe call: bounds the [N, capacity + N] score scratch
MIN_CAPACITY = 64
SINGLE_THREAD_BELOW_BYTES = 64 * 2**20
ROW_0 = np.zeros(1, np.int64)  # a one-query call's logit row
DRAFT_WINDOW = 512  # stable rows a draft query sees (train_drafter.py --window trains with it)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def top_k_stable(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, largest first; ties go to the lower index
    (deterministic). A partition finds the k-th value, then only the candidates are sorted: a
    full sort of the draft vocabulary per row was 15% of a speculative round on a small model."""
    n = scores.shape[-1]
    if k >= n:
        return np.argsort(-scores, axis=-1, kind="stable")
    rows = scores.reshape(-1, n)
    out = np.empty((len(rows), k), np.int64)
    for r, row in enumerate(rows):
        cand = np.flatnonzero(row >= np.partition(row, n - k)[n - k])  # ascending ids: ties stay in order
        out[r] = cand[np.argsort(-row[cand], kind="stable")[:k]]
    return out.reshape(scores.shape[:-1] + (k,))


VOCAB_BYTES = 64 << 20  # a draft vocabulary: 8 bytes per id, far below a million ids
FIX = "re-export the drafter with: export-hybrid SOURCE OUT --drafter DRAFTER"


def read_draft_vocab(drafter_dir: Path, record: DraftVocab) -> np.ndarray:
    """The target id of each draft id, from a drafter manifest's vocab record (EAGLE-3's own
    vocabulary, a trimmed MTP head's; export/drafters/shared.py write_draft_vocab)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    f = inside(Path(drafter_dir), record.file, "draft vocabulary file", FIX)
    try:
        ids = load(read_bytes(f, VOCAB_BYTES, "the draft vocabulary", FIX))[record.tensor]
    except (SafetensorError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{f}: not a draft vocabulary ({str(e)[:120]}); {FIX}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise UserError(f"{f}: the draft vocabulary is {ids.dtype} {list(ids.shape)}, not a list of ids; {FIX}")
    return ids


def drafter_graph(drafter_dir: Path, rel) -> Path:
    """A drafter graph file: inside its directory and a regular file (ONNX Runtime would block on a FIFO)."""
    f = inside(Path(drafter_dir), rel, "drafter graph", FIX)
    regular_size(f, "drafter graph", FIX)
    return f


def check_drafter_shapes(path: Path, session, nkv: int, hd: int) -> None:
    """drafter.json's K/V numbers against the graph's own past_key before a buffer is sized by them."""
    for i in session.get_inputs():
        if i.name == "past_key":
            want = [nkv, None, hd]
            got = [d if isinstance(d, int) else None for d in i.shape]
            if len(got) != 3 or any(g is not None and g != w for g, w in zip(got, want)):
                raise UserError(f"{path / MANIFEST} contradicts its graph: past_key is {got} in the graph, "
                                f"{want} by the manifest; {FIX}")


def open_manifest(path: Path, record: DrafterManifest | None, how: str) -> DrafterManifest:
    """The drafter.json of directory `path` (record: where the caller has read it, runtime/drafters
    load_drafter); how: how to export one, for the line that says there is none."""
    if not (path / MANIFEST).exists():
        raise UserError(f"{path} is not an exported drafter (no {MANIFEST}); {how}")
    return record or load_drafter_manifest(path)


class TreeDrafter:
    """A drafter of one decoder layer over two CPU graphs, `fc` (the target's taps -> features) and
    `step` (one drafter step over n queries). A kind reads its drafter.json and gives the width of
    the taps it reads, its draft vocabulary (draft id -> target id) and its two graph files."""
    picks = True  # propose takes pick= (generation.drafting_with)

    def __init__(self, path: Path, manifest: DrafterManifest, window: int | None, tap_width: int,
                 draft_to_target: np.ndarray, graphs: tuple[str, str], weight_bytes: int, threads: int | None):
        """graphs: the fc and step graph files inside path; weight_bytes: the drafter's weights (a
        small drafter runs on one thread)."""
        self.path, self.manifest = path, manifest
        self.window = window  # None: every stable row
        dims = manifest.dims
        self.nkv, self.hd, self.h = dims.num_key_value_heads, dims.head_dim, dims.hidden_size
        self.rotary_dim, self.rope_theta = dims.rotary_dim, dims.rope_theta
        self.input_order = manifest.input_order  # target tap layers, concat order
        self.tap_width = tap_width
        self.draft_to_target = draft_to_target
        # A small drafter's calls are too short to split: on 2 cores, the embedded 6.6 MB drafter
        # proposed a depth-6 chain in 7.7 ms on one thread against ~20 ms on two (thread hand-offs).
        opts = session_options(1 if weight_bytes < SINGLE_THREAD_BELOW_BYTES else threads)
        self.fc = cpu_inference_session(drafter_graph(path, graphs[0]), opts)
        self.step = cpu_inference_session(drafter_graph(path, graphs[1]), opts)
        check_drafter_shapes(path, self.step, self.nkv, self.hd)
        self.reset()

    # ---------------------------------------------------------------- state
    def reset(self) -> None:
        self.key = np.zeros((self.nkv, MIN_CAPACITY, self.hd), np.float32)
        self.value = np.zeros_like(self.key)
        self.length = 0            # stable rows = drafter positions observed
        self._hidden = None        # [h] feature out of the last observed step
        self._logits = None        # [Vd] its draft logits (level 1 of the next tree)
        self._last_token = None

    def rewind(self, length: int) -> None:
        """Forget the positions from `length` on (the target went back to a turn checkpoint); the
        next observe() recomputes the draft distribution from there."""
        self.length = min(self.length, int(length))
        self._hidden = self._logits = self._last_token = None

    def _ensure(self, need: int) -> None:
        cap = self.key.shape[1]
        if need <= cap:
            return
        cap = grown_capacity(need, cap, block=1)
        for name in ("key", "value"):
            buf = np.zeros((self.nkv, cap, self.hd), np.float32)
            buf[:, : self.length] = getattr(self, name)[:, : self.length]
            setattr(self, name, buf)

    def fuse_taps(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """The target graph's `tap.{j}` outputs -> features [N, nT·H] in the order observe expects."""
        return np.concatenate([outputs[f"tap.{j}"] for j in self.input_order], axis=-1)

    def _run(self, features, ids, position, lo: int, hi: int, visible: np.ndarray | None, new_visible: np.ndarray,
             logit_rows, rope: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """One drafter step over n queries at drafter positions `position` (scalar or [n]), reading
        buffer rows [lo, hi); visible [n, hi - lo] bool: the rows each query sees (None: all of them);
        new_visible [n, n]: the new rows; rope: the positions' rotary rows, when the caller has them.
        Only those rows are fed (a small copy), not the whole buffer."""
        n, rows = len(ids), hi - lo
        mask = np.full((n, rows + n), MASKED, np.float32)
        if visible is None:
            mask[:, :rows] = 0.0
        else:
            mask[:, :rows][visible] = 0.0
        mask[:, rows:][new_visible] = 0.0
        if rope is None:
            rope = rope_tables(np.broadcast_to(np.asarray(position, np.int64), (n,)), self.rotary_dim, self.rope_theta)
        return self._call(features, ids, rope, mask, self.key[:, lo:hi], self.value[:, lo:hi], logit_rows)

    def _call(self, features, ids, rope, mask, past_key, past_value, logit_rows) -> dict[str, np.ndarray]:
        """The drafter graph on its feeds as they are (_run builds them)."""
        return dict(zip(("logits", "hidden", "new_key", "new_value"), self.step.run(None, {
            "features": np.ascontiguousarray(features, np.float32), "input_ids": np.asarray(ids, np.int64),
            "rope_cos": rope[0], "rope_sin": rope[1], "attn_mask": mask,
            "past_key": np.ascontiguousarray(past_key), "past_value": np.ascontiguousarray(past_value),
            "logit_rows": np.asarray(logit_rows, np.int64)})))

    @property
    def context_rows(self) -> int | None:
        """Of a run of pairs about to be observed, how many must be observed for its outputs (the last
        rows' logits, hidden and guesses, at most OBSERVE_CHUNK of them) to read observed rows only:
        the window, counted from the start of their chunk (a chunk's queries share its window
        start), so a window and two chunks. The older ones may be skipped. None: every row is read."""
        return None if self.window is None else self.window + 2 * OBSERVE_CHUNK

    def skip(self, n: int) -> None:
        """Advance past n positions without computing their K/V rows: they fall outside every later
        query's window (context_rows says how many must be observed after them)."""
        if self.window is None:
            raise ValueError("skip: this drafter reads every row (window None)")
        self._ensure(self.length + n)
        self.length += int(n)
        self._hidden = self._logits = self._last_token = None

    def _first_row(self) -> int:
        """The oldest stable row a query at the current length sees."""
        return 0 if self.window is None else max(0, self.length - self.window)

    # ---------------------------------------------------------------- extend
    def guess(self) -> int | None:
        """The target token a draft would start with now: the argmax of the last observed row's draft
        distribution (None before any observe)."""
        return None if self._logits is None else int(self.draft_to_target[int(np.argmax(self._logits))])

    def observe(self, tokens: list[int], features: np.ndarray, guesses: int = 0) -> list[int] | None:
        """Append pairs (taps of position t, token t+1) to the stable K/V; features [n, nT·H] are the
        target's taps concatenated in `input_order` (fuse_taps). guesses: also return, for each of
        the last `guesses` positions, the token a draft would start with after it (what guess() would
        have said had the observe stopped there): those rows' logits too, where an observe otherwise
        computes the last row's only."""
        features = np.asarray(features, np.float32)
        if len(tokens) == 0:
            return [] if guesses else None
        found: list[int] = []
        first_guessed = len(tokens) - min(guesses, len(tokens))
        if features.shape != (len(tokens), self.tap_width):
            raise ValueError(f"observe: features {features.shape}, expected ({len(tokens)}, {self.tap_width})")
        f = self.fc.run(None, {"taps": features})[0]
        for s in range(0, len(tokens), OBSERVE_CHUNK):
            ids, n = tokens[s: s + OBSERVE_CHUNK], len(tokens[s: s + OBSERVE_CHUNK])
            self._ensure(self.length + n)
            lo = self._first_row()  # a chunk's queries share one window start (chunks are short)
            rows = np.arange(min(max(first_guessed - s, 0), n - 1), n) if guesses else [n - 1]
            # every stable row in the window visible (None), the chunk causal among itself
            depth, causal = chain_rows(n)
            out = self._run(f[s: s + n], ids, self.length + depth, lo, self.length, None, causal, rows,
                            rope=rope_rows(self.rotary_dim, self.rope_theta)(self.length, n))
            self.key[:, self.length: self.length + n] = out["new_key"]
            self.value[:, self.length: self.length + n] = out["new_value"]
            self.length += n
            self._hidden, self._logits = out["hidden"][-1], out["logits"][-1]
            if guesses:
                guessed = out["logits"][rows + s >= first_guessed]
                found += [int(t) for t in self.draft_to_target[np.argmax(guessed, axis=-1)]]
        self._last_token = int(tokens[-1])
        return found if guesses else None

    # ---------------------------------------------------------------- tree
    def propose(self, root_token: int, top_k: int, depth: int, total_tokens: int, pick=None) -> tuple[list[int], list[int]]:
        """EAGLE-2 dynamic tree under `root_token` (the last observed token), docs/eagle3-drafter.md

        Level 1 = top_k of the root's draft distribution; each of depth-1 drafter calls expands the
        top_k frontier (beam by cumulative log-prob) into top_k children each; the tree is the best
        `total_tokens` of all candidates by cumulative log-prob. Returns (target token ids, parent
        indices into the same list, -1 = the root), parents before children; depth counts levels
        (the reference's depth + 1). The stable K/V is untouched.
        pick(level, logits, draft_to_target) -> draft id: how a chain (top_k 1) picks each level's
        token (default: the argmax; a sampled reply's Gumbel-max, generation.drafting_with); a
        tree's beams are the top-k either way."""
        if self._logits is None:
            raise ValueError("propose before observe: the drafter has no context")
        if int(root_token) != self._last_token:
            raise ValueError(f"propose: root {root_token} is not the last observed token {self._last_token}")
        if depth < 1 or total_tokens < 1 or top_k < 1:
            return [], []
        if top_k == 1:
            return self._propose_chain(min(depth, total_tokens), pick)
        return self._propose_tree(top_k, depth, total_tokens)

    def _propose_tree(self, top_k: int, depth: int, total_tokens: int) -> tuple[list[int], list[int]]:
        k = min(top_k, len(self.draft_to_target))
        logp = log_softmax(self._logits)
        first = top_k_stable(logp, k)
        frontier = np.arange(k)                              # global candidate ids being expanded
        f_hidden = np.repeat(self._hidden[None], k, axis=0)  # each frontier node's parent feature
        base, lo = self.length, self._first_row()
        self._ensure(base + (depth - 1) * k)
        ancestors = {-1: []}  # candidate -> its tree rows (offsets past base): what its children see
        all_parents, all_tokens, all_scores = np.full(k, -1), first, logp[first]
        for level in range(depth - 1):
            n, start = len(frontier), base + level * k
            visible = np.zeros((n, start - lo), bool)
            visible[:, : base - lo] = True
            for r, g in enumerate(frontier):
                visible[r, [base - lo + a for a in ancestors[all_parents[g]]]] = True
            out = self._run(f_hidden, self.draft_to_target[all_tokens[frontier]], base + level, lo, start, visible,
                            np.eye(n, dtype=bool), np.arange(n))
            self.key[:, start: start + n] = out["new_key"]
            self.value[:, start: start + n] = out["new_value"]
            for r, g in enumerate(frontier):
                ancestors[g] = ancestors[all_parents[g]] + [start - base + r]
            lp = log_softmax(out["logits"])                  # [n, Vd]
            child = top_k_stable(lp, k)                      # [n, k]
            cu = all_scores[frontier][:, None] + np.take_along_axis(lp, child, -1)
            offset = len(all_tokens)
            all_tokens = np.concatenate([all_tokens, child.reshape(-1)])
            all_scores = np.concatenate([all_scores, cu.reshape(-1)])
            all_parents = np.concatenate([all_parents, np.repeat(frontier, k)])
            best = top_k_stable(cu.reshape(-1), k)
            frontier, f_hidden = offset + best, out["hidden"][best // k]
        # stable order by score: a parent (score >= child's, lower id) always comes before its child,
        # so every prefix is closed under parents
        chosen = np.sort(top_k_stable(all_scores, min(total_tokens, len(all_scores))))
        where = {int(g): i for i, g in enumerate(chosen)}
        out_parents = [-1 if all_parents[g] < 0 else where[int(all_parents[g])] for g in chosen]
        return [int(t) for t in self.draft_to_target[all_tokens[chosen]]], out_parents

    def _propose_chain(self, length: int, pick=None) -> tuple[list[int], list[int]]:
        """propose at top_k 1: the tree is a chain, each level's pick (default the argmax, the first of equal
        scores, as top_k_stable picks), every row before it visible. The same tokens without the
        beam bookkeeping (log-softmax, partitions, candidate arrays), which cost about as much
        host time as the drafter's own calls (embedded drafter: ~1 of 2.2 ms a 6-level draft).
        The levels share one copy of the window's K/V with room for the chain's rows, each level
        seeing its own rows through its mask (zero rows beyond: exactly no weight), and one
        rope_tables call. Built again each level (with a copy of the window, up to 512 rows), the
        embedded drafter's depth-14 chain took 3.87 ms against 2.85 after 40 tokens, and 6.71 against
        5.14 after 1,500 (docs/speculation.md)."""
        pick = pick or (lambda level, logits, ids: int(np.argmax(logits)))
        token = pick(1, self._logits, self.draft_to_target)
        tokens, hidden = [token], self._hidden[None]
        base, lo = self.length, self._first_row()
        self._ensure(base + length - 1)
        rows, total = base - lo, base - lo + length - 1
        past = [np.zeros((self.nkv, total, self.hd), np.float32) for _ in range(2)]
        past[0][:, :rows], past[1][:, :rows] = self.key[:, lo:base], self.value[:, lo:base]
        masks = np.zeros((length - 1, total + 1), np.float32)  # level L sees rows + L rows, then its own
        masks[:, :total][np.arange(total)[None, :] >= rows + np.arange(length - 1)[:, None]] = MASKED
        rope = rope_rows(self.rotary_dim, self.rope_theta)(base, length - 1)  # a block kept (kernels/rope.py)
        for level in range(length - 1):
            out = self._call(hidden, self.draft_to_target[token: token + 1], (rope[0][level: level + 1],
                             rope[1][level: level + 1]), masks[level: level + 1], *past, ROW_0)
            at = base + level
            self.key[:, at: at + 1], self.value[:, at: at + 1] = out["new_key"], out["new_value"]
            past[0][:, rows + level: rows + level + 1] = out["new_key"]
            past[1][:, rows + level: rows + level + 1] = out["new_value"]
            token, hidden = pick(level + 2, out["logits"][0], self.draft_to_target), out["hidden"][:1]
            tokens.append(token)
        return [int(t) for t in self.draft_to_target[tokens]], [-1] + list(range(length - 1))
