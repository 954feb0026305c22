"""--check-npu: every NPU graph of an export for a profile, compiled with CPU fallback disabled."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from hybrid_npu.errors import UserError
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.format import MASK_DIM, PAST_DIM
from hybrid_npu.manifest import is_export, load_manifest
from hybrid_npu.runtime.for_export import NpuUnavailable, npu_part_files, with_export_capacity

from .check import compile_on_npu


def check_export(export_dir, profile, progress: Callable[[str], None] | None = None) -> list[dict]:
    """progress(msg): a line before and after each graph's compile (a big part takes minutes)."""
    say = progress or (lambda msg: None)
    path = Path(export_dir)
    if not is_export(path):
        raise UserError(f"{path} is not a hybrid-npu export; create one with: export-hybrid SOURCE {path}")
    prof = load_profile(profile)
    if not prof.has_npu:
        raise UserError(f"profile {prof.name} has no NPU; choose an NPU profile such as snapdragon-x-elite")
    manifest = load_manifest(path)
    prof = with_export_capacity(prof, manifest)
    try:
        files = npu_part_files(path, manifest, prof)
    except NpuUnavailable as e:
        raise UserError(str(e)) from None
    entry = manifest.npu.get(prof.name)
    tile = entry.tile if entry is not None else None
    files = files + (tile.files if tile else [])  # the attention tile graphs between the prefill's segments
    free = {PAST_DIM: prof.attention_capacity, MASK_DIM: prof.attention_capacity + manifest.chunk}
    reports = []
    for k, f in enumerate(files, 1):
        say(f"compiling {f} for {prof.name} on the HTP, CPU fallback disabled ({k}/{len(files)})")
        t0 = time.perf_counter()
        report = compile_on_npu(path / f, prof.qnn_provider_options(), free)
        if report.get("npu_unavailable"):
            raise UserError(f"cannot check NPU placement: {report['error']}")
        placed = "all on HTP" if report.get("ok") else f"{report.get('on_htp')} of {report.get('nodes')} on HTP"
        say(f"{Path(f).name}: {placed} ({time.perf_counter() - t0:.1f} s)")
        reports.append(report)
    return reports
