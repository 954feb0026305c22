"""One conversation on a loaded model (runtime/model.py): its GDN state and K/V rows (State), the
last reply's final token not yet in them, its turn checkpoints, the pairs its drafter has not
observed, and its speculation policies. A model serves as many contexts as its memory plan holds;
generation.stream(model, context, ...) runs one.

The model's drafter is one set of sessions with one cache: it holds the context it last served.
A context it comes back to after serving another starts it over (Context.own_drafter), and the
drafter learns that context again from its next tokens, as a snapshot restore does.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hybrid_npu.errors import UserError
from hybrid_npu.format import manifest_hash

from .drafter_feed import DrafterFeed, catch_up_drafter, feed_for
from .npu_sessions import NPU_DEVICE
from .pipeline import CPU_DEVICE
from .state import KV_BLOCK, State
from .step_inputs import chain_feed, commit_chain
from .turn_checkpoints import Checkpoint, Checkpoints, resumable


class Context:
    def __init__(self, model):
        self.model = model
        self.checkpoints = Checkpoints(model.max_checkpoints)
        self.policies: dict = {}  # draft shape -> its SpecPolicy (generation.policy_for)
        self.policy_maker = None  # the model's make_policy they were made by
        self.spec_stats: dict = {"rounds": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0}  # the reply running
        self.ahead = None         # a kept look-ahead (look_ahead.LookAhead), within one reply
        self.prefill_devices = ""  # where the last prefill's chunks ran, "+"-joined
        self.last_out: dict | None = None  # the last step's graph outputs (a plain step's taps)
        self._verify_graphs: tuple | None = None  # (what verify_graphs read, its answer)
        self.reset()

    def reset(self) -> None:
        """Start the conversation over (the drafter with it)."""
        self.state = State.fresh(self.model.config, KV_BLOCK, self.model.kv_cache)
        self.pending: list[int] = []  # the last reply's final token: it enters the state on the next step
        self.tap_pending: np.ndarray | None = None  # the last token's taps, paired with the token after it
        self.checkpoints.clear()
        drafter = self.model.drafter
        self.feed = feed_for(drafter, self.model.drafter_caps)  # pairs the drafter has not observed yet
        if drafter is not None:
            self.model.drafter_serves(self)
            drafter.reset()

    def nbytes(self) -> int:
        """What it holds: its GDN state and checkpoints' copies, and the K/V rows in use."""
        return self.model.memory.state_bytes * (1 + len(self.checkpoints)) + self.state.kv_bytes_in_use()

    # ---------------------------------------------------------------- the drafter
    @property
    def drafter_feed(self) -> DrafterFeed:
        """The pairs the drafter has not observed yet (runtime/drafter_feed.py); a swapped drafter gets
        a feed of its own (it has seen none of the context: it learns from the next tokens)."""
        if self.feed.owner is not self.model.drafter:
            self.feed = feed_for(self.model.drafter, self.model.drafter_caps)
        return self.feed

    def own_drafter(self) -> None:
        """Before the drafter works for this context: if it last served another, it starts over here."""
        drafter = self.model.drafter
        if drafter is not None and self.model.drafter_serves(self):
            drafter.reset()
            self.drafter_feed.clear()
            self.tap_pending = None
            self.checkpoints.forget_drafter()

    def catch_up_drafter(self, guesses: int = 0) -> list[bool]:
        """Show the drafter the pairs it has not observed (drafter_feed.catch_up_drafter)."""
        self.own_drafter()
        return catch_up_drafter(self.model.drafter, self.drafter_feed, guesses)

    def _feed_drafter(self, ids: list[int], taps: np.ndarray) -> None:
        """EAGLE pairs the target's feature at position t with the token at t+1 (docs/eagle3-drafter.md
        §1.2): the last feature waits for the token that follows it. The pairs wait in the feed until
        the drafter is next needed."""
        if self.tap_pending is not None:
            self.drafter_feed.add([ids[0]], self.tap_pending[None])
        if len(ids) > 1:
            self.drafter_feed.add(list(ids[1:]), taps[:-1])
        self.tap_pending = taps[-1]

    # ---------------------------------------------------------------- speculation
    @property
    def draft_shape(self) -> dict | None:
        return self.model.draft_shape

    def verify_graph(self, depth: int) -> tuple[str, int]:
        """(device, nodes) of the verify a round of `depth` levels runs at this context's position."""
        return self.model.verify_graph(depth, self.state.position)

    def verify_graphs(self, max_depth: int) -> tuple:
        """verify_graph of every depth 1..max_depth, as the speculation policy asks it each step: kept
        while the answer's inputs (where the NPU's graph fits, the draft shape) stay the same."""
        shape = self.model.draft_shape
        key = (max_depth, self.model.npu_verify_fits(self.state.position), shape["top_k"], shape["total_tokens"])
        if self._verify_graphs is None or self._verify_graphs[0] != key:
            self._verify_graphs = (key, tuple(self.verify_graph(d) for d in range(1, max_depth + 1)))
        return self._verify_graphs[1]

    def commit_worker(self):
        """The model's commit thread where this context's GDN states are large enough for it to pay."""
        return self.model.commit_worker(sum(layer.recurrent.nbytes for layer in self.state.gdn.values()))

    # ---------------------------------------------------------------- memory
    @property
    def max_context(self) -> int:
        """The largest context the memory plan allows this one, the model's other contexts counted."""
        return self.model.room_for(self)

    def check_fits(self, n_new: int) -> None:
        need, limit = self.state.position + n_new, self.max_context
        if need > limit:
            who, detail, fix = self.model.memory.limit_and_fix()
            if self.model.bytes_in_use(besides=self):
                detail += "; the model's other contexts hold the rest"
            raise UserError(f"this needs {need} tokens of context but {who} allows {limit} ({detail}); {fix}")

    def room(self) -> int:
        """New tokens the plan still allows: each one becomes a row of the context (the last one on
        the next step or save)."""
        return max(self.max_context - self.state.position, 0)

    def memory_report(self) -> dict:
        """Fixed and per-token costs, the context now and the largest one the budget allows.
        context_tokens counts every token of the conversation, the last reply's final token included
        (it enters the state on the next step): the count the REPL's status line and the stats give."""
        m = self.model.memory
        return {"state_bytes": m.state_bytes, "checkpoint_bytes": m.checkpoint_bytes,
                "checkpoints": len(self.checkpoints), "kv_bytes_per_token": m.kv_bytes_per_token,
                "weights_bytes": m.weights_bytes, "budget_bytes": m.budget_bytes,
                "context_tokens": self.state.position + len(self.pending), "max_context": self.max_context,
                "kv_bytes_in_use": self.state.kv_bytes_in_use()}

    # ---------------------------------------------------------------- steps
    def step(self, graph: str, ids: list[int]) -> np.ndarray:
        """Advance the state by `ids` through one call of `graph`; returns the last token's logits."""
        model = self.model
        n = (model.manifest.decode if graph == "decode" else model.manifest.prefill).n
        model.check_ids(ids)
        self.state.ensure_capacity(self.state.position + n)
        # the tiled NPU prefill masks each tile itself: no [N, T] mask over the whole context
        out = model.pipelines[graph].run(chain_feed(model.config, self.state, ids, n, mask=not model.tiled(graph)))
        commit_chain(self.state, out, ids)
        if model.drafter is not None and graph != "decode":
            self._feed_drafter(ids, model.taps(out, np.arange(len(ids))))
        self.last_out = out
        return out["logits"][0]

    def decode(self, token: int) -> np.ndarray:
        """One decode step: append `token` to the context; returns the logits after it."""
        return self.step("decode", [token])

    def prefill(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
                checkpoint_at=()) -> np.ndarray:
        """Append `ids` to the context in chunks of C; returns the logits after the last one.
        Chunks go to the NPU when the profile says so: at any position where its prefill reads attention
        in tiles, else while its T_max has room.
        checkpoint_at: context positions at which to keep a turn checkpoint (a chunk ends there)."""
        if not ids:
            raise UserError("empty prompt: give at least one token")
        self.check_fits(len(ids))
        model, state = self.model, self.state
        logits, devices = None, []
        npu = model.wants_npu(len(ids))
        base = state.position
        marks = sorted({m - base for m in checkpoint_at if base <= m < base + len(ids)})
        start = 0
        t_max = model.profile.attention_capacity
        while start < len(ids):
            if marks and marks[0] == start:
                self.take_checkpoint()
                marks.pop(0)
            end = min(start + model.chunk, len(ids), *marks[:1])
            on_npu = npu and model.npu_fits(state.position)
            if on_npu and not model.tiled("npu_prefill") and state.capacity != t_max:
                state.resize(t_max)  # untiled NPU graphs read exactly T_max rows
            devices.append(NPU_DEVICE if on_npu else CPU_DEVICE)
            logits = self.step("npu_prefill" if on_npu else "prefill", list(ids[start:end]))
            start = end
            if progress:
                progress(end, len(ids))
        self.prefill_devices = "+".join(dict.fromkeys(devices))
        if state.capacity > state.position + 2 * KV_BLOCK:  # back from T_max: CPU decode reads
            state.resize((state.position // KV_BLOCK + 1) * KV_BLOCK)  # every row it is given
        return logits

    def prefill_logits(self, prompt_ids: list[int]) -> tuple[np.ndarray, dict]:
        """Logits [vocab] after the last prompt token, from a fresh state, and the stats of this
        scoring pass (where its prefill ran and how fast, no decode)."""
        self.reset()
        t0 = time.perf_counter()
        logits = self.prefill(list(prompt_ids))
        t = time.perf_counter() - t0
        return logits, {"prefill_tokens": len(prompt_ids), "prefill_tokens_per_s": len(prompt_ids) / max(t, 1e-9),
                        "prefill_device": self.prefill_devices, "decode_tokens": 0, "ttft_s": t,
                        "context_tokens": self.state.position}

    def context_ids(self) -> list[int]:
        """Every token of the conversation so far: the committed ones and the last reply's final
        token (not yet in the state); a chat front end compares it with its next rendered prompt."""
        return list(self.state.tokens) + list(self.pending)

    # ---------------------------------------------------------------- turn checkpoints
    def take_checkpoint(self) -> None:
        """Keep a copy of the state at the current position (the memory plan counts the limit)."""
        if self.checkpoints.limit == 0:
            return
        if self.pending:
            raise ValueError("take_checkpoint: the last reply's final token is not in the state yet")
        drafter = self.model.drafter
        if drafter is not None:  # a rewind to here continues the drafter from here
            self.catch_up_drafter()
        length = drafter.length if drafter is not None and self.model.drafter_caps.rewinds else None
        self.checkpoints.add(Checkpoint.take(self.state, self.tap_pending, length))

    def resumable(self, prompt_ids: list[int]) -> int:
        """How many of prompt_ids resume() would keep, without changing anything."""
        return resumable(self.context_ids(), self.checkpoints.items, prompt_ids)

    def resume(self, prompt_ids: list[int]) -> int:
        """Make the context a prefix of `prompt_ids` as cheaply as it can: keep it when it already is
        one, else go back to the latest checkpoint at or before where the two part (at least one
        prompt token is left to prefill, for its logits), else start over. Returns how many prompt
        tokens are in the context now: stream(..., prompt_ids[kept:], append=True) continues."""
        kept = self.resumable(prompt_ids)
        if kept == len(self.context_ids()):
            return kept  # the context is a prefix of the prompt (or empty): keep it all
        if kept == 0:
            self.reset()
            return 0
        self.own_drafter()
        checkpoint = self.checkpoints.latest_at_or_before(kept)
        self.pending = []  # the checkpoint is inside the committed context; the pending token is past it
        checkpoint.restore(self.state)
        self.checkpoints.drop_after(checkpoint.position)
        self.tap_pending = checkpoint.tap
        self.drafter_feed.clear()  # pairs after the checkpoint (the one before it was observed)
        drafter = self.model.drafter
        if drafter is not None:
            if self.model.drafter_caps.rewinds and checkpoint.drafter_length is not None:
                drafter.rewind(checkpoint.drafter_length)
            else:  # a drafter that cannot go back starts over and learns from the next tokens
                drafter.reset()
                self.tap_pending = None
        return checkpoint.position

    # ---------------------------------------------------------------- snapshots
    def save_state(self, path, extra: dict[str, str] | None = None) -> None:
        """The whole conversation (GDN + conv states, K/V rows in use, token history) to one file;
        `extra` (str -> str, e.g. a chat's messages) goes into the same file under its checksum."""
        from .snapshot import save_state

        if self.pending:  # the last reply's final token goes into the state first
            self.step("decode", self.pending)
            self.pending = []
        save_state(self.state, path, manifest_hash(self.model.path), extra, self.checkpoints.items)

    def load_state(self, path, check: Callable[[dict], None] | None = None) -> dict:
        """Resume a conversation saved by save_state (its turn checkpoints too); refuses another
        model's or a damaged file. Returns the snapshot's extra metadata; `check(extra)` may refuse it
        (raise) before anything changes."""
        from .snapshot import read_snapshot

        model = self.model
        state, extra, saved = read_snapshot(path, model.config, manifest_hash(model.path), KV_BLOCK,
                                            self.max_context, model.kv_cache)
        if check is not None:
            check(extra)
        self.state = state
        self.pending, self.tap_pending = [], None
        self.drafter_feed.clear()
        self.checkpoints.clear()
        for checkpoint in saved:  # the drafter is not saved: a restore makes it start over
            self.checkpoints.add(checkpoint)
        if model.drafter is not None:  # its cache held the old context; it re-learns from the next round
            model.drafter_serves(self)
            model.drafter.reset()
        return extra
