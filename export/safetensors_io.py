"""Reading tensors from safetensors files, lazily, as numpy (bf16 widened to fp32).

numpy has no bfloat16, and the released Qwen3.5 checkpoints are bf16, so bf16 tensors are read
from the file's own header offsets (the safetensors format: u64 header length, JSON header,
raw little-endian data) and widened exactly (bf16 is the top half of an fp32).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import open_regular

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADER_BYTES = 100_000_000


def _entry_problem(info) -> str | None:
    """What is wrong with one tensor's header entry (None: nothing): the reader trusts its offsets."""
    if not isinstance(info, dict):
        return f"a JSON {type(info).__name__}, not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEMSIZE:
        return f"dtype {str(dtype)[:20]!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape {str(shape)[:40]}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"data_offsets {str(offsets)[:40]}"
    if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
        return f"data_offsets span {offsets[1] - offsets[0]} bytes, {dtype} {shape} needs {math.prod(shape) * _ITEMSIZE[dtype]}"
    return None


class SafetensorsFile:
    """One .safetensors file: names, shapes and dtypes from its header; data on request."""

    def __init__(self, path: Path):
        self.path = path
        fix = "re-download or re-save it"
        try:
            with open_regular(path, "a safetensors file", fix) as f:
                size = os.fstat(f.fileno()).st_size
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(_HEADER_BYTES, size - 8):
                    raise ValueError("header length out of range")
                self.header = json.loads(f.read(header_len))
        except RecursionError:
            raise UserError(f"{path}: not a readable safetensors file (its header nests too deeply); {fix}") from None
        except (OSError, ValueError, struct.error) as e:
            raise UserError(f"{path}: not a readable safetensors file ({str(e)[:160]}); {fix}") from None
        if not isinstance(self.header, dict):
            raise UserError(f"{path}: not a readable safetensors file (its header is not a JSON object); {fix}")
        self.data_start = 8 + header_len
        self.header.pop("__metadata__", None)
        for name, info in self.header.items():
            problem = _entry_problem(info)
            if problem:
                raise UserError(f"{path.name}: tensor {str(name)[:80]} has a damaged header entry ({problem}); {fix}")
            end = self.data_start + info["data_offsets"][1]
            if end > size:
                raise UserError(f"{path.name}: tensor {name} is truncated (needs {end} bytes, file has {size}); "
                                "the file is incomplete: copy it again")

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def load(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] != "BF16":
            with safe_open(str(self.path), framework="numpy") as f:
                return f.get_tensor(name)
        start, end = info["data_offsets"]
        raw = np.fromfile(self.path, dtype=np.uint16, count=(end - start) // 2, offset=self.data_start + start)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
