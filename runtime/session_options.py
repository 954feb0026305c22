"""ONNX Runtime SessionOptions, set up in one place for every session the project opens (the
engine's CPU graphs, the drafter, QDQ calibration, the NPU's QNN sessions, the benchmarks' bounds).

Threads: the caller's (None: ORT's default, one per core). Spinning: ORT's intra-op workers spin
between kernels, which a step of many short kernels needs; here they stop spinning when a run
ends (session.force_spinning_stop). Each session owns a pool, and one left spinning after its run
took the cores from the next session's: the verify graph's pool from the decode step after a round,
the decode pool from the round after a plain step (docs/speculation.md). Paired on the embedded
model (verify 8 nodes, decode between): verify 7.3-7.8 -> 6.3-6.4 ms a round, the chat chain
speculation 1.17-1.21x -> 1.21-1.32x plain; plain decode within noise of spinning on (0.97-1.04x,
0.8B int4 and embedded). HYBRID_NPU_SPINNING=0 turns spinning off altogether, for a machine whose
cores are busy with other work: measured on 2 cores, int4, the VM loaded by other work, not
spinning was 1.28x prefill / 1.76x decode faster; quiet, spinning was 1.04x / 1.11x faster.
"""
from __future__ import annotations

import os

import onnxruntime as ort

from .huge_pages import new_memory_on_huge_pages


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Options every session starts from: errors-only logging (ORT's initializer-cleanup notes are
    not the user's business), the thread count, the spinning choice."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if os.environ.get("HYBRID_NPU_SPINNING") == "0":
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    else:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def cpu_inference_session(model, opts: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """A CPU EP session of a model path (or serialised bytes) with these options (default: session_options()).
    What it allocates (a quantised graph's prepacked weights) goes onto huge pages where the OS allows
    (huge_pages.py: decode 1.07-1.09x on Linux)."""
    with new_memory_on_huge_pages():
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), opts or session_options(),
                                    providers=["CPUExecutionProvider"])
