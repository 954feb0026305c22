"""npu-bench calibrate: measure where the NPU prefill starts to beat the CPU on this machine and
write that threshold into a user profile (docs/profiles.md: the shipped thresholds are seeds).

    npu-bench calibrate --profile snapdragon-x-elite [--model EXPORT] [--lengths 128,512,2048] [--json]

--model defaults to the embedded model, as npu-chat's and npu-summarize's do.

Prefill tokens/s is measured on the CPU and, when a QNN device is here, on the NPU at each
length; decode tokens/s on the CPU. The threshold is the shortest measured length from which the
NPU is at least as fast as the CPU at every longer length; when the NPU never wins it is set past
the NPU's K/V capacity (the NPU is then never chosen). Without an NPU it says so and measures the
CPU side only.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from hybrid_npu.cli_common import OneLineParser, path_arg
from hybrid_npu.errors import UserError
from hybrid_npu.profiles.loader import INT32_MAX


def _prefill_rate(engine, ids) -> float:
    engine.reset()
    t0 = time.perf_counter()
    engine.prefill(ids)
    return len(ids) / (time.perf_counter() - t0)


def calibrate(model: str | None, profile: str, lengths: list[int], decode_steps: int = 16, write: bool = True) -> dict:
    import hybrid_npu
    from hybrid_npu.profiles.loader import load_profile, write_user_profile

    prof = load_profile(profile)
    model = hybrid_npu.default_model() if model is None else model
    cpu = hybrid_npu.load(model, profile=prof.source, prefill="cpu")
    rng = np.random.default_rng(0)
    vocab = min(cpu.config.vocab_size, 1000)
    result = {"profile": prof.name, "model": str(model), "lengths": lengths, "cpu_prefill_tokens_per_s": [],
              "npu_prefill_tokens_per_s": None, "notice": None}
    for n in lengths:
        result["cpu_prefill_tokens_per_s"].append(round(_prefill_rate(cpu, list(rng.integers(0, vocab, n))), 2))
    cpu.generate([1, 2, 3], decode_steps, stop_at_eos=False)
    result["cpu_decode_tokens_per_s"] = round(cpu.last_stats["decode_tokens_per_s"], 2)
    npu = None
    if prof.has_npu:
        npu = hybrid_npu.load(model, profile=prof.source, prefill="auto")
        if "npu_prefill" not in npu.pipelines:
            result["notice"] = npu.notice
            npu = None
    else:
        result["notice"] = f"profile {prof.name} has no NPU; measured the CPU only"
    if npu is not None:
        npu.prefill_mode = "npu"
        rates = []
        tiled = npu._tiled("npu_prefill")  # tiles read any length; else the NPU stops at T_max
        for n in lengths:
            if n > prof.attention_capacity and not tiled:
                rates.append(None)
                continue
            rates.append(round(_prefill_rate(npu, list(rng.integers(0, vocab, n))), 2))
        result["npu_prefill_tokens_per_s"] = rates
        # never, unless the NPU wins from some length on
        threshold = INT32_MAX if tiled else prof.attention_capacity + 1
        for i in range(len(lengths) - 1, -1, -1):
            if rates[i] is None or rates[i] < result["cpu_prefill_tokens_per_s"][i]:
                break
            threshold = lengths[i]
        result["npu_prefill_min_tokens"] = threshold
        if write:
            result["written"] = str(write_user_profile(prof, npu_prefill_min_tokens=threshold))
    return result


def main(argv=None) -> int:
    p = OneLineParser(prog="npu-bench", description="Measure this machine; write what was measured into a profile.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="measure CPU vs NPU prefill and CPU decode; write the NPU threshold")
    c.add_argument("--profile", required=True, type=path_arg, help="device profile name or TOML path")
    c.add_argument("--model", type=path_arg, help="an export-hybrid output directory to measure with (default: the embedded model)")
    c.add_argument("--lengths", default="128,512,2048", help="comma-separated prompt lengths")
    c.add_argument("--no-write", action="store_true", help="measure only; leave the user profile alone")
    c.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        lengths = sorted(int(x) for x in args.lengths.split(",") if x.strip())
        if not lengths or min(lengths) < 1:
            raise ValueError
    except ValueError:
        print(f"npu-bench: error: --lengths {args.lengths!r} must be positive integers, e.g. 128,512,2048",
              file=sys.stderr)
        return 2
    try:
        result = calibrate(args.model, args.profile, lengths, write=not args.no_write)
    except UserError as e:
        print(f"npu-bench: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        if result["notice"]:
            print(result["notice"])
        for i, n in enumerate(lengths):
            npu = result["npu_prefill_tokens_per_s"]
            npu_s = "-" if not npu or npu[i] is None else f"{npu[i]:.1f}"
            print(f"prefill {n:>6} tokens: CPU {result['cpu_prefill_tokens_per_s'][i]:.1f} tok/s, NPU {npu_s} tok/s")
        print(f"decode (CPU): {result['cpu_decode_tokens_per_s']:.1f} tok/s")
        if "npu_prefill_min_tokens" in result:
            print(f"NPU prefill threshold: {result['npu_prefill_min_tokens']} tokens"
                  + (f" (written to {result['written']})" if result.get("written") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
