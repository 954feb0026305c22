"""The memory plan: fixed costs (weights, GDN state) plus K/V that grows per token, against a
budget, giving the largest context that fits (docs/architecture.md). A prompt beyond the plan is refused
before any work, never swapped or crashed into.

Per token the plan charges exactly what the K/V cache holds for it: the full-attention layers' K
and V rows in the export's cache dtype (format.KV_CACHES; an int8 row with its scale). Nothing else
grows with the context: the CPU graphs' attention reads the past in fixed tiles
(kernels/attention.emit_tiled_gqa_attention), so its scores and widened rows are a constant, inside
MARGIN_BYTES.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

from hybrid_npu.cli_common import human_bytes
from hybrid_npu.config import ModelConfig
from hybrid_npu.manifest import Weights

MARGIN_BYTES = 1 << 30  # left to the OS, the runtime's own code and activations


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    weights_bytes: int
    state_bytes: int
    kv_bytes_per_token: int
    max_position: int
    checkpoint_bytes: int = 0  # the turn checkpoints' copies of the GDN state, at most as many as kept

    @property
    def max_context(self) -> int:
        free = self.budget_bytes - self.weights_bytes - self.state_bytes - self.checkpoint_bytes
        per_token = self.kv_bytes_per_token
        if free <= 0:
            return 0
        return min(free // per_token, self.max_position) if per_token else self.max_position


    @property
    def limited_by_position(self) -> bool:
        """The model's max_position_embeddings, not the budget, sets max_context."""
        per_token = self.kv_bytes_per_token
        free = self.budget_bytes - self.weights_bytes - self.state_bytes
        return free > 0 and (not per_token or free // per_token >= self.max_position)

    def limit_and_fix(self) -> tuple[str, str, str]:
        """What sets max_context (who, the numbers behind it) and what a user can do about it."""
        if self.limited_by_position:
            return ("the model", f"its max_position_embeddings is {self.max_position}",
                    "shorten the input or split it (no memory budget lets a model read past its positions)")
        return ("the memory plan", f"budget {human_bytes(self.budget_bytes)}: weights {human_bytes(self.weights_bytes)}"
                f" + {human_bytes(self.kv_bytes_per_token)} of K/V per token",
                "shorten the input, free memory or raise the budget (memory=/--memory)")


# A float export this small prepacks its weights in every CPU session, as a quantised one always
# does; a larger one shares the memory-mapped weights.bin unpacked (runtime/pipeline.py cpu_session).
# Unpacked, MLAS packs each matrix again on every call of more than one row: on the embedded model
# (17 MB) a 15-node verify took 5.0 ms against 4.0 packed and a decode step 1.72 against 1.44 (Zen 3,
# docs/performance.md), for ~32 MB more a session. At 0.8B fp32 prepacking cost
# 2.2x the memory (PSS 7.4 vs 3.3 GB) for +10-20% decode: there the laptop's RAM is the scarcer.
PREPACK_FLOAT_BELOW_BYTES = 64 << 20


def prepacks(weights: Weights | dict) -> bool:
    """Whether CPU sessions of an export with this manifest weights record prepack its weights."""
    weights = Weights.of(weights)
    return weights.mode != "float" or int(weights.bytes) < PREPACK_FLOAT_BELOW_BYTES


def resident_weight_bytes(weights: Weights | dict, cpu_sessions: int) -> int:
    """What the weights hold in RAM with `cpu_sessions` CPU sessions open: weights.bin (mapped once,
    shared), plus for a quantised export one more copy of its MatMulNBits matrices per session
    beyond the first, since ONNX Runtime prepacks them per session (the first session's copy stands
    in for the file pages it read). Measured on Qwen3.5-0.8B (PSS after load vs this), prefill and
    decode in one any-N session: int8 1.16 vs 1.36 GB, int4 0.91 vs 1.11, int4 head-4 0.78 vs 0.99,
    int4 head-4 block-128 0.55 vs 0.92; in two sessions: int8 2.11 vs 2.21, int4 1.61 vs 1.71, int4
    head-4 block-128 0.98 vs 1.31. A little more than measured, never less. A small float export
    (prepacks) is charged an fp32 copy of every parameter per session: a bound, packing only the
    matmuls' weights (the embedded model with its verify session open: +14 MB of PSS measured
    against unpacked, +63 MB charged)."""
    weights = Weights.of(weights)
    if weights.mode == "float":
        return int(weights.bytes) + (cpu_sessions * 4 * int(weights.params) if prepacks(weights) else 0)
    return int(weights.bytes) + max(cpu_sessions - 1, 0) * int(weights.prepacked_bytes or 0)


def default_budget() -> int:
    """psutil's available memory (page cache counts as reclaimable) minus a margin."""
    return max(psutil.virtual_memory().available - MARGIN_BYTES, 0)


def plan_memory(cfg: ModelConfig, weights_bytes: int, kv_cache: str, budget: int | None,
                checkpoints: int = 0) -> MemoryPlan:
    """kv_cache: the export's K/V cache dtype (model.json "kv_cache"); checkpoints: how many turn
    checkpoints the engine may keep, each a copy of the GDN state."""
    return MemoryPlan(budget_bytes=int(budget) if budget else default_budget(), weights_bytes=weights_bytes,
                      state_bytes=cfg.state_bytes(), checkpoint_bytes=cfg.state_bytes() * checkpoints,
                      kv_bytes_per_token=cfg.kv_bytes_per_token(kv_cache), max_position=cfg.max_position_embeddings)
