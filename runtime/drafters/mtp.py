"""The checkpoint's own MTP head as a drafter at run time (CPU, ONNX): docs/mtp-drafter.md.

The head is an EAGLE-style drafter with one feature, the target's residual after its last layer
(tap.{L}): `observe(tokens, features)` pairs the target's tap at position t with token t+1 (the MTP
position is t, as vLLM and llama.cpp place it), a chained step feeds the head its own output hidden
(mtp.norm), and its K/V grows over the accepted context with the tree rows written past it and
forgotten. That is TreeDrafter's bookkeeping (draft_tree.py: stable K/V, window, EAGLE-2 trees from
the top-k, rewind), so this class only opens the MTP graphs; the vocabulary is the target's, or
the trimmed head's subset of it (export/drafters/vocab.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, MTP_KIND as KIND
from hybrid_npu.manifest import DrafterManifest
from hybrid_npu.safe_files import inside

from .draft_tree import DRAFT_WINDOW, FIX, TreeDrafter, open_manifest, read_draft_vocab


class MtpDrafter(TreeDrafter):
    kind = KIND

    def __init__(self, drafter_dir, threads: int | None = None, window: int | None = DRAFT_WINDOW,
                 record: DrafterManifest | None = None):
        path = Path(drafter_dir)
        manifest = open_manifest(path, record, "export it with: export-hybrid SOURCE OUT --drafter mtp")
        if manifest.kind != KIND or not manifest.mtp_graphs:
            raise UserError(f"{path / DRAFTER_MANIFEST} is not an MTP drafter (format {manifest.format!r}, kind "
                            f"{manifest.kind!r}); re-export it with --drafter mtp")
        dims = manifest.dims
        vocab = manifest.vocab  # a trimmed head (--mtp-vocab): its draft id -> target id
        if vocab is None:
            draft_to_target = np.arange(dims.vocab_size, dtype=np.int64)  # the target's own vocabulary
        else:
            draft_to_target = read_draft_vocab(path, vocab)
        hidden_in, step = manifest.mtp_graphs
        weights = inside(path, manifest.weights_file, "weights file", FIX).stat().st_size
        super().__init__(path, manifest, window, dims.hidden_size, draft_to_target, (hidden_in.file, step.file),
                         weight_bytes=weights, threads=threads)
