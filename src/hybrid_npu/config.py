"""The text decoder's dimensions, read from a Hugging Face config (docs/qwen35-model.md).

One dataclass shared by the exporter (which reads config.json) and the runtime (which reads
the manifest). Field names follow the HF config so the mapping stays obvious.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import UserError
from .format import kv_row_bytes

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    # ---- derived sizes (docs/qwen35-model.md) ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def tap_layers(self) -> tuple[int, int, int]:
        """EAGLE-3 feature taps: the residual stream entering layers 2, L//2 and L-3 (docs/eagle3-drafter.md)."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    def state_bytes(self) -> int:
        """Fixed GDN state in our layout: conv state (K-1 columns) + fp32 recurrent state."""
        per_layer = (self.conv_dim * (self.linear_conv_kernel_dim - 1)
                     + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim) * 4
        return per_layer * len(self.linear_layers)

    def kv_bytes_per_token(self, kv_cache: str = "fp32") -> int:
        """KV growth per token: full-attention layers only, n_full * 2 * nKV * (a row's bytes in the
        cache dtype: hd elements, and an int8 row's scale)."""
        return len(self.full_layers) * 2 * self.num_key_value_heads * kv_row_bytes(self.head_dim, kv_cache)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def validate(self) -> None:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UserError(f"config: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                            f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise UserError(f"config: rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be even "
                            f"and at most head_dim {self.head_dim}")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise UserError(f"config: unsupported layer type(s) {unknown}; supported: {LINEAR}, {FULL}")
