"""Run a GraphBuilder graph on ONNX Runtime's CPU EP (for kernel tests)."""
import numpy as np
import onnx
import onnxruntime as ort


def run_graph(g, feeds: dict) -> list[np.ndarray]:
    model = g.model({})
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)
