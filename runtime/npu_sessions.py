"""Open an NPU pipeline of an export for a profile, prefill or tree verify: its parts (or the
whole graph when it fits one part), from precompiled QNN context binaries when they match this
machine's QNN and the profile's SoC, else compiled from the ONNX graphs at the profile's static
shapes (N tokens, past K/V = T_max rows)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hybrid_npu.format import MASK_DIM, NPU_GRAPHS, PAST_DIM

from .pipeline import Pipeline
from .qnn import NpuUnavailable, qnn_session, qnn_session_options, qnn_version

NPU_DEVICE = "QNN/HTP"


# graph -> (the manifest's NPU entry keys for its parts and context binaries)


def npu_part_files(path: Path, manifest: dict, profile, graph: str = "prefill") -> list[str]:
    parts_key, _ = NPU_GRAPHS[graph]
    entry = manifest.get("npu", {}).get(profile.name)
    if entry and entry.get(parts_key):
        return [p["file"] for p in entry[parts_key]]
    htp_bytes = manifest["weights"]["params"] * (2 if profile.npu.precision == "fp16" else 1)
    # the whole CPU graph as one part: float exports only (a quantised one's MatMulNBits take 2-D
    # inputs, which the HTP refuses; its NPU parts are built 3-D by export-hybrid --profile)
    float_weights = manifest["weights"].get("mode", "float") == "float"
    if float_weights and htp_bytes <= profile.part_weight_bytes and graph in manifest["graphs"]:
        return [manifest["graphs"][graph]["file"]]
    raise NpuUnavailable(f"this export has no NPU {graph} graphs for profile {profile.name}; "
                         f"re-export with: export-hybrid SOURCE {path} --profile {profile.name}")


def with_export_capacity(profile, manifest: dict):
    """The profile with the T_max this export's NPU graphs were planned and compiled for
    (export-hybrid --max-context overrides the profile's attention_capacity)."""
    t_max = manifest.get("npu", {}).get(profile.name, {}).get("attention_capacity")
    if t_max is None or t_max == profile.attention_capacity:
        return profile
    return dataclasses.replace(profile, attention_capacity=int(t_max))


def _context_problem(ctx: dict, profile) -> str | None:
    want = {"qnn_version": qnn_version(), "soc_model": profile.npu.soc_model, "htp_arch": profile.npu.htp_arch}
    for key, value in want.items():
        if ctx.get(key) != value:
            return f"built for {key} {ctx.get(key)}, this machine/profile has {value}"
    return None


def open_npu_pipeline(path: Path, manifest: dict, profile, graph: str = "prefill") -> Pipeline:
    files = npu_part_files(path, manifest, profile, graph)
    n = int(manifest["chunk"]) if graph == "prefill" else int(manifest["graphs"]["verify"]["n"])
    options = profile.qnn_provider_options()
    ctx = manifest.get("npu", {}).get(profile.name, {}).get(NPU_GRAPHS[graph][1])
    problem = _context_problem(ctx, profile) if ctx else "none"
    sessions = []
    for i, f in enumerate(files):
        session = None
        if problem is None:
            try:
                session = qnn_session(str(path / ctx["files"][i]), qnn_session_options(options))
            except Exception as e:  # truncated or corrupt binary: rebuild from the graph
                problem = f"{ctx['files'][i]} did not load ({str(e).splitlines()[0][:120]})"
                print(f"hybrid-npu: QNN context binary unusable: {problem}; compiling from the ONNX graphs",
                      file=sys.stderr)
        elif i == 0:  # a compile takes minutes with no other sign of life: say what it is, and that it is once
            why = "no QNN context binaries for this profile" if problem == "none" else f"QNN context binaries {problem}"
            print(f"hybrid-npu: {why}; compiling from the ONNX graphs for the NPU ({graph}, a minute or two; "
                  "once per run: the engine keeps it)", file=sys.stderr, flush=True)
        if session is None:
            t_max = profile.attention_capacity
            so = qnn_session_options(options, {PAST_DIM: t_max, MASK_DIM: t_max + n})
            try:
                session = qnn_session(str(path / f), so)
            except Exception as e:  # a node the HTP refuses (CPU fallback is off): the CPU takes over
                raise NpuUnavailable(f"the HTP refused {f} ({str(e).splitlines()[0][:160]}); re-export with: "
                                     f"export-hybrid SOURCE {path} --profile {profile.name}") from None
        sessions.append(session)
    pipe = Pipeline(sessions, NPU_DEVICE, files)
    pipe.from_context = problem is None
    return pipe
