"""Offline compile: QNN context binaries (EPContext models) for a profile's NPU graph parts,
compiled here (on x86_64 by onnxruntime-qnn's HTP emulator) so the laptop loads instead of
compiling. Each part compiles in a child process (export/npu/check.py) at the profile's static
shapes; the binaries land in ctx/<profile>/ and are recorded with the QNN release and SoC.

Weight sharing across contexts (ep.share_ep_contexts) is not used: loading a shared context
fails on the emulator with QNN_COMMON_ERROR_NOT_SUPPORTED (docs/htp-traps.md), so each
part holds its own weights; a profile that verifies on the NPU holds its weights twice (prefill and verify contexts).
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import MASK_DIM, PAST_DIM
from hybrid_npu.manifest import Contexts
from hybrid_npu.runtime.for_export import NpuUnavailable, qnn_devices, qnn_version

from .check import compile_on_npu


def compile_contexts(root: Path, part_files: list[str], prof, n: int, say) -> Contexts | None:
    """n: the graphs' token count (the prefill chunk or the verify tree size)."""
    try:
        qnn_devices()
    except NpuUnavailable as e:
        say(f"no QNN context binaries: {e}; the runtime will compile the NPU graphs on first load")
        return None
    ctx_dir = root / "ctx" / prof.name
    ctx_dir.mkdir(parents=True, exist_ok=True)
    free_dims = {PAST_DIM: prof.attention_capacity, MASK_DIM: prof.attention_capacity + n}
    files, seconds = [], 0.0
    for f in part_files:
        ctx = ctx_dir / (Path(f).stem + "_ctx.onnx")
        report = compile_on_npu(root / f, prof.qnn_provider_options(), free_dims,
                                {"ep.context_enable": "1", "ep.context_file_path": str(ctx),
                                 "ep.context_embed_mode": "0"})
        if not report.get("ok"):
            first = report.get("first_unsupported") or {}
            raise UserError(f"{Path(f).name} does not compile on the HTP for profile {prof.name}: "
                            f"{first.get('op', '')} {first.get('node', '')} {first.get('reason', report.get('error'))}")
        seconds += report["compile_s"]
        files.append(str(ctx.relative_to(root)))
        say(f"compiled {ctx.name} ({report['compile_s']} s, peak {report['peak_rss_gb']} GB)")
    return Contexts(files=tuple(files), qnn_version=qnn_version(), soc_model=prof.npu.soc_model,
                    htp_arch=prof.npu.htp_arch, compile_s=round(seconds, 2))
