"""Host-side inputs of a step graph: what is cheap here and awkward on the NPU (docs/architecture.md)."""
from __future__ import annotations

import functools

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.kernels.conv import chain_state_select
from hybrid_npu.kernels.rope import rope_rows, rope_tables

from .npu_attention import POSITION
from .state import State


def context_feed(cfg: ModelConfig, state: State, depth: np.ndarray, visible: np.ndarray,
                 chain: bool = False, mask: bool = True) -> dict[str, np.ndarray]:
    """What every step graph reads besides its tokens: rotary rows at positions P + depth, the
    additive mask (all past rows, and the new tokens each one may see: `visible` [N, N] bool), and
    the state itself (fed in place, no copies). chain: depth is 0 .. N-1 (the rows come from a
    block computed once, RopeRows). mask=False: no additive mask (the tiled NPU prefill builds
    its own per tile; one over the whole context is [N, T] floats, 134 MB at 262k tokens)."""
    feed = {}
    if cfg.full_layers:
        n, pos, cap = len(depth), state.position, state.capacity
        if chain:
            feed["rope_cos"], feed["rope_sin"] = rope_rows(cfg.rotary_dim, cfg.rope_theta)(pos, n)
        else:
            feed["rope_cos"], feed["rope_sin"] = rope_tables(pos + depth, cfg.rotary_dim, cfg.rope_theta)
        if mask:
            additive = np.full((n, cap + n), MASKED, dtype=np.float32)
            additive[:, :pos] = 0.0
            additive[:, cap:] = np.where(visible, 0.0, MASKED)
            feed["attn_mask"] = additive
    for i, layer in state.gdn.items():
        feed[f"conv_state.{i}"] = layer.conv
        feed[f"recurrent_state.{i}"] = layer.recurrent
    for i, layer in state.attention.items():
        feed[f"past_key.{i}"] = layer.key
        feed[f"past_value.{i}"] = layer.value
        if layer.key_scale is not None:
            feed[f"past_key_scale.{i}"], feed[f"past_value_scale.{i}"] = layer.key_scale, layer.value_scale
    return feed


def chain_feed(cfg: ModelConfig, state: State, ids: list[int], n: int, mask: bool = True) -> dict[str, np.ndarray]:
    """Inputs for N = n-slot chain step over `ids` (len(ids) <= n; the tail is padding)."""
    valid = len(ids)
    feed = {"input_ids": np.array(list(ids) + [0] * (n - valid), dtype=np.int64)}
    if not mask:  # the tiled NPU prefill's cores build their masks from it (runtime/npu_attention.py)
        feed[POSITION] = state.position
    if n > 1:
        feed["token_valid"] = (np.arange(n) < valid).astype(np.float32)
        feed["conv_state_select"] = chain_state_select(valid, n, cfg.linear_conv_kernel_dim)
    feed["last_index"] = np.array([valid - 1], dtype=np.int64)
    feed.update(context_feed(cfg, state, *chain_rows(n), chain=True, mask=mask))
    return feed


@functools.lru_cache(maxsize=80)  # decode 1, prefill chunks, the drafter's observe chunks (<= 64)
def chain_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A chain of n slots: its depths 0 .. n-1 and its causal [n, n] visibility (read-only, kept:
    building them, np.tril included, took ~45 µs of a decode step right after a graph call)."""
    depth, visible = np.arange(n), np.tril(np.ones((n, n), dtype=bool))
    depth.flags.writeable = visible.flags.writeable = False
    return depth, visible


def commit_chain(state: State, out: dict[str, np.ndarray], ids: list[int]) -> None:
    """Take the new state from a chain step's outputs: only the valid tokens' K/V rows are written."""
    valid, pos = len(ids), state.position
    for i, layer in state.gdn.items():
        layer.conv = out[f"conv_state_out.{i}"]
        layer.recurrent = out[f"recurrent_state_out.{i}"].reshape(layer.recurrent.shape)  # the CPU graphs': [1, ...]
    for i, layer in state.attention.items():
        layer.write(pos, out[f"new_key.{i}"][:, :valid], out[f"new_value.{i}"][:, :valid])
    state.position += valid
    state.tokens.extend(int(t) for t in ids)
