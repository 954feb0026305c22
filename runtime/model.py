"""A loaded model: the export's sessions (prefill on the NPU or the CPU, decode, verify), its
tokenizer, drafter and memory plan. It holds no conversation: each one is a Context
(runtime/context.py) made by `new_context()`, as many as the memory plan allows, and
generation.stream(model, context, ...) runs one of them. llama.cpp keeps the same line between
llama_model and llama_context, mlx-lm between a model and the prompt cache it is given.
"""
from __future__ import annotations

import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hybrid_npu import integrity
from hybrid_npu.chat_files import sampling_defaults
from hybrid_npu.cli_common import check_threads
from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, MANIFEST
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.safe_files import TOKENIZER_BYTES, read_text

from .drafters import Drafter, DrafterCaps
from .export_check import check_chain_graph, damaged, read_manifest
from .lazy_pipelines import LazyPipelines
from .memory import plan_memory, resident_weight_bytes
from .npu_sessions import NPU_DEVICE, open_npu_pipeline, with_export_capacity
from .pipeline import CPU_DEVICE, Pipeline, cpu_graph, cpu_session
from .qnn import NpuUnavailable
from .sampling import model_defaults
from .speculation import SpecPolicy
from .speculative import COMMIT_BESIDE_MIN_BYTES, default_draft_shape
from .turn_checkpoints import DEFAULT_MAX_CHECKPOINTS

PREFILL_MODES = ("auto", "npu", "cpu")
# the CPU graphs (any-N chunks and decode, the one-token decode an export without the any-N graph runs,
# the sized verify) read the past in tiles or widen a bounded part of it, so what a call holds is
# bounded whatever the context: their sessions keep ORT's arena (runtime/pipeline.cpu_session)
BOUNDED_SCRATCH = ("cpu", "decode", "cpu_verify")


def default_make_policy(context) -> SpecPolicy:
    """A context's speculation policy for the model's draft shape (tests inject fixed costs instead).
    It asks the context through a weak proxy: the context holds its policies, and a cycle would keep
    a dropped context (its K/V) alive until Python's cyclic collector ran."""
    ref = weakref.proxy(context)
    return SpecPolicy(ref.draft_shape["depth"], verify_nodes=lambda depth: ref.verify_graph(depth),
                      verify_graphs=lambda max_depth: ref.verify_graphs(max_depth))


class Model:
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
        self.max_checkpoints = checkpoints
        self.memory = plan_memory(self.config, resident_weight_bytes(self.manifest.weights, cpu_sessions),
                                  self.kv_cache, memory or self.profile.memory_budget_bytes or None, checkpoints)
        # the shape the export records as measured best for its drafter, else a tree where rounds
        # verify on the NPU and a chain where the CPU does (runtime/speculative.py, why)
        recorded = self.manifest.drafter.draft_shape if self.manifest.drafter is not None else None
        shape = recorded.as_dict() if recorded else default_draft_shape(npu_verifies="npu_verify" in self.pipelines)
        self.draft_shape = dict(shape, total_tokens=min(shape["total_tokens"], verify.n - 1)) if verify else None
        # speculation decides per step whether a round pays (runtime/speculation/); False: every
        # step is a round. make_policy(context) -> a SpecPolicy for that context
        self.adaptive = True
        self.make_policy = default_make_policy
        # "npu": where rounds verify on the NPU the drafter drafts the next round meanwhile
        # (runtime/look_ahead.py); "always": on the CPU too; "off" (default until a device measures it)
        self.look_ahead = "off"
        self._commit_worker: ThreadPoolExecutor | None = None  # opened by commit_worker()
        self._verify_worker: ThreadPoolExecutor | None = None  # the thread an NPU verify runs on
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        self._drafter_holds = None  # weakref to the context the drafter's own cache holds

    # ---------------------------------------------------------------- contexts
    def new_context(self):
        """A fresh conversation on this model. Each one keeps its own GDN state, K/V rows and turn
        checkpoints; the memory plan covers them all together, so one more is refused when the
        budget left after the weights and the live ones cannot hold its fixed state (the first is
        always made: a prompt that does not fit is refused when it is given, naming the fix)."""
        from .context import Context

        fixed = self.memory.state_bytes + self.memory.checkpoint_bytes
        used = self.bytes_in_use()
        if used and self.memory.weights_bytes + used + fixed > self.memory.budget_bytes:
            raise UserError(f"the memory plan ({self.memory.budget_bytes / 2**30:.2f} GiB) holds no more contexts: "
                            f"{len(self._contexts)} are live; close one or raise the memory budget")
        context = Context(self)
        self._contexts.add(context)
        return context

    def bytes_in_use(self, besides=None) -> int:
        """What the live contexts (all but `besides`) hold: GDN states, checkpoint copies, K/V rows in use."""
        return sum(c.nbytes() for c in list(self._contexts) if c is not besides)

    def room_for(self, context) -> int:
        """The largest context (tokens) `context` may reach, the others' rows counted."""
        others = self.bytes_in_use(besides=context)
        if not others:
            return self.memory.max_context
        return max(self.memory.max_context - -(-others // self.memory.kv_bytes_per_token), 0)

    def drafter_serves(self, context) -> bool:
        """Give the drafter to `context`; True when it held another context's cache (it starts over
        then, and the context's drafter bookkeeping with it: Context.own_drafter)."""
        holder = self._drafter_holds() if self._drafter_holds is not None else None
        if holder is context:
            return False
        self._drafter_holds = weakref.ref(context)
        return holder is not None

    # ---------------------------------------------------------------- the drafter
    @property
    def drafter(self) -> Drafter | None:
        """The drafter speculation runs with (None: plain decoding). Given one, its capabilities are
        found once (runtime/drafters/ DrafterCaps); an object that is no Drafter is one line."""
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.drafter_caps = DrafterCaps.of(drafter) if drafter is not None else DrafterCaps()
        self._drafter = drafter

    def taps(self, out: dict[str, np.ndarray], rows) -> np.ndarray:
        """The drafter's feature of the given token rows, its taps concatenated in its order (EAGLE-3:
        low | mid | high; MTP: the residual after the last layer)."""
        return np.concatenate(self.tap_parts(out, rows), axis=-1)

    def tap_parts(self, out: dict[str, np.ndarray], rows) -> tuple:
        """taps before the concatenation: each tap's rows, in the drafter's order."""
        order = self.drafter_caps.input_order or self.config.tap_layers
        return tuple(out[f"tap.{j}"][rows] for j in order)

    # ---------------------------------------------------------------- devices
    def tiled(self, graph: str) -> bool:
        """Whether `graph` is the NPU prefill that reads attention in tiles (runtime/npu_attention.py)."""
        return graph == "npu_prefill" and getattr(self.pipelines.get(graph), "tiled", None) is not None

    def npu_fits(self, position: int) -> bool:
        """A tiled NPU prefill takes a chunk at any position; one reading a fixed K/V needs room for C
        more rows in its T_max."""
        if "npu_prefill" not in self.pipelines:
            return False
        return self.tiled("npu_prefill") or position + self.chunk <= self.profile.attention_capacity

    def prefill_device(self, n_tokens: int) -> str:
        """The device a prefill of n_tokens is sent to (known before its first chunk, for progress)."""
        return NPU_DEVICE if self.wants_npu(n_tokens) else CPU_DEVICE

    def wants_npu(self, n_tokens: int) -> bool:
        if "npu_prefill" not in self.pipelines:
            return False
        return self.prefill_mode == "npu" or n_tokens >= self.profile.npu_prefill_min_tokens

    def verify_graph(self, depth: int, position: int) -> tuple[str, int]:
        """(device, nodes) of the verify a round of `depth` levels runs at `position`: the NPU's static
        graph while the context and its N nodes fit the NPU's T_max; else the CPU's. Where the export
        has the sized graph, the nodes are the largest tree the draft shape grows at that depth
        (EAGLE-2: top_k, then top_k² per further level): exactly that many where the graph takes any
        count, else the smallest of its sizes that holds them; else its static N."""
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
        if self.npu_verify_fits(position) and self.profile.verify_device_for(cpu) == "npu":
            return NPU_DEVICE, n
        return CPU_DEVICE, cpu

    def npu_verify_fits(self, position: int) -> bool:
        """The NPU's static verify graph serves a round while the context and its N nodes fit T_max."""
        return "npu_verify" in self.pipelines and position + self.manifest.verify.n <= self.profile.attention_capacity

    def check_ids(self, ids) -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")

    # ---------------------------------------------------------------- worker threads
    def commit_worker(self, state_bytes: int) -> ThreadPoolExecutor | None:
        """The thread a speculative round commits on while the drafter observes (None where the GDN
        states are too small for that to pay: runtime/speculative.commit_beside)."""
        if state_bytes < COMMIT_BESIDE_MIN_BYTES:
            return None
        if self._commit_worker is None:  # its thread ends when the model is collected
            self._commit_worker = ThreadPoolExecutor(1, thread_name_prefix="commit")
        return self._commit_worker

    def verify_worker(self) -> ThreadPoolExecutor:
        """The thread an NPU verify runs on while the CPU drafts ahead (runtime/look_ahead.py)."""
        if self._verify_worker is None:
            self._verify_worker = ThreadPoolExecutor(1, thread_name_prefix="verify")
        return self._verify_worker

    # ---------------------------------------------------------------- opening
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
        (runtime/drafters/ chooses and opens it)."""
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
