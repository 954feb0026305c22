"""Max context within a memory budget, from the memory plan alone (no weights: the int4 export's
weight layout is planned from each config, export/weights.py, and never filled: for the random
0.8B's int4 export it is weights.bin's size to 0.4%), for the Qwen3.5
0.8B / 2B / 4B / 9B configs and each K/V cache dtype, beside the cache the plan charged before
(fp32 K/V plus a prefill chunk's fp32 [C, T] score scratch per token), llama.cpp's default f16 cache
(the same rows as our fp16: full-attention layers only) and a dense transformer of the 4B class
(Qwen3-4B: 36 layers, 8 KV heads of 128, every layer full attention; f16, as llama.cpp keeps it).

The plan: budget - resident weights (one CPU session, runtime/memory.resident_weight_bytes) - GDN
state - 8 turn checkpoints (a chat engine's default), divided by the bytes a context token costs,
capped at max_position_embeddings. Prints one JSON object (docs/kv-cache.md shows it as a table).

    python scripts/bench/max_context_table.py [--budget-gib 8] [--chunk 128]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import model_config  # noqa: E402

from hybrid_npu.config import ModelConfig  # noqa: E402
from hybrid_npu.export.quantize import quant_spec  # noqa: E402
from hybrid_npu.export.exporter import graph_specs  # noqa: E402
from hybrid_npu.export.step_graph import build_step_graph  # noqa: E402
from hybrid_npu.export.weights import WeightPlan  # noqa: E402
from hybrid_npu.format import KV_CACHES  # noqa: E402
from hybrid_npu.runtime.for_export import DEFAULT_MAX_CHECKPOINTS, plan_memory, resident_weight_bytes  # noqa: E402

# Qwen3.5-9B's dims are not in this repository beyond docs/qwen35-model.md (32 layers, 24 GDN / 8
# attention, Hv 32, K/V 32 KiB a token in fp16); the rest are assumed here and printed with the table
ASSUMED_9B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                  linear_num_value_heads=32, intermediate_size=12288, tie_word_embeddings=False)
DENSE_4B = dict(layers=36, nkv=8, hd=128)  # Qwen3-4B (the figures)


def config(name: str) -> ModelConfig:
    return model_config(name, ASSUMED_9B if name == "9B" else None)


def int4_weights(cfg: ModelConfig) -> dict:
    """The int4 export's manifest "weights" record, planned from the config (the CPU graph's every
    weight declared; the loader is never called)."""
    def no_load(name):
        raise AssertionError(f"planning only: {name} is never read")
    quant = quant_spec("int4")
    plan = WeightPlan(no_load, quant=quant)
    for name, spec in graph_specs(128, 32).items():  # every graph an export writes (export/exporter.py)
        build_step_graph(cfg, plan, spec, name)
    return {"bytes": plan.total_bytes(), "params": plan.total_params(), "prepacked_bytes": plan.prepacked_bytes(),
            **quant.to_manifest()}


def max_context(free: int, per_token: int, max_position: int) -> int:
    return max(min(free // per_token, max_position), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--chunk", type=int, default=128, help="the prefill chunk the old scratch charge was for")
    a = ap.parse_args()
    budget = int(a.budget_gib * (1 << 30))
    rows = []
    for name in ("0.8B", "2B", "4B", "9B"):
        cfg = config(name)
        weights = resident_weight_bytes(int4_weights(cfg), cpu_sessions=1)
        plans = {kv: plan_memory(cfg, weights, kv, budget, DEFAULT_MAX_CHECKPOINTS) for kv in KV_CACHES}
        free = budget - weights - plans["fp16"].state_bytes - plans["fp16"].checkpoint_bytes
        before = cfg.kv_bytes_per_token("fp32") + 2 * cfg.num_attention_heads * a.chunk * 4
        row = {"model": f"Qwen3.5-{name}", "weights_int4_resident_bytes": weights,
               "fixed_state_bytes": plans["fp16"].state_bytes + plans["fp16"].checkpoint_bytes,
               "max_position": cfg.max_position_embeddings,
               "per_token_bytes": {"before_fp32_plus_scratch": before, "llama_cpp_f16": cfg.kv_bytes_per_token("fp16"),
                                   **{kv: p.kv_bytes_per_token for kv, p in plans.items()}},
               "max_context": {"before_fp32_plus_scratch": max_context(free, before, cfg.max_position_embeddings),
                               "llama_cpp_f16_kv": max_context(free, cfg.kv_bytes_per_token("fp16"),
                                                               cfg.max_position_embeddings),
                               **{kv: p.max_context for kv, p in plans.items()}}}
        if name == "4B":  # the dense model of this size, with this model's weights: only its K/V differs
            dense = DENSE_4B["layers"] * 2 * DENSE_4B["nkv"] * DENSE_4B["hd"] * 2
            row["dense_qwen3_4b_f16"] = {"per_token_bytes": dense, "max_context_unbounded": free // dense}
        rows.append(row)
    print(json.dumps({"budget_bytes": budget, "checkpoints": DEFAULT_MAX_CHECKPOINTS, "assumed_9b": ASSUMED_9B,
                      "dense_4b": DENSE_4B, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
