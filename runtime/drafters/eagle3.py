"""The EAGLE-3 drafter at run time: one decoder layer over the target's taps at several layers,
fused (fuse_taps) in the order its drafter.json records, with its own draft vocabulary. Everything
after the graphs are open is TreeDrafter's (draft_tree.py). Spec: docs/eagle3-drafter.md.
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST as MANIFEST, EAGLE3_KIND as KIND
from hybrid_npu.manifest import DrafterManifest

from .draft_tree import DRAFT_WINDOW, FIX, TreeDrafter, open_manifest, read_draft_vocab


class Eagle3Drafter(TreeDrafter):
    kind = KIND

    def __init__(self, drafter_dir, threads: int | None = None, window: int | None = DRAFT_WINDOW,
                 record: DrafterManifest | None = None):
        """record: its drafter.json, where the caller has read it (runtime/drafters load_drafter)."""
        path = Path(drafter_dir)
        manifest = open_manifest(path, record, "export it with export_drafter")
        tap_width = len(manifest.input_order) * manifest.dims.target_hidden_size
        if manifest.vocab is None:
            raise UserError(f"{path / MANIFEST} has no draft vocabulary; {FIX}")
        draft_to_target = read_draft_vocab(path, manifest.vocab)
        super().__init__(path, manifest, window, tap_width, draft_to_target, ("drafter_fc.onnx", "drafter.onnx"),
                         weight_bytes=sum(f.stat().st_size for f in path.glob("*.bin")), threads=threads)
