"""The stored weights of one export: what each graph initializer holds and how it is made
from the checkpoint (transposed for MatMul, fused projections, dtype), written once into one
external-data file that every graph of the model points into.

Large tensors start at 64 KiB-aligned offsets so ONNX Runtime can memory-map them instead of
copying (the Windows allocation granularity, a multiple of the page size elsewhere); small ones
(norms, gates) are packed at 64-byte alignment so a tiny model's file is not mostly padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

ALIGN = 1 << 16


@dataclass
class StoredWeight:
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]
    params: int | None = None  # model parameters it holds, when not its element count (packed int4, scales)


class WeightPlan:
    def __init__(self, load: Callable[[str], np.ndarray], matrix_dtype=np.float32, quant=None,
                 quantizable: bool = False):
        self.load = load  # canonical checkpoint name -> array (HF orientation)
        self.matrix_dtype = np.dtype(matrix_dtype)
        self.quant = quant  # export.quantize.QuantSpec: linear layers as MatMulNBits; None = float
        # The layout a quantiser needs: GDN gate projections (b, a) apart from the big in_proj and
        # an untied lm_head, so both can stay float / get their own precision. Float graphs keep
        # the fused forms (one call, the table shared) unless they are headed for QDQ (export/npu/qdq.py).
        self.quantizable = quant is not None or quantizable
        # A quantised model's embedding is only gathered (its head is a separate matrix), so it is
        # stored fp16 and widened row by row: the HTP holds it in fp16 anyway.
        self.table_dtype = (np.dtype(quant.embedding_dtype) if quant is not None else
                            np.dtype(np.float16) if quantizable else self.matrix_dtype)
        self.entries: dict[str, StoredWeight] = {}
        self.prepacked: set[str] = set()  # MatMulNBits inputs: every CPU session packs its own copy

    def prepacked_bytes(self) -> int:
        return sum(int(np.prod(self.entries[n].shape)) * self.entries[n].dtype.itemsize for n in self.prepacked)

    def add(self, name: str, shape, make: Callable[[], np.ndarray], dtype=np.float32, params: int | None = None) -> str:
        if name not in self.entries:
            self.entries[name] = StoredWeight(tuple(shape), np.dtype(dtype), make, params)
        return name

    # ---- the forms the graphs need ----
    def vector(self, src: str, size: int) -> str:
        """Norm weights, gates: always fp32 (research: the state path stays fp32)."""
        return self.add(src, (size,), lambda: self.load(src).astype(np.float32))

    def linear_weight(self, name: str, sources: list[str], in_dim: int, out_dims: list[int]) -> str:
        """[Σout, in] for Gemm(x, W, transB=1): the sources' [out, in] matrices as stored by HF,
        stacked, so fused projections (q|k|v, gate|up, qkv|z|b|a) cost one call. transB keeps each
        output's weights contiguous: 20 vs 16 GB/s for an M=1 product on ORT's CPU EP here."""
        def make():
            return np.concatenate([self.load(s) for s in sources], axis=0).astype(self.matrix_dtype)
        return self.add(name, (sum(out_dims), in_dim), make, self.matrix_dtype)

    def table(self, src: str, shape) -> str:
        """An [rows, cols] table used as stored (embedding, tied lm_head via Gemm transB)."""
        return self.add(src, shape, lambda: self.load(src).astype(self.table_dtype), self.table_dtype)

    def conv_weight(self, src: str, channels: int, k: int) -> str:
        return self.add(src + ".kc", (k, channels), lambda: self.load(src).reshape(channels, k).T.astype(np.float32))

    # ---- writing ----
    def write(self, path: Path, progress: Callable[[str], None] | None = None) -> dict[str, tuple[str, int, int]]:
        """Stream every weight into one file; returns name -> (file name, offset, length)."""
        placements = {}
        with open(path, "wb") as f:
            for name, w in self.entries.items():
                arr = np.ascontiguousarray(w.make(), dtype=w.dtype)
                if arr.shape != w.shape:
                    raise AssertionError(f"weight {name}: made {arr.shape}, planned {w.shape}")
                pad = (-f.tell()) % ALIGN if arr.nbytes >= ALIGN else (-f.tell()) % 64
                f.write(b"\0" * pad)
                offset = f.tell()
                f.write(arr.tobytes())
                placements[name] = (path.name, offset, arr.nbytes)
                if progress:
                    progress(name)
        return placements

    def total_params(self) -> int:
        return sum(int(np.prod(w.shape)) if w.params is None else w.params for w in self.entries.values())

    def total_bytes(self) -> int:
        return sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in self.entries.values())
