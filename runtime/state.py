"""The conversation state as a typed object: named per-layer arrays, never a loose tensor list.

GDN layers carry a fixed-size state (conv window + fp32 delta-rule matrix); full-attention
layers carry K/V rows that grow with the context. The K/V buffers are head-major (keys
[nKV, capacity, hd], values transposed [nKV, hd, capacity]) and grow in blocks, so the graph reads
them in place (no per-step copy) and a long context costs only what it uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.format import KV_CACHES, LEGACY_KV_CACHE

KV_BLOCK = 256


def grown_capacity(need: int, capacity: int, block: int = KV_BLOCK) -> int:
    """The capacity a K/V buffer grows to when it must hold `need` rows: at least 1/8 more than now,
    so a long prefill copies it O(log n) times, not n/block times, rounded up to whole blocks
    (np.zeros pages the untouched tail in lazily: the slack costs address space, not RAM). The
    target's State and the drafters' own K/V grow by this one rule."""
    return -(-max(need, capacity + capacity // 8) // block) * block


@dataclass
class GDNLayerState:
    conv: np.ndarray       # [conv_dim, K-1] pre-conv inputs, oldest first
    recurrent: np.ndarray  # [Hv, Dk, Dv] fp32


def quantize_rows(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 rows -> (int8 rows, fp32 scales): symmetric, one scale per row (reduced over `axis`, the
    head dim), max|x| / 127, so a row's largest element is exact and the rest are off by at most
    half its scale. An all-zero row gets scale 1 (any scale reproduces it)."""
    peak = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(x / scale), -127, 127).astype(np.int8), scale


@dataclass
class AttentionLayerState:
    key: np.ndarray        # [nKV, capacity, hd]; rows [0, State.position) are valid
    value: np.ndarray      # [nKV, hd, capacity], transposed: columns [0, State.position) are valid
    #                        (a decode step reads the values as its product's rows, kernels/attention.py)
    key_scale: np.ndarray | None = None    # int8 cache only: [nKV, 1, capacity] fp32, a scale per row
    value_scale: np.ndarray | None = None  # and per value row (column of `value`)

    def values(self, end: int) -> np.ndarray:
        """The first `end` value rows as [nKV, end, hd] (a view, in the cache's dtype)."""
        return self.value[:, :, :end].transpose(0, 2, 1)

    def rows(self, end: int) -> tuple:
        """The first `end` key and value rows as [nKV, end, hd] in the cache's dtype (views), and for
        an int8 cache their scales [nKV, end] (else None, None)."""
        keys, values = self.key[:, :end], self.values(end)
        if self.key_scale is None:
            return keys, values, None, None
        return keys, values, self.key_scale[:, 0, :end], self.value_scale[:, 0, :end]

    def write(self, pos: int, keys: np.ndarray, values: np.ndarray, scales=None) -> None:
        """Rows keys/values [nKV, n, hd] at positions pos.. (the graphs' new_key/new_value layout, fp32,
        or rows of a saved cache): converted to the cache's dtype; into an int8 cache, fp32 rows are
        rounded with a scale each, int8 rows come with theirs (scales: ([nKV, n], [nKV, n]))."""
        n = keys.shape[1]
        if self.key_scale is None:
            self.key[:, pos: pos + n] = keys
            self.value[:, :, pos: pos + n] = values.transpose(0, 2, 1)
            return
        if scales is None:
            (keys, k_scale), (values, v_scale) = quantize_rows(keys, -1), quantize_rows(values, -1)
            scales = (k_scale[..., 0], v_scale[..., 0])
        self.key[:, pos: pos + n] = keys
        self.value[:, :, pos: pos + n] = values.transpose(0, 2, 1)
        self.key_scale[:, 0, pos: pos + n], self.value_scale[:, 0, pos: pos + n] = scales


@dataclass
class State:
    gdn: dict[int, GDNLayerState]
    attention: dict[int, AttentionLayerState]
    position: int = 0                      # tokens committed so far
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def fresh(cls, cfg: ModelConfig, capacity: int = KV_BLOCK, kv_cache: str = LEGACY_KV_CACHE) -> "State":
        """kv_cache: the K/V rows' dtype (format.KV_CACHES; the export's model.json "kv_cache")."""
        k = cfg.linear_conv_kernel_dim
        gdn = {i: GDNLayerState(np.zeros((cfg.conv_dim, k - 1), np.float32),
                                np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim), np.float32)) for i in cfg.linear_layers}
        nkv, hd = cfg.num_key_value_heads, cfg.head_dim
        dtype, int8 = KV_CACHES[kv_cache], kv_cache == "int8"
        scale = (lambda: np.zeros((nkv, 1, 0), np.float32)) if int8 else (lambda: None)
        state = cls(gdn, {i: AttentionLayerState(np.zeros((nkv, 0, hd), dtype), np.zeros((nkv, hd, 0), dtype),
                                                 scale(), scale())
                          for i in cfg.full_layers})
        state.resize(capacity)  # allocates the one K/V arena
        return state

    @property
    def capacity(self) -> int:
        return next(iter(self.attention.values())).key.shape[1] if self.attention else 0

    def ensure_capacity(self, tokens: int) -> None:
        """Grow every K/V buffer to hold `tokens` rows, in whole blocks."""
        if not self.attention or tokens <= self.capacity:
            return
        self.resize(grown_capacity(tokens, self.capacity))

    def resize(self, capacity: int) -> None:
        """Re-allocate the K/V buffers to exactly `capacity` rows (at least the rows in use).

        All layers' K and V live in one arena, each a contiguous view: one large allocation is
        always memory-mapped by the C allocator and returned whole when freed, where per-layer
        buffers of a few MB land in the heap and stay resident after the context moves on."""
        if not self.attention:
            return
        new_cap, pos = max(capacity, self.position), self.position
        first = next(iter(self.attention.values())).key
        nkv, hd = first.shape[0], first.shape[2]
        arena = np.zeros((len(self.attention), 2, nkv * new_cap * hd), first.dtype)
        scaled = next(iter(self.attention.values())).key_scale is not None
        scales = np.zeros((len(self.attention), 2, nkv * new_cap), np.float32) if scaled else None
        for slot, layer in enumerate(self.attention.values()):
            key, value = arena[slot, 0].reshape(nkv, new_cap, hd), arena[slot, 1].reshape(nkv, hd, new_cap)
            key[:, :pos], value[:, :, :pos] = layer.key[:, :pos], layer.value[:, :, :pos]
            layer.key, layer.value = key, value
            if scaled:
                k_scale, v_scale = scales[slot, 0].reshape(nkv, 1, new_cap), scales[slot, 1].reshape(nkv, 1, new_cap)
                k_scale[..., :pos], v_scale[..., :pos] = layer.key_scale[..., :pos], layer.value_scale[..., :pos]
                layer.key_scale, layer.value_scale = k_scale, v_scale

    def kv_bytes_in_use(self) -> int:
        """What the cache holds for the positions in use: K and V rows, and an int8 cache's scales."""
        return sum(self.position * (a.key[:, :1].nbytes + a.value[:, :, :1].nbytes
                                    + (0 if a.key_scale is None else a.key_scale[..., :1].nbytes + a.value_scale[..., :1].nbytes))
                   for a in self.attention.values())
