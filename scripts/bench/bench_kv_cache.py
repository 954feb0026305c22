"""The K/V cache's dtype against speed and accuracy, one run (docs/kv-cache.md): the random
Qwen3.5-0.8B-config checkpoint (scripts/random_checkpoint.py) exported int4 once per cache dtype
(export-hybrid --weights int4 --kv-cache fp32|fp16|int8), each measured in fresh processes, the
caches alternated round by round (the machine is shared: best of the rounds per figure).

Per cache: --depth K/V rows filled with random fp32 values (the same rows for every cache, stored
in its dtype; decode and prefill cost depend on how many rows there are, not on what they hold;
scripts/bench_context.py), then a --prefill-token prompt prefilled after them (random ids, the same
for every cache): prefill tok/s at that depth, its last logits and a --greedy-token greedy
continuation; then decode tok/s at each of --contexts (rows filled the same way). Against the fp32
cache: the logits' max abs error and how many greedy tokens agree before the first difference.
Prints one JSON object.

    python scripts/bench/bench_kv_cache.py [--workdir DIR] [--caches fp32,fp16,int8] [--contexts 0,8192,32768]
                                     [--prefill 512] [--depth 8192] [--rounds 2] [--steps 16] [--greedy 16]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_context import fill_context  # noqa: E402  (random K/V rows through the cache's own conversion)
from random_checkpoint import make_random_checkpoint  # noqa: E402

SEED = 0


def export_for(workdir: Path, kv_cache: str) -> Path:
    from hybrid_npu.export.exporter import export
    from hybrid_npu.manifest import is_export

    out = workdir / f"export-int4-{kv_cache}"
    if not is_export(out):
        export(make_random_checkpoint("0.8B", workdir / "qwen35-0.8b-random"), out, chunk=128, force=True,
               weights="int4", kv_cache=kv_cache)
    return out


def worker(export_dir: Path, args) -> dict:
    """One cache's figures, in this (fresh) process; the prompt's last logits go to args.logits_out."""
    import hybrid_npu

    engine = hybrid_npu.load_engine(export_dir, threads=args.threads, checkpoints=0)
    ids = [int(t) for t in np.random.default_rng(SEED).integers(0, engine.config.vocab_size, args.prefill)]
    engine.step("prefill", ids[:128])  # warm-up: sessions and first-call allocations
    fill_context(engine, args.depth, np.random.default_rng(SEED))  # the same fp32 rows, in this cache's dtype
    t0 = time.perf_counter()
    logits = engine.prefill(ids)
    prefill_s = time.perf_counter() - t0
    np.save(args.logits_out, logits)
    greedy = []
    for _ in range(args.greedy):
        greedy.append(int(np.argmax(logits)))
        logits = engine.decode(greedy[-1])
    row = {"kv_cache": engine.kv_cache, "prefill_tokens": args.prefill, "prefill_at": args.depth,
           "prefill_tok_s": round(args.prefill / prefill_s, 2), "greedy": greedy,
           "kv_bytes_per_token": engine.memory.kv_bytes_per_token, "decode_tok_s": {}}
    rng = np.random.default_rng(1)
    for length in args.contexts:
        fill_context(engine, length, rng)
        engine.decode(1)  # warm-up at this size
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.decode(1)
        row["decode_tok_s"][str(length)] = round(args.steps / (time.perf_counter() - t0), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--caches", default="fp32,fp16,int8")
    ap.add_argument("--contexts", default="0,8192,32768")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one measurement, in this process
    ap.add_argument("--logits-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args)))
        return
    caches = args.caches.split(",")
    exports = {kv: export_for(args.workdir, kv) for kv in caches}
    runs: dict[str, list[dict]] = {kv: [] for kv in caches}
    logits = {}
    for r in range(args.rounds):
        for kv in (caches if r % 2 == 0 else caches[::-1]):  # alternated: neither always goes first
            out = args.workdir / f"logits-{kv}.npy"
            cmd = [sys.executable, __file__, "--worker", str(exports[kv]), "--logits-out", str(out),
                   "--prefill", str(args.prefill), "--depth", str(args.depth), "--steps", str(args.steps), "--greedy", str(args.greedy),
                   "--threads", str(args.threads), "--contexts", ",".join(map(str, args.contexts))]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[kv].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            logits[kv] = np.load(out)
            print(json.dumps({"round": r, **runs[kv][-1]}), file=sys.stderr, flush=True)
    base = "fp32" if "fp32" in caches else caches[0]
    rows = []
    for kv in caches:
        best = {"kv_cache": kv, "kv_bytes_per_token": runs[kv][0]["kv_bytes_per_token"],
                "prefill_tok_s": max(r["prefill_tok_s"] for r in runs[kv]),
                "decode_tok_s": {c: max(r["decode_tok_s"][c] for r in runs[kv]) for c in runs[kv][0]["decode_tok_s"]}}
        ref, mine = runs[base][0]["greedy"], runs[kv][0]["greedy"]
        agree = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), len(ref))
        best[f"vs_{base}"] = {"logits_max_abs_err": float(np.abs(logits[kv] - logits[base]).max()),
                              "logits_max_abs": float(np.abs(logits[base]).max()),
                              "greedy_agree_prefix": agree, "greedy_tokens": len(ref)}
        rows.append(best)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    print(json.dumps({"machine": cpu, "threads": args.threads, "rounds": args.rounds, "prefill_tokens": args.prefill,
                      "prefill_at": args.depth,
                      "steps": args.steps, "weights": "int4", "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
