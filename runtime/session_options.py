"""ONNX Runtime SessionOptions, set up in one place for every session the project opens (the
engine's CPU graphs, the drafter, QDQ calibration, the NPU's QNN sessions, the benchmarks' bounds).

Threads: the caller's (None: ORT's default, one per core). Spinning: ORT's intra-op workers spin
between kernels by default; HYBRID_NPU_SPINNING=0 makes them sleep, for a machine whose cores are
busy with other work. Measured on 2 cores, int4, paired A/B (docs/cpu-speed.md): with the VM
loaded by other work, not spinning was 1.28x prefill / 1.76x decode faster; with it quiet,
spinning was 1.04x / 1.11x faster, so the default stays ORT's.
"""
from __future__ import annotations

import os

import onnxruntime as ort


def session_options(threads: int | None = None, secondary: bool = False) -> ort.SessionOptions:
    """Options every session starts from: errors-only logging (ORT's initializer-cleanup notes are
    not the user's business), the thread count, the spinning choice. secondary: a session called
    between the main one's calls (the verify graph between decode steps) never spins: each session
    owns a pool, and its workers spinning on after its call took the cores from the next decode
    step (docs/speculation.md: a plain step right after a round cost 1.44-2.30x a plain step before
    it with the verify pool spinning, 0.33-0.69x without; verify 36.4 vs 8.7 ms)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if secondary or os.environ.get("HYBRID_NPU_SPINNING") == "0":
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def cpu_inference_session(model, opts: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """A CPU EP session of a model path (or serialised bytes) with these options (default: session_options())."""
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), opts or session_options(),
                                providers=["CPUExecutionProvider"])
