"""The export format's names, in one place both sides import: what export-hybrid writes and the
runtime reads. The runtime never imports export/ (a laptop that only runs models needs none of it)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FORMAT = "hybrid-npu/2"               # model.json's "format" (2: past values transposed, [nKV, hd, T])
MANIFEST = "model.json"               # the export's manifest, at its root
STORAGE_DTYPES = {"fp32": np.float32, "fp16": np.float16}  # model.json "dtype": how float weights are stored
# model.json "kv_cache": the dtype the full-attention K/V rows are kept in (the State, the graphs' past_key /
# past_value inputs, snapshots). int8 rows carry one fp32 scale per row and KV head (past_key_scale.{i},
# past_value_scale.{i} [nKV, 1, past_len]); an export without the entry keeps fp32 (made before the option).
# The default is fp16: half the bytes a token of fp32, what the HTP computes in and llama.cpp's default
# cache; decode at 8k cost 9% against fp32 on the x86 CPU measured (docs/kv-cache.md)
KV_CACHES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
DEFAULT_KV_CACHE, LEGACY_KV_CACHE = "fp16", "fp32"
KV_SCALE_BYTES = 4                    # an int8 row's scale (fp32), per KV head


def kv_row_bytes(head_dim: int, kv_cache: str) -> int:
    """Bytes one K (or V) row of one KV head holds in the cache: its elements, and an int8 row's scale."""
    return head_dim * np.dtype(KV_CACHES[kv_cache]).itemsize + (KV_SCALE_BYTES if kv_cache == "int8" else 0)


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
