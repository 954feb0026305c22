"""Reading tensors from safetensors files, lazily, as numpy (bf16 widened to fp32).

numpy has no bfloat16, and the released Qwen3.5 checkpoints are bf16, so bf16 tensors are read
from the file's own header offsets (the safetensors format: u64 header length, JSON header,
raw little-endian data) and widened exactly (bf16 is the top half of an fp32).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from hybrid_npu.errors import UserError

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsFile:
    """One .safetensors file: names, shapes and dtypes from its header; data on request."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > 100_000_000:
                    raise ValueError("header length out of range")
                self.header = json.loads(f.read(header_len))
        except (OSError, ValueError, struct.error) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e}); re-download or re-save it") from None
        self.data_start = 8 + header_len
        self.header.pop("__metadata__", None)
        size = path.stat().st_size
        for name, info in self.header.items():
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
