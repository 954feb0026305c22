"""Modelled tokens/s of speculation verified on the NPU for a Snapdragon X (docs/npu-verify.md):
plain CPU decode, sequential rounds verified on the CPU, on the NPU, and on the NPU with the drafter
running ahead, at acceptance 0.6 / 0.7 / 0.8, for the 0.8B and the 4B.

    python -P scripts/bench/verify_model.py --measure EXPORT --out scripts/bench/results/verify_model/NAME.json
    python -P scripts/bench/verify_model.py --costs scripts/bench/results/verify_model/NAME.json

--measure times on this machine, in one process and interleaved, a CPU decode step and one CPU
verify at every tree size of EXPORT (an int4 0.8B export: scripts/bench/bench_cpu.py builds one),
best of --repeats; --costs reads such a measurement back. Everything else is an assumption, named
in ASSUMPTIONS and printed with the table. No NPU speed is measured here.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from statistics import median

ACCEPTANCE = (0.6, 0.7, 0.8)
ASSUMPTIONS = {
    "cpu": "the Snapdragon X's CPU decodes and verifies at this machine's measured costs (2 threads)",
    "npu_step": "an NPU decode step costs 3 CPU decode steps (docs/profiles.md seed: CPU decode ~3x NPU decode); "
                "also shown at 1 CPU step (an NPU as fast as the CPU at N = 1), to show where the answer turns",
    "npu_tree": "an NPU verify of any tree up to its static 64 nodes costs one NPU decode step (one pass reads "
                "the weights once whatever N; the HTP's matrix units are idle at N = 1)",
    "draft_level": "an EAGLE-3 draft level (one layer, 32k-token head, int4) costs 0.104 of a decode step "
                   "(docs/mtp-drafter.md: 7.21 ms against a 69.3 ms step, 0.8B int4, one run on one machine)",
    "commit": "committing the accepted path and the drafter's observe cost 0.1 of a decode step "
              "(docs/speculation.md: 2.6-2.9 ms at 0.8B int4)",
    "acceptance": "a chain: each draft is accepted with probability a once its predecessors are; the NPU's "
                  "free extra tree nodes are not counted (a lower bound for the NPU columns)",
    "ahead": "the look-ahead drafts round r+1 from round r's most probable end (every draft accepted and the "
             "bonus token the drafter's next guess): kept with probability a^(d+1); when kept the next round's "
             "drafting hid under the NPU verify, else it is drafted after it",
    "4b": "a 4B step, verify and draft level cost the 0.8B's times the ratio of weights a step reads "
          "(computed from the two configs, int4 alike)",
}
NPU_STEPS = (3.0, 1.0)
DRAFT_LEVEL = 0.104
COMMIT = 0.1
NPU_TREE = 64
MAX_DEPTH = 12


def _weights(h, layers, n_h, n_kv, hv, inter, vocab=248320, hd=256, hk=16, dk=128, dv=128) -> int:
    """Weights one decode step reads (matmuls and the tied head) for a Qwen3.5 text config, 3:1 layers."""
    mlp = 3 * h * inter
    full = h * n_h * hd * 2 + 2 * h * n_kv * hd + n_h * hd * h       # gated q, k, v, o
    linear = h * (2 * hk * dk + hv * dv) + h * hv * dv + 2 * h * hv + hv * dv * h  # qkv, z, b/a, out
    n_full = layers // 4
    return layers * mlp + n_full * full + (layers - n_full) * linear + vocab * h


# configs from scripts/bench/random_checkpoint.py (REAL_TEXT_CONFIGS)
RATIO_4B = _weights(2560, 32, 16, 4, 32, 9216) / _weights(1024, 24, 8, 2, 16, 3584)


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")  # Linux; elsewhere what platform knows
    if info.is_file():
        for line in info.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure(export: str, repeats: int) -> dict:
    import hybrid_npu
    from hybrid_npu.runtime.npu_bench import verify_costs

    engine = hybrid_npu.load_engine(export, profile="cpu", prefill="cpu")
    prompt = list(range(100, 116))
    decode, verify = [], {}
    for _ in range(repeats):
        engine.reset()
        engine.prefill(prompt)
        engine.decode(7)  # the first step pays for caches
        steps = []
        for t in range(8):
            t0 = time.perf_counter()
            engine.decode(8 + t)
            steps.append(time.perf_counter() - t0)
        decode.append(median(steps))
        for size, _, cpu_us, _ in verify_costs(engine, prompt, False):
            verify.setdefault(size, []).append(cpu_us / 1e3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"machine": f"{_cpu_name()}, 2 threads", "date": date.today().isoformat(),
            "commit": commit, "export": export, "repeats": repeats, "note": "best of repeats, interleaved",
            "decode_ms": round(min(decode) * 1e3, 2),
            "verify_ms": {str(k): round(min(v), 2) for k, v in sorted(verify.items())}}


def _chain_tokens(a: float, d: int) -> float:
    return 1 + sum(a ** i for i in range(1, d + 1))


def model(costs: dict, npu_steps: float) -> dict:
    t = costs["decode_ms"]
    sizes = sorted((int(k), v) for k, v in costs["verify_ms"].items())

    def cpu_verify(n):  # the smallest measured size that holds n nodes
        return next((v for m, v in sizes if m >= n), None)

    rows = {}
    for name, scale in (("0.8B", 1.0), ("4B", RATIO_4B)):
        step = t * scale
        level, commit, npu_verify = DRAFT_LEVEL * step, COMMIT * step, npu_steps * step
        for a in ACCEPTANCE:
            best = {"cpu_verify": (0.0, 0), "npu_verify": (0.0, 0), "npu_ahead": (0.0, 0)}
            for d in range(1, MAX_DEPTH + 1):
                tokens = _chain_tokens(a, d)
                v = cpu_verify(d + 1)
                periods = {"npu_verify": d * level + npu_verify + commit}
                if v is not None:
                    periods["cpu_verify"] = d * level + v * scale + commit
                if d + 1 <= NPU_TREE:
                    keep = a ** (d + 1)
                    periods["npu_ahead"] = (keep * max(npu_verify, (d + 1) * level)
                                            + (1 - keep) * (npu_verify + d * level) + commit)
                for mode, period in periods.items():
                    rate = tokens / period * 1e3
                    if rate > best[mode][0]:
                        best[mode] = (rate, d)
            rows[f"{name} a={a}"] = {"plain_cpu": round(1e3 / step, 2),
                                     **{m: round(r, 2) for m, (r, _) in best.items()},
                                     **{f"{m}_depth": d for m, (_, d) in best.items()}}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--measure", help="an int4 0.8B export to time here")
    src.add_argument("--costs", type=Path, help="a measurement this script wrote")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the measurement here")
    args = ap.parse_args()
    costs = measure(args.measure, args.repeats) if args.measure else json.loads(args.costs.read_text(encoding="utf-8"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"measured": costs, "assumptions": ASSUMPTIONS, "ratio_4b": round(RATIO_4B, 3),
                      "modelled_tokens_per_s": {f"npu_step_{r:g}_cpu_steps": model(costs, r) for r in NPU_STEPS}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
