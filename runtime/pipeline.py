"""One step graph as ONNX Runtime sessions: a whole graph, or NPU parts run in order with the
hidden state handed from part to part. Each session gets only the inputs it declares; outputs
of all parts merge into one dict (each part returns only its own layers' state)."""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort


def cpu_graph(graphs: dict, name: str) -> str:
    """The export graph a CPU step `name` runs: prefill and decode share the any-N "cpu" graph
    where the export has one (one session, so its quantised weights are prepacked once); verify
    runs the graph sized to the draft ("cpu_verify") where the export has one."""
    if name == "verify" and "cpu_verify" in graphs:
        return "cpu_verify"
    return "cpu" if name in ("prefill", "decode") and "cpu" in graphs else name


def cpu_session(path, manifest: dict, threads: int | None = None) -> ort.InferenceSession:
    """A CPU session of one of the export's graphs, set up the way every reader of an export needs."""
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3  # errors only: ORT's initializer-cleanup notes are not the user's business
    # No prepacking: the weights stay in the memory-mapped weights.bin that every session of
    # the model shares (held once in RAM, ~1 s to load). Measured on Qwen3.5-0.8B fp32 with all
    # sessions: PSS 3.3 vs 7.4 GB, prefill 71 vs 85 tok/s, decode within ~10% either way.
    # No arena: a long prefill's attention scratch (scores over the whole context) goes back to
    # the system after each call instead of staying reserved as the context grows.
    opts.enable_cpu_mem_arena = False
    # Quantised exports must prepack: MatMulNBits without it dequantises all of B on every call
    # (measured 15x slower); each session then holds its own packed copy.
    quantized = manifest["weights"].get("mode", "float") != "float"
    if os.environ.get("HYBRID_NPU_PREPACK") != "1" and not quantized:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class Pipeline:
    def __init__(self, sessions: list[ort.InferenceSession], device: str, files: list[str] | None = None):
        self.sessions, self.device, self.files = sessions, device, files or []
        # overridable initializers: inputs with a default (the any-N graph's chunk-only inputs)
        self._inputs = [{i.name for i in (*s.get_inputs(), *s.get_overridable_initializers())} for s in sessions]
        self._outputs = [[o.name for o in s.get_outputs()] for s in sessions]

    def run(self, feed: dict[str, np.ndarray], on_part=None) -> dict[str, np.ndarray]:
        """on_part(i, inputs): sees what part i is fed (the QDQ calibration records it)."""
        out: dict[str, np.ndarray] = {}
        feed = dict(feed)
        for i, (session, wanted, names) in enumerate(zip(self.sessions, self._inputs, self._outputs)):
            inputs = {k: v for k, v in feed.items() if k in wanted}
            if on_part is not None:
                on_part(i, inputs)
            result = dict(zip(names, session.run(names, inputs)))
            if "hidden_out" in result:
                feed["hidden_in"] = result.pop("hidden_out")
            out.update(result)
        return out
