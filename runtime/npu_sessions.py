"""Open the NPU prefill pipeline of an export for a profile: its parts (or the whole prefill graph
when it fits one part), from precompiled QNN context binaries when they match this machine's
QNN and the profile's SoC, else compiled from the ONNX graphs at the profile's static shapes."""
from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort

from .pipeline import Pipeline
from .qnn import NpuUnavailable, qnn_session_options, qnn_version

PAST_DIM, MASK_DIM = "past_len", "past_len_plus_n"  # the step graphs' only free dimensions
NPU_DEVICE = "QNN/HTP"


def npu_part_files(path: Path, manifest: dict, profile) -> list[str]:
    entry = manifest.get("npu", {}).get(profile.name)
    if entry:
        return [p["file"] for p in entry["parts"]]
    htp_bytes = manifest["weights"]["params"] * (2 if profile.npu.precision == "fp16" else 1)
    if htp_bytes <= profile.part_weight_bytes:  # the whole prefill graph is one part
        return [manifest["graphs"]["prefill"]["file"]]
    raise NpuUnavailable(f"this export has no NPU graphs for profile {profile.name} (its weights exceed one part); "
                         f"re-export with: export-hybrid SOURCE {path} --profile {profile.name}")


def _context_problem(ctx: dict, profile) -> str | None:
    want = {"qnn_version": qnn_version(), "soc_model": profile.npu.soc_model, "htp_arch": profile.npu.htp_arch}
    for key, value in want.items():
        if ctx.get(key) != value:
            return f"built for {key} {ctx.get(key)}, this machine/profile has {value}"
    return None


def open_npu_prefill(path: Path, manifest: dict, profile) -> Pipeline:
    files = npu_part_files(path, manifest, profile)
    options = profile.qnn_provider_options()
    ctx = manifest.get("npu", {}).get(profile.name, {}).get("context")
    problem = _context_problem(ctx, profile) if ctx else "none"
    sessions = []
    for i, f in enumerate(files):
        session = None
        if problem is None:
            try:
                session = ort.InferenceSession(str(path / ctx["files"][i]), qnn_session_options(options))
            except Exception as e:  # truncated or corrupt binary: rebuild from the graph
                problem = f"{ctx['files'][i]} did not load ({str(e).splitlines()[0][:120]})"
                print(f"hybrid-npu: QNN context binary unusable: {problem}; compiling from the ONNX graphs",
                      file=sys.stderr)
        elif problem != "none" and i == 0:
            print(f"hybrid-npu: QNN context binaries {problem}; compiling from the ONNX graphs", file=sys.stderr)
        if session is None:
            t_max, chunk = profile.attention_capacity, int(manifest["chunk"])
            so = qnn_session_options(options, {PAST_DIM: t_max, MASK_DIM: t_max + chunk})
            session = ort.InferenceSession(str(path / f), so)
        sessions.append(session)
    pipe = Pipeline(sessions, NPU_DEVICE, files)
    pipe.from_context = problem is None
    return pipe
