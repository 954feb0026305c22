"""--check-npu: every NPU graph of an export for a profile, compiled with CPU fallback disabled."""
from __future__ import annotations

import json
from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime.npu_sessions import MASK_DIM, PAST_DIM, npu_part_files, with_export_capacity
from hybrid_npu.runtime.qnn import NpuUnavailable

from .manifest import MANIFEST, is_export
from .npu_check import compile_on_npu


def check_export(export_dir, profile) -> list[dict]:
    path = Path(export_dir)
    if not is_export(path):
        raise UserError(f"{path} is not a hybrid-npu export; create one with: export-hybrid SOURCE {path}")
    prof = load_profile(profile)
    if not prof.has_npu:
        raise UserError(f"profile {prof.name} has no NPU; choose an NPU profile such as snapdragon-x-elite")
    manifest = json.loads((path / MANIFEST).read_text())
    prof = with_export_capacity(prof, manifest)
    try:
        files = npu_part_files(path, manifest, prof)
    except NpuUnavailable as e:
        raise UserError(str(e)) from None
    free = {PAST_DIM: prof.attention_capacity, MASK_DIM: prof.attention_capacity + int(manifest["chunk"])}
    reports = []
    for f in files:
        report = compile_on_npu(path / f, prof.qnn_provider_options(), free)
        if report.get("npu_unavailable"):
            raise UserError(f"cannot check NPU placement: {report['error']}")
        reports.append(report)
    return reports
