"""One step graph as ONNX Runtime sessions: a whole graph, or NPU parts run in order with the
hidden state handed from part to part. Each session gets only the inputs it declares; outputs
of all parts merge into one dict (each part returns only its own layers' state)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort


class Pipeline:
    def __init__(self, sessions: list[ort.InferenceSession], device: str, files: list[str] | None = None):
        self.sessions, self.device, self.files = sessions, device, files or []
        self._inputs = [{i.name for i in s.get_inputs()} for s in sessions]
        self._outputs = [[o.name for o in s.get_outputs()] for s in sessions]

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        feed = dict(feed)
        for session, wanted, names in zip(self.sessions, self._inputs, self._outputs):
            result = dict(zip(names, session.run(names, {k: v for k, v in feed.items() if k in wanted})))
            if "hidden_out" in result:
                feed["hidden_in"] = result.pop("hidden_out")
            out.update(result)
        return out
