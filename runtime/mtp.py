"""The checkpoint's own MTP head as a drafter at run time (CPU, ONNX): docs/mtp-drafter.md.

The head is an EAGLE-style drafter with one feature, the target's residual after its last layer
(tap.{L}): `observe(tokens, features)` pairs the target's tap at position t with token t+1 (the MTP
position is t, as vLLM and llama.cpp place it), a chained step feeds the head its own output hidden
(mtp.norm), and its K/V grows over the accepted context with the tree rows written past it and
forgotten. That is exactly runtime/eagle3.py's bookkeeping (stable K/V, window, EAGLE-2 trees from
the top-k, rewind), so this class only opens the MTP graphs; the vocabulary is the target's, or
the trimmed head's subset of it (export/drafters/vocab.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, MTP_KIND as KIND
from hybrid_npu.manifest import DrafterManifest, load_drafter_manifest
from hybrid_npu.safe_files import inside

from .eagle3 import (DRAFT_WINDOW, FIX, SINGLE_THREAD_BELOW_BYTES, Eagle3Drafter, check_drafter_shapes,
                     drafter_graph, read_draft_vocab)
from .session_options import cpu_inference_session, session_options


class MtpDrafter(Eagle3Drafter):
    kind = KIND

    def __init__(self, drafter_dir, threads: int | None = None, window: int | None = DRAFT_WINDOW,
                 record: DrafterManifest | None = None):
        self.path = Path(drafter_dir)
        self.window = window
        mf = self.path / DRAFTER_MANIFEST
        if not mf.exists():
            raise UserError(f"{self.path} is not an exported drafter (no {DRAFTER_MANIFEST}); "
                            "export it with: export-hybrid SOURCE OUT --drafter mtp")
        self.manifest = record or load_drafter_manifest(self.path)
        if self.manifest.kind != KIND or not self.manifest.mtp_graphs:
            raise UserError(f"{mf} is not an MTP drafter (format {self.manifest.format!r}, kind "
                            f"{self.manifest.kind!r}); re-export it with --drafter mtp")
        dims = self.manifest.dims
        self.nkv, self.hd, self.h = dims.num_key_value_heads, dims.head_dim, dims.hidden_size
        self.rotary_dim, self.rope_theta = dims.rotary_dim, dims.rope_theta
        self.input_order = self.manifest.input_order  # (L,): tap.{L}
        self.tap_width = dims.hidden_size
        vocab = self.manifest.vocab  # a trimmed head (--mtp-vocab): its draft id -> target id
        if vocab is None:
            self.draft_to_target = np.arange(dims.vocab_size, dtype=np.int64)  # the target's own vocabulary
        else:
            self.draft_to_target = read_draft_vocab(self.path, vocab)
        hidden_in, step = self.manifest.mtp_graphs
        weights = inside(self.path, self.manifest.weights_file, "weights file", FIX).stat().st_size
        opts = session_options(1 if weights < SINGLE_THREAD_BELOW_BYTES else threads)  # as eagle3.py
        self.fc = cpu_inference_session(drafter_graph(self.path, hidden_in.file), opts)
        self.step = cpu_inference_session(drafter_graph(self.path, step.file), opts)
        check_drafter_shapes(self.path, self.step, self.nkv, self.hd)
        self.reset()
