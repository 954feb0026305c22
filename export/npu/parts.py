"""Split a model into contiguous layer ranges for the NPU (docs/profiles.md, issue: parts).

The HTP has a per-context memory ceiling, ONNX protobuf a 2 GB limit, and HTP compile time grows
roughly quadratically with node count (docs/htp-traps.md), so NPU graphs are cut into
parts of at most `budget` weight bytes: the embedding rides with the first part, the final norm
and lm_head with the last, the hidden state passes from part to part and each part carries only
its own layers' state.
"""
from __future__ import annotations

import numpy as np

from hybrid_npu.config import LINEAR, ModelConfig
from hybrid_npu.errors import UserError

from ..checkpoint import expected_shapes


def htp_itemsize(profile) -> int:
    """Bytes per weight the HTP holds: fp16 mode stores float weights as fp16 in the context
    binary (measured: 165.7 MB for 317 MB of fp32 weights, docs/htp-traps.md)."""
    return 2 if profile.npu.precision == "fp16" else 1


def layer_weight_bytes(cfg: ModelConfig, itemsize: int = 4) -> tuple[int, list[int], int]:
    """(embedding bytes, bytes per layer, head bytes) as stored for the NPU graphs."""
    shapes = expected_shapes(cfg)
    per_layer = [0] * cfg.num_layers
    for name, shape in shapes.items():
        if name.startswith("layers."):
            per_layer[int(name.split(".")[1])] += int(np.prod(shape)) * itemsize
    embed = int(np.prod(shapes["embed_tokens.weight"])) * itemsize
    head = int(np.prod(shapes["norm.weight"])) * itemsize + (0 if cfg.tie_word_embeddings else embed)
    return embed, per_layer, head + (embed if cfg.tie_word_embeddings else 0)


def plan_parts(cfg: ModelConfig, budget: int, itemsize: int) -> list[tuple[int, int]]:
    """Greedy contiguous [start, end) layer ranges whose weights fit `budget`; the embedding counts
    with layer 0, the head with the last part, or alone as the range (L, L) when it does not fit."""
    embed, per_layer, head = layer_weight_bytes(cfg, itemsize)
    parts, start, used = [], 0, 0
    for i, b in enumerate(per_layer):
        b += embed if i == 0 else 0
        if b > budget:
            raise UserError(f"part_weight_bytes {budget} cannot hold layer {i} ({b} bytes); raise it in the profile")
        if used and used + b > budget:
            parts.append((start, i))
            start, used = i, 0
        used += b
    if head > budget:
        raise UserError(f"part_weight_bytes {budget} cannot hold the lm_head ({head} bytes); raise it in the profile")
    parts.append((start, cfg.num_layers))
    if used + head > budget:
        parts.append((cfg.num_layers, cfg.num_layers))
    return parts


def cut_at_attention(cfg: ModelConfig, parts: list[tuple[int, int]]) -> list[tuple[int, int, bool, bool]]:
    """The weight parts cut again at every attention core (docs/long-context.md): (start, end,
    after_attention, to_attention) segments, the host running each core's tiles between two of
    them. A part holding k attention layers becomes k + 1 segments."""
    segments = []
    for start, end in parts:
        after = False
        for i in range(start, end):
            if cfg.layer_types[i] != LINEAR and not (after and i == start):
                segments.append((start, i + 1, after, True))
                start, after = i, True
        segments.append((start, end, after, False))
    return segments
