"""Open an NPU pipeline of an export for a profile, prefill or tree verify: its parts (or the
whole graph when it fits one part), from precompiled QNN context binaries when they match this
machine's QNN and the profile's SoC, else compiled from the ONNX graphs at the profile's static
shapes (N tokens; the prefill's segments with the attention tile graph between them, B rows a
tile; the verify graph's past K/V = T_max rows)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import MASK_DIM, PAST_DIM
from hybrid_npu.manifest import Contexts, Manifest, Tile

from .npu_attention import TileAttention
from .pipeline import Pipeline
from .qnn import NpuUnavailable, qnn_devices, qnn_session, qnn_session_options, qnn_version

NPU_DEVICE = "QNN/HTP"


def npu_part_files(path: Path, manifest: Manifest, profile, graph: str = "prefill") -> list[str]:
    entry = manifest.npu.get(profile.name)
    if entry and entry.graph_parts(graph):
        return [p.file for p in entry.graph_parts(graph)]
    htp_bytes = manifest.weights.params * (2 if profile.npu.precision == "fp16" else 1)
    # the whole CPU graph as one part: float exports only (a quantised one's MatMulNBits take 2-D
    # inputs, which the HTP refuses; its NPU parts are built 3-D by export-hybrid --profile)
    float_weights = manifest.weights.mode == "float"
    if float_weights and htp_bytes <= profile.part_weight_bytes and graph in manifest.graphs:
        return [manifest.graphs[graph].file]
    raise NpuUnavailable(f"this export has no NPU {graph} graphs for profile {profile.name}; "
                         f"re-export with: export-hybrid SOURCE {path} --profile {profile.name}")


def with_export_capacity(profile, manifest: Manifest):
    """The profile with the T_max this export's NPU graphs were planned and compiled for
    (export-hybrid --max-context overrides the profile's attention_capacity)."""
    entry = manifest.npu.get(profile.name)
    t_max = entry.attention_capacity if entry is not None else None
    if t_max is None or t_max == profile.attention_capacity:
        return profile
    return dataclasses.replace(profile, attention_capacity=int(t_max))


def _context_problem(ctx: Contexts, profile) -> str | None:
    want = {"qnn_version": qnn_version(), "soc_model": profile.npu.soc_model, "htp_arch": profile.npu.htp_arch}
    for key, value in want.items():
        if ctx.built_for(key) != value:
            return f"built for {key} {ctx.built_for(key)}, this machine/profile has {value}"
    return None


def check_tiles(path: Path, manifest: Manifest, profile) -> Tile | None:
    """The export's NPU attention tile entry for the profile (None: no NPU prefill graphs for it): an
    export whose NPU prefill reads a fixed K/V (no tiles), or whose tiles take another size than the
    profile's, is refused in one line naming the fix."""
    entry = manifest.npu.get(profile.name)
    if not entry or not entry.parts:
        return None
    fix = f"re-export with: export-hybrid SOURCE {path} --profile {profile.name}"
    tile = entry.tile
    if not tile:
        raise UserError(f"{path} has NPU graphs for profile {profile.name} that read a fixed K/V of "
                        f"{entry.attention_capacity} rows, not attention tiles; {fix}")
    built = entry.attention_tile
    if built != profile.attention_tile:
        raise UserError(f"{path}'s NPU attention tiles were built for attention_tile = {built}, but profile "
                        f"{profile.name} says {profile.attention_tile}; set attention_tile = {built} in the "
                        f"profile or {fix}")
    return tile


def _sessions(path: Path, files: list[str], ctx: Contexts | None, profile, free_dims: dict,
              graph: str) -> tuple[list, bool]:
    """Sessions of `files` from their context binaries when those match, else compiled from the graphs."""
    options = profile.qnn_provider_options()
    problem = _context_problem(ctx, profile) if ctx else "none"
    sessions = []
    for i, f in enumerate(files):
        session = None
        if problem is None:
            try:
                session = qnn_session(str(path / ctx.files[i]), qnn_session_options(options))
            except Exception as e:  # truncated or corrupt binary: rebuild from the graph
                problem = f"{ctx.files[i]} did not load ({str(e).splitlines()[0][:120]})"
                print(f"hybrid-npu: QNN context binary unusable: {problem}; compiling from the ONNX graphs",
                      file=sys.stderr)
        elif i == 0:  # a compile takes minutes with no other sign of life: say what it is, and that it is once
            qnn_devices()  # no QNN at all says so (NpuUnavailable) instead of announcing a compile
            why = "no QNN context binaries for this profile" if problem == "none" else f"QNN context binaries {problem}"
            print(f"hybrid-npu: {why}; compiling from the ONNX graphs for the NPU ({graph}, a minute or two; "
                  "once per run: the engine keeps it)", file=sys.stderr, flush=True)
        if session is None:
            so = qnn_session_options(options, free_dims)
            try:
                session = qnn_session(str(path / f), so)
            except Exception as e:  # a node the HTP refuses (CPU fallback is off): the CPU takes over
                raise NpuUnavailable(f"the HTP refused {f} ({str(e).splitlines()[0][:160]}); re-export with: "
                                     f"export-hybrid SOURCE {path} --profile {profile.name}") from None
        sessions.append(session)
    return sessions, problem is None


def open_npu_pipeline(path: Path, manifest: Manifest | dict, profile, graph: str = "prefill") -> Pipeline:
    """prefill: the segments cut at the attention cores with the tile graph between them where the
    export has them (any context); else one graph or parts reading T_max past rows (verify, and a
    float export with no NPU graphs of its own). manifest: the export's record (or model.json as
    parsed, from scripts and tests)."""
    manifest = Manifest.of(manifest, path)
    files = npu_part_files(path, manifest, profile, graph)
    n = manifest.chunk if graph == "prefill" else manifest.verify.n
    entry = manifest.npu.get(profile.name)
    t_max = profile.attention_capacity
    tile = check_tiles(path, manifest, profile) if graph == "prefill" else None
    sessions, from_context = _sessions(path, files, entry.graph_contexts(graph) if entry else None, profile,
                                       {PAST_DIM: t_max, MASK_DIM: t_max + n}, graph)
    if tile is None:
        pipe = Pipeline(sessions, NPU_DEVICE, files)
        pipe.tiled = None
    else:
        tile_files = tile.files
        tile_sessions, tile_from_context = _sessions(path, tile_files, entry.tile_context, profile, {},
                                                     "attention tiles")
        bulk = (tile_sessions[1], int(tile.bulk_rows)) if len(tile_sessions) > 1 else None
        pipe = Pipeline(sessions, NPU_DEVICE, files, attend=TileAttention(tile_sessions[0], int(tile.rows), n, bulk))
        pipe.tiled = pipe.attend
        from_context = from_context and tile_from_context
    pipe.from_context = from_context
    return pipe
