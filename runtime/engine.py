"""The engine: load an export, prefill in chunks (NPU or CPU), decode or speculate, sample.

Prefill runs the N = C graph over whole chunks and a padded tail (padding never touches the
state, the K/V or the output), on the HTP when the profile says so; decode runs the N = 1 graph
on the CPU; a speculative round runs the tree-verify graph. All read and write one State.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Callable

import numpy as np

from hybrid_npu.chat_files import sampling_defaults
from hybrid_npu.cli_common import check_threads
from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, MANIFEST, manifest_hash
from hybrid_npu import integrity
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.safe_files import TOKENIZER_BYTES, read_text

from .drafter_feed import DrafterFeed, feed_for
from .turn_checkpoints import DEFAULT_MAX_CHECKPOINTS, Checkpoint, Checkpoints, HeldContext
from .drafters import Drafter, DrafterCaps
from .export_check import check_chain_graph, damaged, read_manifest
from .memory import plan_memory, resident_weight_bytes
from .npu_sessions import NPU_DEVICE, open_npu_pipeline, with_export_capacity
from .pipeline import Pipeline, cpu_graph, cpu_session
from .qnn import NpuUnavailable
from .generation import CPU_DEVICE, catch_up_drafter, stream
from .sampling import Sampler, check_sampling, model_defaults
from .speculation import SpecPolicy
from .speculative import COMMIT_BESIDE_MIN_BYTES, default_draft_shape
from .state import KV_BLOCK, State
from .step_inputs import chain_feed, commit_chain

PREFILL_MODES = ("auto", "npu", "cpu")
# the CPU graphs (any-N chunks and decode, the one-token decode an export without the any-N graph runs,
# the sized verify) read the past in tiles or widen a bounded part of it, so what a call holds is
# bounded whatever the context: their sessions keep ORT's arena (runtime/pipeline.cpu_session)
BOUNDED_SCRATCH = ("cpu", "decode", "cpu_verify")


class LazyPipelines(dict):
    """Graph name -> Pipeline. Prefill and decode open at load (a broken export fails there); the
    rest on first use: the verify graph only once speculation runs, since a quantised export's
    session holds its own prepacked copy of the weights (0.8B int4: ~0.8 GB per session)."""

    def __init__(self, open_one: Callable[[str], Pipeline], names, eager: tuple[str, ...]):
        super().__init__()
        self._open, self._names = open_one, set(names)
        self._opening: dict[str, Future] = {}  # prefetch: name -> its session, still being opened
        for name in eager:
            self[name] = open_one(name)

    def prefetch(self, name: str) -> None:
        """Start opening `name` in the background; its first lookup waits for it (and raises what
        opening raised). Building a session is ORT's graph optimisation and, for a quantised
        export, the weights' prepacking: the embedded model's verify session took 275 ms, the
        0.8B int4 one 2.4 s, inside the first reply's first round (docs/speculation.md)."""
        if name in self or name in self._opening or name not in self._names:
            return
        # the executor's worker is joined at exit (a process that exited mid-build segfaulted)
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"open-{name}")
        self._opening[name] = pool.submit(self._open, name)
        pool.shutdown(wait=False)

    def ready(self, name: str) -> bool:
        """Whether looking `name` up now returns at once rather than waiting for its prefetch (a name
        never prefetched counts as ready: its lookup opens it, as it always did)."""
        if name in self:
            return True
        opening = self._opening.get(name)
        return opening is None or opening.done()

    def __missing__(self, name: str) -> Pipeline:
        if name not in self._names:
            raise KeyError(name)
        opening = self._opening.pop(name, None)
        if opening is not None:
            self[name] = got = opening.result()
            return got
        self[name] = pipeline = self._open(name)
        return pipeline


class Engine:
    def __init__(self, path, profile: str = "cpu", prefill: str = "auto", threads: int | None = None,
                 memory: int | None = None, drafter=None, checkpoints: int = DEFAULT_MAX_CHECKPOINTS):
        self.path = Path(path)
        manifest_file = self.path / MANIFEST
        if not manifest_file.exists():
            if (self.path / "config.json").is_file():  # a Hugging Face checkpoint: export beside it, not into it
                out = self.path.with_name(self.path.name + "-hybrid")
                raise UserError(f"{self.path} is a checkpoint, not a hybrid-npu export (no {MANIFEST}); "
                                f"export it first: export-hybrid {self.path} {out}, then load {out}")
            raise UserError(f"{self.path} is not a hybrid-npu export (no {MANIFEST}); "
                            f"create one with: export-hybrid CHECKPOINT {self.path}")
        if prefill not in PREFILL_MODES:
            raise UserError(f"prefill={prefill!r} is not one of {', '.join(PREFILL_MODES)}")
        check_threads(threads, "threads=")
        self.drafter = None
        self.manifest, self.config = read_manifest(self.path)  # one line for a damaged or lying manifest
        self.chunk = self.manifest.chunk
        self.kv_cache = self.manifest.kv_cache  # the K/V rows' dtype (runtime/state.py)
        self.profile = with_export_capacity(load_profile(profile), self.manifest)  # the export's T_max
        self.prefill_mode = prefill
        npu = self.profile.name if self.profile.has_npu and prefill != "cpu" else None
        self._drop_damaged_contexts(integrity.verify(self.path, self.manifest.integrity, self.manifest.weights, npu))  # before any text
        graphs, opened = self.manifest.graphs, {}

        def open_cpu(name: str) -> Pipeline:  # one session per graph file (cpu_graph: a shared one)
            graph = cpu_graph(graphs, name)
            file = graphs[graph].file
            if file not in opened:
                try:
                    session = cpu_session(self.path / file, self.manifest.weights, threads,
                                          arena=graph in BOUNDED_SCRATCH)
                except Exception as e:  # ORT's own error types: a file it cannot read
                    raise damaged(self.path, file, e) from None
                check_chain_graph(self.path, graph, session, self.config, graphs[graph].n, self.kv_cache)
                opened[file] = Pipeline([session], CPU_DEVICE)
            return opened[file]

        self.pipelines = LazyPipelines(open_cpu, self.manifest.graphs, eager=("prefill", "decode"))
        self.notice: str | None = None
        if self.profile.has_npu and prefill != "cpu":
            self._open_npu()
        self.tokenizer = self._load_tokenizer()
        generation = self.manifest.generation  # exports before it was recorded: their own file
        self.sampling_defaults = model_defaults(sampling_defaults(self.path) if generation is None else generation)
        verify = self.manifest.verify  # exports before speculation have none
        self.drafter = self._open_drafter(drafter, threads) if verify else None  # reset/observe/propose
        if drafter is not None and verify is None:
            raise UserError(f"{self.path} has no tree-verify graph for speculative decoding; re-export it with: "
                            f"export-hybrid SOURCE {self.path} --drafter DRAFTER")
        # CPU sessions holding weights: prefill and decode now (one when they share the any-N graph),
        # verify once speculation runs there
        cpu_verifies = "npu_verify" not in self.pipelines or self.profile.verify_device_for(2) == "cpu"
        cpu_sessions = len(opened) + (self.drafter is not None and cpu_verifies)
        if self.drafter is not None and cpu_verifies:
            # speculation is on by default: its verify session opens while the caller does something
            # else (the first prompt is still being typed), not inside the first round
            self.pipelines.prefetch("verify")
        if checkpoints < 0:
            raise UserError(f"checkpoints={checkpoints}: give 0 (none) or more")
        self.checkpoints = Checkpoints(checkpoints)
        self.memory = plan_memory(self.config, resident_weight_bytes(self.manifest.weights, cpu_sessions),
                                  self.kv_cache, memory or self.profile.memory_budget_bytes or None, checkpoints)
        # the shape the export records as measured best for its drafter, else a tree where rounds
        # verify on the NPU and a chain where the CPU does (runtime/speculative.py, why)
        recorded = self.manifest.drafter.draft_shape if self.manifest.drafter is not None else None
        shape = recorded.as_dict() if recorded else default_draft_shape(npu_verifies="npu_verify" in self.pipelines)
        self.draft_shape = dict(shape, total_tokens=min(shape["total_tokens"], verify.n - 1)) if verify else None
        self.reset()
        self.last_stats: dict = {}
        self.spec_stats = {"rounds": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0}
        # speculation decides per step whether a round pays (runtime/speculation/); False: every
        # step is a round. make_policy(engine) -> a SpecPolicy (tests inject fixed costs)
        self.adaptive = True
        self.make_policy = lambda engine: SpecPolicy(engine.draft_shape["depth"], verify_nodes=engine.verify_graph,
                                                     verify_graphs=engine.verify_graphs)
        self._verify_graphs: tuple | None = None  # (what verify_graphs read, its answer)
        self._commit_worker: ThreadPoolExecutor | None = None  # opened by commit_worker()
        # "npu": where rounds verify on the NPU the drafter drafts the next round meanwhile
        # (runtime/look_ahead.py); "always": on the CPU too; "off" (default until a device measures it)
        self.look_ahead = "off"
        self._ahead = None                                       # a kept look-ahead (look_ahead.LookAhead)
        self._verify_worker: ThreadPoolExecutor | None = None  # the thread an NPU verify runs on

    @property
    def drafter(self) -> Drafter | None:
        """The drafter speculation runs with (None: plain decoding). Given one, its capabilities are
        found once (runtime/drafters.py DrafterCaps); an object that is no Drafter is one line."""
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.drafter_caps = DrafterCaps.of(drafter) if drafter is not None else DrafterCaps()
        self._drafter = drafter

    def _drop_damaged_contexts(self, damaged: list[str]) -> None:
        """Context binaries (ctx/PROFILE/) that fail their hash are rebuilt from the graphs, like stale ones."""
        entry = self.manifest.npu.get(self.profile.name)
        if damaged and entry:
            print(f"hybrid-npu: QNN context binary unusable: {damaged[0]} is missing or differs from what the "
                  "export recorded; compiling from the ONNX graphs", file=sys.stderr)
            self.manifest = self.manifest.without_contexts(self.profile.name)

    def _open_npu(self) -> None:
        """The prefill graph (or its parts) on the HTP at static shapes: N = C, past K/V = T_max;
        the tree-verify graph too when the profile verifies on the NPU (N = tree size)."""
        try:
            self.pipelines["npu_prefill"] = open_npu_pipeline(self.path, self.manifest, self.profile)
        except NpuUnavailable as e:
            if self.prefill_mode == "npu":
                raise UserError(f"prefill='npu' but {e}") from None
            self.notice = f"profile {self.profile.name}: {e}; running on the CPU"
            print(f"hybrid-npu: {self.notice}", file=sys.stderr)
            return
        if self.profile.verifies_on_npu and self.manifest.verify is not None:
            try:
                self.pipelines["npu_verify"] = open_npu_pipeline(self.path, self.manifest, self.profile, "verify")
            except NpuUnavailable as e:
                self.notice = f"profile {self.profile.name}: {e}; verifying on the CPU"
                print(f"hybrid-npu: {self.notice}", file=sys.stderr)

    def _open_drafter(self, drafter, threads):
        """drafter: None (the export's default drafter, if any), "eagle3" / "mtp" (the export's drafter
        of that kind), an exported drafter directory, or any object with reset/observe/propose
        (runtime/drafters.py chooses and opens it)."""
        from .drafters import choose_drafter_dir, load_drafter

        if drafter is not None and not isinstance(drafter, (str, Path)):
            return drafter
        d = choose_drafter_dir(self.path, self.manifest, drafter)
        if d is None:
            return None
        if not (d / DRAFTER_MANIFEST).exists():
            raise UserError(f"{d} is not an exported drafter; add it to the model with: "
                            f"export-hybrid SOURCE {self.path} --drafter {d}")
        try:
            return load_drafter(d, threads)
        except UserError:
            raise
        except Exception as e:  # a damaged drafter.json or graph
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"drafter {d} does not load ({first}); it is damaged: re-export it with: "
                            f"export-hybrid SOURCE {self.path} --drafter DRAFTER_CHECKPOINT") from None

    def _load_tokenizer(self):
        f = self.path / "tokenizer.json"
        if not f.exists():
            return None
        from tokenizers import Tokenizer
        text = read_text(f, TOKENIZER_BYTES, "the tokenizer", f"the export is damaged: re-export it with: "
                         f"export-hybrid SOURCE {self.path}")
        try:
            return Tokenizer.from_str(text)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise damaged(self.path, f.name, e) from None

    # ---------------------------------------------------------------- steps
    def reset(self) -> None:
        self.state = State.fresh(self.config, KV_BLOCK, self.kv_cache)
        self._pending: list[int] = []
        self._tap_pending: np.ndarray | None = None
        self.checkpoints.clear()
        self._feed = feed_for(self.drafter, self.drafter_caps)  # pairs the drafter has not observed yet
        if self.drafter is not None:
            self.drafter.reset()

    def _step(self, graph: str, ids: list[int]) -> np.ndarray:
        """Advance the state by `ids` through one call of `graph`; returns the last token's logits."""
        n = (self.manifest.decode if graph == "decode" else self.manifest.prefill).n
        self._check_ids(ids)
        self.state.ensure_capacity(self.state.position + n)
        # the tiled NPU prefill masks each tile itself: no [N, T] mask over the whole context
        out = self.pipelines[graph].run(chain_feed(self.config, self.state, ids, n, mask=not self._tiled(graph)))
        commit_chain(self.state, out, ids)
        if self.drafter is not None and graph != "decode":
            self._feed_drafter(ids, self._taps(out, np.arange(len(ids))))
        self._last_out = out
        return out["logits"][0]

    def decode(self, token: int) -> np.ndarray:
        """One decode step: append `token` to the context; returns the logits after it (what
        stream() samples from on a plain step)."""
        return self._step("decode", [token])

    def verify_graph(self, depth: int) -> tuple[str, int]:
        """(device, nodes) of the verify a round of `depth` levels runs now: the NPU's static graph
        while the context and its N nodes fit the NPU's T_max; else the CPU's. Where the export has
        the sized graph, the nodes are the largest tree the draft shape grows at that depth (EAGLE-2:
        top_k, then top_k² per further level): exactly that many where the graph takes any count,
        else the smallest of its sizes that holds them; else its static N."""
        n, sized = self.manifest.verify.n, self.manifest.cpu_verify
        k = self.draft_shape["top_k"]
        real = 1 + min(self.draft_shape["total_tokens"], k + (depth - 1) * k * k)
        if sized is None or not sized.sizes:
            cpu = n
        elif sized.any_count:
            cpu = min(real, n)
        else:
            cpu = next((m for m in sized.sizes if m >= real), n)
        # the profile's measured choice for this tree's size (npu-bench calibrate), else its seed device
        if self._npu_verify_fits() and self.profile.verify_device_for(cpu) == "npu":
            return NPU_DEVICE, n
        return CPU_DEVICE, cpu

    def _npu_verify_fits(self) -> bool:
        """The NPU's static verify graph serves a round while the context and its N nodes fit T_max."""
        n = self.manifest.verify.n
        return "npu_verify" in self.pipelines and self.state.position + n <= self.profile.attention_capacity

    def verify_graphs(self, max_depth: int) -> tuple:
        """verify_graph of every depth 1..max_depth, as the speculation policy asks it each step: kept
        while the answer's inputs (where the NPU's graph fits, the draft shape) stay the same."""
        key = (max_depth, self._npu_verify_fits(), self.draft_shape["top_k"], self.draft_shape["total_tokens"])
        if self._verify_graphs is None or self._verify_graphs[0] != key:
            self._verify_graphs = (key, tuple(self.verify_graph(d) for d in range(1, max_depth + 1)))
        return self._verify_graphs[1]

    def verify_nodes(self, depth: int) -> int:
        return self.verify_graph(depth)[1]

    def commit_worker(self) -> ThreadPoolExecutor | None:
        """The thread a speculative round commits on while the drafter observes (None where the GDN
        states are too small for that to pay: runtime/speculative.commit_beside)."""
        if sum(layer.recurrent.nbytes for layer in self.state.gdn.values()) < COMMIT_BESIDE_MIN_BYTES:
            return None
        if self._commit_worker is None:  # its thread ends when the engine is collected
            self._commit_worker = ThreadPoolExecutor(1, thread_name_prefix="commit")
        return self._commit_worker

    def _taps(self, out: dict[str, np.ndarray], rows) -> np.ndarray:
        """The drafter's feature of the given token rows, its taps concatenated in its order (EAGLE-3:
        low | mid | high; MTP: the residual after the last layer)."""
        return np.concatenate(self._tap_parts(out, rows), axis=-1)

    def _tap_parts(self, out: dict[str, np.ndarray], rows) -> tuple:
        """_taps before the concatenation: each tap's rows, in the drafter's order."""
        order = self.drafter_caps.input_order or self.config.tap_layers
        return tuple(out[f"tap.{j}"][rows] for j in order)

    @property
    def drafter_feed(self) -> DrafterFeed:
        """The pairs the drafter has not observed yet (runtime/drafter_feed.py); a swapped drafter gets
        a feed of its own (it has seen none of the context: it learns from the next tokens)."""
        if self._feed.owner is not self.drafter:
            self._feed = feed_for(self.drafter, self.drafter_caps)
        return self._feed

    def _feed_drafter(self, ids: list[int], taps: np.ndarray) -> None:
        """EAGLE pairs the target's feature at position t with the token at t+1 (docs/eagle3-drafter.md
        §1.2): the last feature waits for the token that follows it. The pairs wait in the feed until
        the drafter is next needed."""
        if self._tap_pending is not None:
            self.drafter_feed.add([ids[0]], self._tap_pending[None])
        if len(ids) > 1:
            self.drafter_feed.add(list(ids[1:]), taps[:-1])
        self._tap_pending = taps[-1]

    def _check_fits(self, n_new: int) -> None:
        need, limit = self.state.position + n_new, self.memory.max_context
        if need > limit:
            who, detail, fix = self.memory.limit_and_fix()
            raise UserError(f"this needs {need} tokens of context but {who} allows {limit} ({detail}); {fix}")

    def _room(self) -> int:
        """New tokens the plan still allows: each one becomes a row of the context (the last one on
        the next step or save)."""
        return max(self.memory.max_context - self.state.position, 0)

    def memory_report(self) -> dict:
        """Fixed and per-token costs, the context now and the largest one the budget allows.
        context_tokens counts every token of the conversation, the last reply's final token included
        (it enters the state on the next step): the count the REPL's status line and last_stats give."""
        return {"state_bytes": self.memory.state_bytes, "checkpoint_bytes": self.memory.checkpoint_bytes,
                "checkpoints": len(self.checkpoints), "kv_bytes_per_token": self.memory.kv_bytes_per_token,
                "weights_bytes": self.memory.weights_bytes, "budget_bytes": self.memory.budget_bytes,
                "context_tokens": self.state.position + len(self._pending), "max_context": self.memory.max_context,
                "kv_bytes_in_use": self.state.kv_bytes_in_use()}

    def _check_ids(self, ids) -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")

    def _tiled(self, graph: str) -> bool:
        """Whether `graph` is the NPU prefill that reads attention in tiles (runtime/npu_attention.py)."""
        return graph == "npu_prefill" and getattr(self.pipelines.get(graph), "tiled", None) is not None

    def _npu_fits(self) -> bool:
        """A tiled NPU prefill takes a chunk at any position; one reading a fixed K/V needs room for C
        more rows in its T_max."""
        if "npu_prefill" not in self.pipelines:
            return False
        return self._tiled("npu_prefill") or self.state.position + self.chunk <= self.profile.attention_capacity

    def prefill_device(self, n_tokens: int) -> str:
        """The device a prefill of n_tokens is sent to (known before its first chunk, for progress)."""
        return NPU_DEVICE if self._wants_npu(n_tokens) else CPU_DEVICE

    def _wants_npu(self, n_tokens: int) -> bool:
        if "npu_prefill" not in self.pipelines:
            return False
        return self.prefill_mode == "npu" or n_tokens >= self.profile.npu_prefill_min_tokens

    def prefill(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
                checkpoint_at=()) -> np.ndarray:
        """Append `ids` to the context in chunks of C; returns the logits after the last one.
        Chunks go to the NPU when the profile says so: at any position where its prefill reads attention
        in tiles, else while its T_max has room.
        checkpoint_at: context positions at which to keep a turn checkpoint (a chunk ends there)."""
        if not ids:
            raise UserError("empty prompt: give at least one token")
        self._check_fits(len(ids))
        logits, devices = None, []
        npu = self._wants_npu(len(ids))
        base = self.state.position
        marks = sorted({m - base for m in checkpoint_at if base <= m < base + len(ids)})
        start = 0
        while start < len(ids):
            if marks and marks[0] == start:
                self.take_checkpoint()
                marks.pop(0)
            end = min(start + self.chunk, len(ids), *marks[:1])
            on_npu = npu and self._npu_fits()
            if on_npu and not self._tiled("npu_prefill") and self.state.capacity != self.profile.attention_capacity:
                self.state.resize(self.profile.attention_capacity)  # untiled NPU graphs read exactly T_max rows
            devices.append(NPU_DEVICE if on_npu else CPU_DEVICE)
            logits = self._step("npu_prefill" if on_npu else "prefill", list(ids[start:end]))
            start = end
            if progress:
                progress(end, len(ids))
        self._prefill_devices = "+".join(dict.fromkeys(devices))
        if self.state.capacity > self.state.position + 2 * KV_BLOCK:  # back from T_max: CPU decode reads
            self.state.resize((self.state.position // KV_BLOCK + 1) * KV_BLOCK)  # every row it is given
        return logits

    # ---------------------------------------------------------------- turn checkpoints
    def take_checkpoint(self) -> None:
        """Keep a copy of the state at the current position (the memory plan counts the limit)."""
        if self.checkpoints.limit == 0:
            return
        if self._pending:
            raise ValueError("take_checkpoint: the last reply's final token is not in the state yet")
        if self.drafter is not None:  # a rewind to here continues the drafter from here
            catch_up_drafter(self)
        length = self.drafter.length if self.drafter is not None and self.drafter_caps.rewinds else None
        self.checkpoints.add(Checkpoint.take(self.state, self._tap_pending, length))

    def resumable(self, prompt_ids: list[int]) -> int:
        """How many of prompt_ids resume() would keep, without changing anything."""
        return HeldContext(self.state, self._pending, self.checkpoints.items).resumable(prompt_ids)

    def resume(self, prompt_ids: list[int]) -> int:
        """Make the context a prefix of `prompt_ids` as cheaply as it can: keep it when it already is
        one, else go back to the latest checkpoint at or before where the two part (at least one
        prompt token is left to prefill, for its logits), else start over. Returns how many prompt
        tokens are in the context now: generate(prompt_ids[kept:], append=True) continues."""
        kept = self.resumable(prompt_ids)
        if kept == len(self.context_ids()):
            return kept  # the context is a prefix of the prompt (or empty): keep it all
        if kept == 0:
            self.reset()
            return 0
        checkpoint = self.checkpoints.latest_at_or_before(kept)
        self._pending = []  # the checkpoint is inside the committed context; the pending token is past it
        checkpoint.restore(self.state)
        self.checkpoints.drop_after(checkpoint.position)
        self._tap_pending = checkpoint.tap
        self.drafter_feed.clear()  # pairs after the checkpoint (the one before it was observed)
        if self.drafter is not None:
            if self.drafter_caps.rewinds and checkpoint.drafter_length is not None:
                self.drafter.rewind(checkpoint.drafter_length)
            else:  # a drafter that cannot go back starts over and learns from the next tokens
                self.drafter.reset()
                self._tap_pending = None
        return checkpoint.position

    def detach(self) -> HeldContext:
        """Take the conversation out of the engine (a server holding several); the engine starts
        over. The drafter's own cache is not kept: it relearns from the next prefill."""
        held = HeldContext(self.state, list(self._pending), list(self.checkpoints.items))
        self.reset()
        return held

    def attach(self, held: HeldContext) -> None:
        """Put back a context detach() took out; the one in the engine now is dropped."""
        self.reset()
        self.state, self._pending = held.state, list(held.pending)
        for checkpoint in held.checkpoints:
            self.checkpoints.add(Checkpoint(checkpoint.position, checkpoint.conv, checkpoint.recurrent))

    def prefill_logits(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits [vocab] after the last prompt token, from a fresh state. last_stats then describes
        this call (a scoring pass: where its prefill ran and how fast, no decode)."""
        self.reset()
        t0 = time.perf_counter()
        logits = self.prefill(list(prompt_ids))
        t = time.perf_counter() - t0
        self.last_stats = {"prefill_tokens": len(prompt_ids), "prefill_tokens_per_s": len(prompt_ids) / max(t, 1e-9),
                           "prefill_device": self._prefill_devices, "decode_tokens": 0, "ttft_s": t,
                           "context_tokens": self.state.position}
        return logits

    # ---------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = True,
                 on_token: Callable[[int], None] | None = None, append: bool = False,
                 progress: Callable[[int, int], None] | None = None, speculative: bool | None = None,
                 should_stop: Callable[[], bool] | None = None, checkpoint_at=()) -> list[int]:
        """Prefill the prompt, then decode up to max_new_tokens; returns the new ids.

        append=False starts a fresh context; append=True continues the conversation: only the new
        part is prefilled (on the NPU when it reaches the profile's threshold). speculative (default:
        on when a drafter is attached) drafts a token tree per round and verifies it in one pass;
        the output is exactly the plain output (greedy) or has exactly its distribution (sampled).
        should_stop (e.g. Ctrl-C) is asked between steps: a speculative round always finishes, so the
        state stays at the last committed token and the next turn can continue after it.
        checkpoint_at: context positions inside this prefill at which to keep a turn checkpoint.
        temperature/top_k/top_p left None take the model's defaults (sampling_defaults: its
        generation_config; greedy unless that says do_sample); temperature 0 is greedy."""
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)  # max_new_tokens named first
        sampler = Sampler.from_defaults(self.sampling_defaults, temperature, top_k, top_p, seed)
        new: list[int] = []
        with closing(stream(self, prompt_ids, sampler, max_new_tokens, stop_at_eos=stop_at_eos, append=append,
                            speculative=speculative, progress=progress, should_stop=should_stop,
                            checkpoint_at=checkpoint_at)) as tokens:
            for t in tokens:
                new.append(t)
                if on_token:
                    on_token(t)
        return new

    def context_ids(self) -> list[int]:
        """Every token of the conversation so far: the committed ones and the last reply's final
        token (not yet in the state); a chat front end compares it with its next rendered prompt."""
        return list(self.state.tokens) + list(self._pending)

    # ---------------------------------------------------------------- snapshots
    def save_state(self, path, extra: dict[str, str] | None = None) -> None:
        """The whole conversation (GDN + conv states, K/V rows in use, token history) to one file;
        `extra` (str -> str, e.g. a chat's messages) goes into the same file under its checksum."""
        from .snapshot import save_state

        if self._pending:  # the last reply's final token goes into the state first
            self._step("decode", self._pending)
            self._pending = []
        save_state(self.state, path, manifest_hash(self.path), extra, self.checkpoints.items)

    def load_state(self, path, check: Callable[[dict], None] | None = None) -> dict:
        """Resume a conversation saved by save_state (its turn checkpoints too); refuses another
        model's or a damaged file. Returns the snapshot's extra metadata; `check(extra)` may refuse it
        (raise) before anything changes."""
        from .snapshot import read_snapshot

        state, extra, saved = read_snapshot(path, self.config, manifest_hash(self.path), KV_BLOCK,
                                            self.memory.max_context, self.kv_cache)
        if check is not None:
            check(extra)
        self.state = state
        self._pending, self._tap_pending = [], None
        self.drafter_feed.clear()
        self.checkpoints.clear()
        for checkpoint in saved:  # the drafter is not saved: a restore makes it start over
            self.checkpoints.add(checkpoint)
        if self.drafter is not None:  # its cache held the old context; it re-learns from the next round
            self.drafter.reset()
        return extra

