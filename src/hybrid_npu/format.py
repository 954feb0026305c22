"""The export format's names, in one place both sides import: what export-hybrid writes and the
runtime reads. The runtime never imports export/ (a laptop that only runs models needs none of it)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FORMAT = "hybrid-npu/2"               # model.json's "format" (2: past values transposed, [nKV, hd, T])
MANIFEST = "model.json"               # the export's manifest, at its root
STORAGE_DTYPES = {"fp32": np.float32, "fp16": np.float16}  # model.json "dtype": how float weights are stored
DRAFTER_DIR = "drafter"               # an export's own drafter, beside graphs/
DRAFTER_FORMAT = "hybrid-npu-drafter/1"
MTP_DIR = "mtp"                       # an export's MTP drafter, beside drafter/ (EAGLE-3)
EAGLE3_KIND, MTP_KIND = "eagle3", "mtp"  # drafter.json "kind" (absent: eagle3, exports made before MTP)
DRAFTER_MANIFEST = "drafter.json"
PAST_DIM = "past_len"                 # the step graphs' free dimensions: K/V rows already in the context,
MASK_DIM = "past_len_plus_n"          # and the attention mask's width (those rows + the N new ones)
# the NPU graphs of a profile's manifest entry (model.json "npu" -> profile name): graph -> (its parts' key,
# its precompiled contexts' key)
NPU_GRAPHS = {"prefill": ("parts", "context"), "verify": ("verify_parts", "verify_context")}
# the prefill's parts are segments cut at the attention cores ("after_attention"/"to_attention"); the entry's
# "tile" is the attention tile graph between them ({file, rows, n}), "tile_context" its context binary
# model.json graphs.cpu_verify: "sizes" its cores' tree sizes; with "any_count" true a call brings any
# 2..n nodes (padded to a core size inside the graph), without it (older exports) exactly one of the sizes
VERIFY_ANY_COUNT = "any_count"


def manifest_hash(path) -> str:
    """sha256 of an export's model.json: identifies the exported model a state belongs to."""
    from hybrid_npu.safe_files import CONFIG_BYTES, read_bytes

    data = read_bytes(Path(path) / MANIFEST, CONFIG_BYTES, "the manifest", "re-export the model with export-hybrid")
    return hashlib.sha256(data).hexdigest()
