"""MODELLED cost of one 128-token NPU prefill chunk at a context position, tiled attention against the
fixed-T_max design (docs/long-context.md): attention FLOPs, K/V bytes the HTP reads (fp16) and NPU
calls. From the Qwen3.5 0.8B and 4B text configs and the X Elite profile's part ceiling; nothing
is measured. Usage: python scripts/bench/tile_model.py [--tile 2048] [--t-max 16384]"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import model_config  # noqa: E402

from hybrid_npu.config import ModelConfig  # noqa: E402
from hybrid_npu.export.npu.parts import cut_at_attention, htp_itemsize, plan_parts  # noqa: E402
from hybrid_npu.kernels.attention_tile import BULK_TILES  # noqa: E402
from hybrid_npu.profiles.loader import load_profile  # noqa: E402

POSITIONS = (1024, 8192, 32768, 131072, 262144)


def config(name: str) -> ModelConfig:
    return model_config(name)


def chunk_cost(cfg: ModelConfig, rows: int, c: int) -> tuple[float, float]:
    """(attention FLOPs, fp16 K/V bytes) of c queries against `rows` key rows in every attention layer."""
    n_full = len(cfg.full_layers)
    flops = 4 * n_full * cfg.num_attention_heads * c * rows * cfg.head_dim  # Q·Kᵀ and P·V
    return flops, n_full * 2 * cfg.num_key_value_heads * rows * cfg.head_dim * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", type=int, default=2048)
    ap.add_argument("--t-max", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args()
    prof = load_profile("snapdragon-x-elite")
    c, b = args.chunk, args.tile
    rows_out = []
    for name in ("0.8B", "4B"):
        cfg = config(name)
        parts = plan_parts(cfg, prof.part_weight_bytes, htp_itemsize(prof))
        segments = len(cut_at_attention(cfg, parts))
        for pos in POSITIONS:
            bulk = pos // (BULK_TILES * b)  # whole bulk calls before the chunk, then tiles (runtime/npu_attention.py)
            tiles = -(-(pos + c - bulk * BULK_TILES * b) // b)
            flops, kv = chunk_cost(cfg, (bulk * BULK_TILES + tiles) * b, c)
            row = {"model": name, "position": pos, "tiled_gflop": round(flops / 1e9, 1), "tiled_kv_mb": round(kv / 1e6, 1),
                   "tiled_npu_calls": segments + len(cfg.full_layers) * (bulk + tiles)}
            if pos + c <= args.t_max:  # the T_max graphs read all T_max past rows and the chunk's own
                flops, kv = chunk_cost(cfg, args.t_max + c, c)
                row.update(t_max_gflop=round(flops / 1e9, 1), t_max_kv_mb=round(kv / 1e6, 1), t_max_npu_calls=len(parts))
            else:
                row.update(t_max_gflop=None, t_max_kv_mb=None, t_max_npu_calls="CPU")
            rows_out.append(row)
    print(json.dumps({"modelled": True, "chunk": c, "tile": b, "t_max": args.t_max, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
