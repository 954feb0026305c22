"""What export-hybrid uses of the runtime, in one place: the parity check and the QDQ calibration
run the exported graphs exactly as the runtime does (same sessions, state, feeds and commits),
the summary plans memory as `hybrid_npu.load` will, and the NPU steps open QNN sessions.
export/ imports the runtime only through this module (tests/test_layering.py); the runtime never
imports export/."""
from __future__ import annotations

from .turn_checkpoints import DEFAULT_MAX_CHECKPOINTS
from .memory import MARGIN_BYTES, plan_memory, resident_weight_bytes
from .npu_sessions import npu_part_files, with_export_capacity
from .pipeline import Pipeline, cpu_graph, cpu_session
from .qnn import NpuUnavailable, qnn_devices, qnn_session_options, qnn_version
from .session_options import cpu_inference_session
from .speculative import Tree, commit_path, tree_feed
from .state import State
from .step_inputs import chain_feed, commit_chain

__all__ = ["DEFAULT_MAX_CHECKPOINTS", "MARGIN_BYTES", "plan_memory", "resident_weight_bytes", "npu_part_files",
           "with_export_capacity", "Pipeline", "cpu_graph", "cpu_session", "NpuUnavailable", "qnn_devices",
           "qnn_session_options", "qnn_version", "cpu_inference_session", "Tree", "commit_path", "tree_feed", "State", "chain_feed",
           "commit_chain"]
