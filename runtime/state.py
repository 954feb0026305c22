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


@dataclass
class AttentionLayerState:
    key: np.ndarray        # [nKV, capacity, hd]; rows [0, State.position) are valid
    value: np.ndarray      # [nKV, hd, capacity], transposed: columns [0, State.position) are valid
    #                        (a decode step reads the values as its product's rows, kernels/attention.py)

    def values(self, end: int) -> np.ndarray:
        """The first `end` value rows as [nKV, end, hd] (a view)."""
        return self.value[:, :, :end].transpose(0, 2, 1)

    def write(self, pos: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Rows keys/values [nKV, n, hd] at positions pos.. (the graphs' new_key/new_value layout)."""
        self.key[:, pos: pos + keys.shape[1]] = keys
        self.value[:, :, pos: pos + values.shape[1]] = values.transpose(0, 2, 1)


@dataclass
class State:
    gdn: dict[int, GDNLayerState]
    attention: dict[int, AttentionLayerState]
    position: int = 0                      # tokens committed so far
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def fresh(cls, cfg: ModelConfig, capacity: int = KV_BLOCK) -> "State":
        k = cfg.linear_conv_kernel_dim
        gdn = {i: GDNLayerState(np.zeros((cfg.conv_dim, k - 1), np.float32),
                                np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim), np.float32)) for i in cfg.linear_layers}
        nkv, hd = cfg.num_key_value_heads, cfg.head_dim
        state = cls(gdn, {i: AttentionLayerState(np.zeros((nkv, 0, hd), np.float32), np.zeros((nkv, hd, 0), np.float32))
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
        for slot, layer in enumerate(self.attention.values()):
            key, value = arena[slot, 0].reshape(nkv, new_cap, hd), arena[slot, 1].reshape(nkv, hd, new_cap)
            key[:, :pos], value[:, :, :pos] = layer.key[:, :pos], layer.value[:, :, :pos]
            layer.key, layer.value = key, value

    def kv_bytes_in_use(self) -> int:
        return sum(2 * a.key.shape[0] * self.position * a.key.shape[2] * a.key.itemsize
                   for a in self.attention.values())
