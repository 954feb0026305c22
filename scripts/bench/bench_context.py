"""Decode speed and memory against context length: the hybrid (Qwen3.5-0.8B text config, 18 GDN
+ 6 attention layers) beside the same model with every layer full attention (a traditional
transformer of the same size), both random weights, fp32, on our CPU runtime.

Decode cost depends on how many K/V rows there are, not on their values, so each context length
is set up by filling the K/V rows with random values (a 64k-token prefill would take hours here)
and then timing real decode steps through the exported graph. Prints JSON; with --plot writes a
PNG (matplotlib, the `plot` extra).

    python scripts/bench/bench_context.py [--workdir DIR] [--lengths 1024,...] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (one JSON object, machine and commit recorded)
from random_checkpoint import make_random_checkpoint  # noqa: E402

LENGTHS = [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def fill_context(engine, length: int, rng) -> None:
    """`length` K/V rows of random values, written through the cache's own conversion."""
    engine.reset()
    state = engine.state
    state.ensure_capacity(length + 64)
    for layer in state.attention.values():
        rows = (layer.key.shape[0], length, layer.key.shape[2])
        layer.write(0, rng.standard_normal(rows, dtype=np.float32), rng.standard_normal(rows, dtype=np.float32))
    state.position, state.tokens = length, [0] * length
    state.tokens = [0] * length


def measure(export_dir: Path, lengths: list[int], steps: int, threads: int) -> list[dict]:
    import hybrid_npu

    engine = hybrid_npu.load_engine(export_dir, threads=threads)
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        fill_context(engine, length, rng)
        engine.step("decode", [1])  # warm-up at this size
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step("decode", [1])
        tps = steps / (time.perf_counter() - t0)
        rows.append({"context": length, "decode_tokens_per_s": round(tps, 2),
                     "kv_bytes": engine.state.kv_bytes_in_use(),
                     "pss_gb": round(psutil.Process().memory_full_info().pss / 1e9, 2)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    del engine
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in result["series"].items():
        x = [max(r["context"], 256) for r in rows]
        ax1.plot(x, [r["decode_tokens_per_s"] for r in rows], marker="o", label=name)
        ax2.plot(x, [r["kv_bytes"] / 2**30 for r in rows], marker="o", label=name)
    for ax, title in ((ax1, "decode tokens/s"), (ax2, "K/V cache (GiB, fp32)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens (first point: empty)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']} — {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)



def decode_rates(export_dir: Path, lengths: list[int], steps: int, threads: int) -> list[float]:
    """Decode tok/s at each context length, one engine (run in a fresh process)."""
    import hybrid_npu
    from hybrid_npu.runtime import huge_pages

    engine = hybrid_npu.load_engine(export_dir, threads=threads)
    huge_pages.wait()  # the prepacked weights settled on huge pages (runtime/huge_pages.py) before timing
    rng = np.random.default_rng(0)
    rates = []
    for length in lengths:
        fill_context(engine, length, rng)
        engine.decode(1), engine.decode(1)  # warm-up at this size
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.decode(1)
            times.append(time.perf_counter() - t0)
        rates.append(round(1 / float(np.median(times)), 2))  # the median step: robust to this VM's spikes
    return rates

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    from hybrid_npu.export.exporter import export
    from hybrid_npu.manifest import is_export

    lengths = [int(x) for x in args.lengths.split(",")]
    series = {}
    variants = {"hybrid (18 GDN + 6 attention)": {},
                "all full attention (24 layers)": {"layer_types": ["full_attention"] * 24}}
    for label, overrides in variants.items():
        tag = "full" if overrides else "hybrid"
        src = make_random_checkpoint("0.8B", args.workdir / f"qwen35-0.8b-{tag}-random", **overrides)
        out = args.workdir / f"qwen35-0.8b-{tag}-export"
        if not is_export(out):
            export(src, out, chunk=128, force=True)
        series[label] = measure(out, lengths, args.steps, args.threads)
    hybrid = {r["context"]: r["decode_tokens_per_s"] for r in series["hybrid (18 GDN + 6 attention)"]}
    full = {r["context"]: r["decode_tokens_per_s"] for r in series["all full attention (24 layers)"]}
    result = {"model": "Qwen3.5-0.8B text config, random weights, fp32, CPU EP",
              "threads": args.threads, "series": series}
    if 0 in hybrid and 8192 in hybrid:
        result["hybrid_8k_over_empty"] = round(hybrid[8192] / hybrid[0], 3)
        result["full_8k_over_empty"] = round(full[8192] / full[0], 3)
    harness.emit(result)  # with the machine and commit
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
