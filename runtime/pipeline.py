"""One step graph as ONNX Runtime sessions: a whole graph, or NPU parts run in order with the
hidden state handed from part to part. Each session gets only the inputs it declares; outputs
of all parts merge into one dict (each part returns only its own layers' state)."""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from hybrid_npu.manifest import Weights

from .memory import prepacks
from .npu_attention import feed_attention
from .session_options import cpu_inference_session, session_options

CPU_DEVICE = "CPU"  # where a step ran, as stats and npu-bench report it (the NPU's: npu_sessions.NPU_DEVICE)


def cpu_graph(graphs: dict, name: str) -> str:
    """The export graph a CPU step `name` runs: prefill and decode share the any-N "cpu" graph
    where the export has one (one session, so its quantised weights are prepacked once); verify
    runs the graph sized to the draft ("cpu_verify") where the export has one."""
    if name == "verify" and "cpu_verify" in graphs:
        return "cpu_verify"
    return "cpu" if name in ("prefill", "decode") and "cpu" in graphs else name


def cpu_session(path, weights: Weights, threads: int | None = None, arena: bool = False) -> ort.InferenceSession:
    """A CPU session of one of the export's graphs, set up the way every reader of an export needs
    (weights: the export's manifest weights record). arena: keep ONNX Runtime's memory arena, for a
    graph whose scratch a call holds is bounded whatever the context (the tiled CPU graphs:
    kernels/attention.py)."""
    opts = session_options(threads)
    # A large float export does not prepack: its weights stay in the memory-mapped weights.bin that
    # every session of the model shares (held once in RAM, ~1 s to load). Measured on Qwen3.5-0.8B
    # fp32 with all sessions: PSS 3.3 vs 7.4 GB, prefill 71 vs 85 tok/s, decode within ~10% either
    # way. A small one does (runtime/memory.py prepacks: why, measured). Quantised exports must:
    # MatMulNBits without it dequantises all of B on every call (measured 15x slower); each session
    # then holds its own packed copy. HYBRID_NPU_PREPACK=1 prepacks any export.
    # No arena where a call's scratch grows with the context (a chunk of the NPU-shaped prefill reads
    # [C, T] scores): it goes back to the system after each call instead of staying reserved. With a
    # bounded scratch the arena is kept: without it every large block is a fresh mapping, paged in
    # again on every call (a decode step over an fp16 cache at 32k: 3.5 against ~10 tok/s fp32).
    opts.enable_cpu_mem_arena = arena
    if os.environ.get("HYBRID_NPU_PREPACK") != "1" and not prepacks(weights):
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return cpu_inference_session(path, opts)


_FLOAT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16)}

STATE_PEAK = 64.0  # the largest |entry| of a recurrent state the HTP is fed (in its per-head units)


def _state_units(feed: dict, wanted: set[str], npu: bool) -> dict[str, np.ndarray]:
    """Per-head units for each recurrent state a graph takes in units (recurrent_scale.{i}): on the
    NPU u = max(1, max|S|/64), since the HTP computes in fp16 and a long low-decay context's state
    can pass 65,504 (docs/npu-numerics.md); on the CPU 1 (fp32 needs none: numerics unchanged)."""
    units = {}
    for name in wanted:
        if name.startswith("recurrent_scale.") and name not in feed:
            layer = name.split(".", 1)[1]
            state = feed[f"recurrent_state.{layer}"]
            peak = np.abs(state).max(axis=(1, 2)) if npu else np.zeros(state.shape[0])
            units[layer] = np.maximum(peak / STATE_PEAK, 1.0).astype(np.float32)
    return units


class Pipeline:
    def __init__(self, sessions: list[ort.InferenceSession], device: str, files: list[str] | None = None,
                 attend=feed_attention):
        """attend(layer, result, feed) -> attn_out: the attention core between two segments of a tiled
        NPU prefill (runtime/npu_attention.py), run where a part hands out attn_q.{layer}."""
        self.sessions, self.device, self.files, self.attend = sessions, device, files or [], attend
        # overridable initializers: inputs with a default (the any-N graph's chunk-only inputs)
        self._inputs = [{i.name for i in (*s.get_inputs(), *s.get_overridable_initializers())} for s in sessions]
        self._outputs = [[o.name for o in s.get_outputs()] for s in sessions]
        # the float dtype each session takes its past K/V in, where it differs from the cache's own
        # (an NPU part reads fp32 rows out of an fp16 cache): widened or narrowed per call
        self._kv_dtypes = [{i.name: _FLOAT_TYPES[i.type] for i in s.get_inputs()
                            if i.name.startswith(("past_key.", "past_value.")) and i.type in _FLOAT_TYPES}
                           for s in sessions]

    def run(self, feed: dict[str, np.ndarray], on_part=None) -> dict[str, np.ndarray]:
        """on_part(i, inputs): sees what part i is fed (the QDQ calibration records it)."""
        out: dict[str, np.ndarray] = {}
        feed = dict(feed)
        for i, (session, wanted, names) in enumerate(zip(self.sessions, self._inputs, self._outputs)):
            inputs = {k: v for k, v in feed.items() if k in wanted}
            for name, dtype in self._kv_dtypes[i].items():
                if name in inputs and inputs[name].dtype != dtype and inputs[name].dtype.kind == "f":
                    inputs[name] = inputs[name].astype(dtype)
            units = _state_units(feed, wanted, npu=self.device != "CPU")
            for layer, u in units.items():
                inputs[f"recurrent_state.{layer}"] = inputs[f"recurrent_state.{layer}"] / u[:, None, None]
                inputs[f"recurrent_scale.{layer}"] = u
            if on_part is not None:
                on_part(i, inputs)
            result = dict(zip(names, session.run(names, inputs)))
            for layer, u in units.items():  # back to real units: the chain's state, a tree's commit u
                for name, unit in ((f"recurrent_state_out.{layer}", u[:, None, None]), (f"commit_u.{layer}", u[:, None])):
                    if name in result:
                        result[name] = result[name] * unit
            if "hidden_out" in result:
                feed["hidden_in"] = result.pop("hidden_out")
            for name in [k for k in result if k.startswith("attn_q.")]:
                layer = name.split(".", 1)[1]
                feed[f"attn_out.{layer}"] = self.attend(int(layer), result, feed)
                feed[f"attn_gate.{layer}"] = result.pop(f"attn_gate.{layer}")
            out.update(result)
        return out
