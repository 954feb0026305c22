"""Weight-only block-wise quantisation into ONNX Runtime's `com.microsoft::MatMulNBits` layout.

Every linear layer's [N, K] matrix (HF [out, in] orientation) is cut along K into blocks of
`block_size`; each block keeps one fp32 scale (and, asymmetric, one zero point) and its codes:

    B            uint8 [N, n_blocks, block_size * bits / 8]   codes packed low nibble first (int4)
    scales       fp32  [N, n_blocks]
    zero_points  uint8 [N, ceil(n_blocks * bits / 8)]         asymmetric only; each row padded to a byte
    w ≈ (code - zero_point) * scale, zero_point = 2^(bits-1) when absent (symmetric)

K not a multiple of the block: the last block is zero-padded, as ORT pads it. What stays float,
and why: see the step graph (the GDN gate projections b/a, norms, conv, state path) and
`QuantSpec.head_bits` (the lm_head is int8, the embedding table fp16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hybrid_npu.errors import UserError

WEIGHT_MODES = ("float", "int8", "int4")
DEFAULT_BLOCK = 32
MAX_BLOCK = 256  # MLAS's fast kernels cover block sizes 16..256
# Elements quantised per slice: small enough for the temporaries to stay in cache (and bounded for
# the 248k-row lm_head), large enough for numpy's per-call overhead to vanish.
_SLICE_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class QuantSpec:
    bits: int                       # 4 or 8: every linear layer of the decoder
    block_size: int = DEFAULT_BLOCK
    symmetric: bool = True
    # The lm_head (for a tied model an untied copy of the embedding table) stays at 8 bits by
    # default: its error lands straight on the logits (llama.cpp keeps it at 6 bits for the same
    # reason), and MatMulNBits has no 6-bit form. --head-bits 4 halves it (a 4B model's head is
    # 0.64 GB at int8) for the accuracy scripts/bench/eval_quantized.py measures. The embedding table
    # itself is only gathered, so it is kept fp16 and only the rows a prompt touches are ever
    # paged in.
    head_bits: int = 8
    embedding_dtype: str = "float16"

    @property
    def mode(self) -> str:
        return f"int{self.bits}"

    def to_manifest(self) -> dict:
        return {"mode": self.mode, "bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric,
                "head_bits": self.head_bits, "embedding_dtype": self.embedding_dtype}


def quant_spec(weights: str | None, block_size: int | None = None, asymmetric: bool = False,
               head_bits: int | None = None) -> QuantSpec | None:
    """Validate the export flags; None = the float path (weights stored in --dtype)."""
    weights = weights or "float"
    if weights not in WEIGHT_MODES:
        raise UserError(f"--weights {weights!r} is not supported; choose one of {', '.join(WEIGHT_MODES)}")
    if weights == "float":
        if block_size is not None or asymmetric or head_bits is not None:
            raise UserError("--block-size, --asymmetric and --head-bits apply to quantised weights; "
                            "add --weights int4 or int8")
        return None
    if head_bits not in (None, 4, 8):
        raise UserError(f"--head-bits {head_bits} is not supported; choose 8 (default) or 4")
    block = DEFAULT_BLOCK if block_size is None else block_size
    if block < 16 or block > MAX_BLOCK or block & (block - 1):
        raise UserError(f"--block-size {block} is not a power of two between 16 and {MAX_BLOCK}; try 32")
    return QuantSpec(bits=int(weights[3:]), block_size=block, symmetric=not asymmetric, head_bits=head_bits or 8)


# ---------------------------------------------------------------- numpy quantise / dequantise
def _blocks(w: np.ndarray, n_blocks: int, block: int) -> np.ndarray:
    """[rows, K] -> [rows, n_blocks, block] fp32, the last block zero-padded."""
    rows, k = w.shape
    if k == n_blocks * block:
        return np.ascontiguousarray(w, np.float32).reshape(rows, n_blocks, block)
    out = np.zeros((rows, n_blocks * block), np.float32)
    out[:, :k] = w
    return out.reshape(rows, n_blocks, block)


def _round_clip(x: np.ndarray, inv_scale: np.ndarray, lo: float, hi: float, offset: np.ndarray | float) -> np.ndarray:
    """uint8(clip(rint(x / scale), lo, hi) + offset), in place on one temporary."""
    y = x * inv_scale[..., None]
    np.rint(y, out=y)
    np.clip(y, lo, hi, out=y)
    y += offset
    return y.astype(np.uint8)


def _inverse(scale: np.ndarray) -> np.ndarray:
    return np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)  # a zero block stays zero


def _codes_symmetric(x: np.ndarray, bits: int):
    """Codes in [mid - qmax, mid + qmax], scale = absmax / qmax: the largest |w| of a block is exact and
    every element is within scale/2 (the Q4_0 trick absmax/-8 gains a level but not that bound)."""
    mid, qmax = 1 << (bits - 1), (1 << (bits - 1)) - 1
    # one reduction over |x| (reductions along the short block axis dominate the cost)
    scale = np.abs(x).max(axis=-1) / np.float32(qmax)                      # [rows, n_blocks]
    return _round_clip(x, _inverse(scale), -qmax, qmax, mid), scale, None


def _codes_asymmetric(x: np.ndarray, bits: int):
    """Range [min(w, 0), max(w, 0)] over 2^bits - 1 steps; 0 is exact (the zero-padded tail stays 0)."""
    top = (1 << bits) - 1
    lo, hi = np.minimum(x.min(axis=-1), np.float32(0)), np.maximum(x.max(axis=-1), np.float32(0))
    scale = (hi - lo) / np.float32(top)
    inv = _inverse(scale)
    zero = np.clip(np.rint(-lo * inv), 0, top)
    # clip(rint(x/s), -zero, top - zero) + zero == clip(rint(x/s) + zero, 0, top)
    y = x * inv[..., None]
    np.rint(y, out=y)
    y += zero[..., None]
    np.clip(y, 0, top, out=y)
    return y.astype(np.uint8), scale, zero.astype(np.uint8)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Along the last axis (even length for int4): two codes a byte, the first in the low nibble."""
    if bits == 8:
        return codes
    pairs = np.ascontiguousarray(codes).view("<u2")  # (c0, c1) -> c0 | c1 << 8, whatever the host's byte order
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).astype(np.uint8)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_blockwise(w: np.ndarray, bits: int, block: int, symmetric: bool = True):
    """w [N, K] -> (B uint8 [N, n_blocks, block*bits/8], scales fp32 [N, n_blocks],
    zero_points uint8 [N, ceil(n_blocks*bits/8)] or None when symmetric)."""
    n, k = w.shape
    n_blocks = -(-k // block)
    packed = np.empty((n, n_blocks, block * bits // 8), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    zeros = None if symmetric else np.empty((n, n_blocks), np.uint8)
    step = max(1, _SLICE_ELEMENTS // (n_blocks * block))
    for r in range(0, n, step):
        x = _blocks(np.asarray(w[r:r + step], np.float32), n_blocks, block)
        codes, scales[r:r + step], zero = (_codes_symmetric if symmetric else _codes_asymmetric)(x, bits)
        packed[r:r + step] = _pack(codes, bits)
        if zero is not None:
            zeros[r:r + step] = zero
    if zeros is not None and bits == 4 and n_blocks % 2:
        zeros = np.pad(zeros, ((0, 0), (0, 1)))  # each row's zero points start on a byte
    return packed, scales, None if zeros is None else _pack(zeros, bits)


def dequantize_blockwise(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int,
                         k: int) -> np.ndarray:
    """The inverse the MatMulNBits kernel applies: [N, K] fp32."""
    n, n_blocks, _ = packed.shape
    codes = _unpack(packed, bits).astype(np.float32)                      # [N, n_blocks, block]
    zero = (np.full((n, n_blocks), 1 << (bits - 1), np.float32) if zero_points is None
            else _unpack(zero_points, bits)[:, :n_blocks].astype(np.float32))
    return ((codes - zero[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]


# ---------------------------------------------------------------- weight plan entries
@dataclass(frozen=True)
class QuantizedLinear:
    """Stored names of one MatMulNBits weight and the node attributes that go with it."""
    b: str
    scales: str
    zero_points: str | None
    k: int
    n: int
    bits: int
    block_size: int


class _QuantizeOnce:
    """Quantises a matrix on the first request for one of its parts and forgets it once the writer
    has taken every part: B, scales and zero points are written one after another."""

    def __init__(self, make_float: Callable[[], np.ndarray], bits: int, spec: QuantSpec):
        self.make_float, self.bits, self.spec = make_float, bits, spec
        self.parts: tuple | None = None
        self.taken: set[int] = set()

    def part(self, i: int) -> np.ndarray:
        if self.parts is None:
            self.parts = quantize_blockwise(self.make_float(), self.bits, self.spec.block_size, self.spec.symmetric)
        out = self.parts[i]
        self.taken.add(i)
        if self.taken >= {j for j, p in enumerate(self.parts) if p is not None}:
            self.parts, self.taken = None, set()
        return out


def plan_quantized_linear(plan, name: str, sources: list[str], in_dim: int, out_dims: list[int],
                          bits: int, spec: QuantSpec) -> QuantizedLinear:
    """Add (once) the MatMulNBits initializers of the sources' stacked [Σout, in] matrix to `plan`."""
    n, k, block = sum(out_dims), in_dim, spec.block_size
    n_blocks = -(-k // block)
    q = QuantizedLinear(f"{name}.q{bits}", f"{name}.scales", None if spec.symmetric else f"{name}.zero_points",
                        k, n, bits, block)
    if q.b in plan.entries:
        return q
    once = _QuantizeOnce(lambda: np.concatenate([plan.load(s) for s in sources], axis=0), bits, spec)
    plan.add(q.b, (n, n_blocks, block * bits // 8), lambda: once.part(0), np.uint8, params=n * k)
    plan.add(q.scales, (n, n_blocks), lambda: once.part(1), np.float32, params=0)
    if q.zero_points:
        plan.add(q.zero_points, (n, -(-n_blocks * bits // 8)), lambda: once.part(2), np.uint8, params=0)
    plan.prepacked.update(name for name in (q.b, q.scales, q.zero_points) if name)
    return q
