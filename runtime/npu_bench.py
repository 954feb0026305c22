"""npu-bench calibrate: measure where the NPU prefill starts to beat the CPU on this machine, and
which device verifies each speculative tree size faster, and write both into a user profile
(docs/profiles.md: the shipped thresholds are seeds; docs/npu-verify.md).

    npu-bench calibrate --profile snapdragon-x-elite [--model EXPORT] [--lengths 128,512,2048] [--json]

--model defaults to the embedded model, as npu-chat's and npu-summarize's do.

Prefill tokens/s is measured on the CPU and, when a QNN device is here, on the NPU at each
length; decode tokens/s on the CPU. The threshold is the shortest measured length from which the
NPU is at least as fast as the CPU at every longer length; when the NPU never wins it is set past
the NPU's K/V capacity (the NPU is then never chosen). Without an NPU it says so and measures the
CPU side only.

Verify is timed on the CPU at each tree size the export's CPU verify graph has, and on the NPU at
its static tree size N (one pass serves any tree up to N); each size verifies where it was faster,
and the costs go into the profile's [verify] table. Off a Snapdragon (onnxruntime-qnn's x86_64 HTP
backend is an emulator) the NPU figures only exercise the path: the result says so.
"""
from __future__ import annotations

import json
import sys
import time

import platform
from statistics import median

import numpy as np

from hybrid_npu.cli_common import OneLineParser, path_arg
from hybrid_npu.errors import UserError
from hybrid_npu.profiles.loader import INT32_MAX


def _prefill_rate(engine, ids) -> float:
    engine.reset()
    t0 = time.perf_counter()
    engine.prefill(ids)
    return len(ids) / (time.perf_counter() - t0)


def _verify_us(engine, pipeline: str, size: int, graph_n: int, repeats: int = 3) -> int:
    """Median microseconds of one tree verify of `size` nodes (a chain under the last prompt token)
    through `pipeline`, whose graph takes `graph_n` nodes; the state is read, never committed."""
    from .npu_sessions import NPU_DEVICE
    from .speculative import Tree, tree_feed

    state = engine.state
    if engine.pipelines[pipeline].device == NPU_DEVICE and state.capacity != engine.profile.attention_capacity:
        state.resize(engine.profile.attention_capacity)  # the NPU graph reads exactly T_max rows
    state.ensure_capacity(state.position + graph_n)
    tree, _ = Tree.from_draft(1, [2 + i % 7 for i in range(size - 1)], list(range(-1, size - 2)), graph_n)
    feed = tree_feed(engine.config, state, tree)
    engine.pipelines[pipeline].run(feed)  # the first call pays for allocation and caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.pipelines[pipeline].run(tree_feed(engine.config, state, tree))
        times.append(time.perf_counter() - t0)
    return max(1, round(median(times) * 1e6))


def verify_costs(engine, prompt: list[int], npu: bool) -> list[tuple]:
    """((size, device, cpu_us, npu_us), ...) for each tree size of the export: CPU at each size, the
    NPU (when `npu`) at its static N for every size up to N; each size verifies where it was faster."""
    n, sized = engine.manifest.verify.n, engine.manifest.cpu_verify
    sizes = [m for m in (sized.sizes if sized is not None else None) or [n] if 2 <= m <= 512]
    if npu and engine.state.position + n > engine.profile.attention_capacity:
        npu = False
    engine.reset()
    engine.prefill(prompt)
    npu_us = _verify_us(engine, "npu_verify", n, n) if npu else 0
    rows = []
    for m in sizes:
        cpu_us = _verify_us(engine, "verify", m, m)
        device = "npu" if npu_us and npu_us < cpu_us and m <= n else "cpu"
        rows.append((m, device, cpu_us, npu_us if m <= n else 0))
    return rows


def calibrate(model: str | None, profile: str, lengths: list[int], decode_steps: int = 16, write: bool = True) -> dict:
    import hybrid_npu
    from hybrid_npu.profiles.loader import load_profile, write_user_profile

    prof = load_profile(profile)
    model = hybrid_npu.default_model() if model is None else model
    cpu = hybrid_npu.load_engine(model, profile=prof.source, prefill="cpu")
    rng = np.random.default_rng(0)
    vocab = min(cpu.config.vocab_size, 1000)
    result = {"profile": prof.name, "model": str(model), "lengths": lengths, "cpu_prefill_tokens_per_s": [],
              "npu_prefill_tokens_per_s": None, "notice": None}
    for n in lengths:
        result["cpu_prefill_tokens_per_s"].append(round(_prefill_rate(cpu, list(rng.integers(0, vocab, n))), 2))
    cpu.generate([1, 2, 3], decode_steps, stop_at_eos=False)
    result["cpu_decode_tokens_per_s"] = round(cpu.last_stats["decode_tokens_per_s"], 2)
    npu = None
    has_verify = cpu.manifest.verify is not None
    prompt = [int(t) for t in rng.integers(0, vocab, 8)]
    if prof.has_npu:
        npu = hybrid_npu.load_engine(model, profile=prof.source, prefill="auto")
        if has_verify and "npu_verify" not in npu.pipelines and "npu_prefill" in npu.pipelines:
            from .npu_sessions import open_npu_pipeline
            from .qnn import NpuUnavailable
            try:  # the verify graph on the NPU, whatever device the profile verifies on now
                npu.pipelines["npu_verify"] = open_npu_pipeline(npu.path, npu.manifest, prof, "verify")
            except NpuUnavailable as e:
                result["notice"] = f"profile {prof.name}: {e}; verify measured on the CPU only"
        if "npu_prefill" not in npu.pipelines:
            result["notice"] = npu.notice
            npu = None
    else:
        result["notice"] = f"profile {prof.name} has no NPU; measured the CPU only"
    if npu is not None:
        npu.prefill_mode = "npu"
        rates = []
        tiled = npu.tiled("npu_prefill")  # tiles read any length; else the NPU stops at T_max
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
        over = {"npu_prefill_min_tokens": threshold}
        if has_verify:
            rows = verify_costs(npu, prompt, "npu_verify" in npu.pipelines)
            result["verify"] = [dict(zip(("size", "device", "cpu_us", "npu_us"), r)) for r in rows]
            over["verify_by_size"] = tuple(rows)
            if platform.machine().lower() in ("x86_64", "amd64"):
                result["verify_notice"] = ("NPU verify times come from onnxruntime-qnn's x86_64 HTP emulator: "
                                           "the path is exercised, its speed is not the NPU's")
        if write:
            result["written"] = str(write_user_profile(prof, **over))
    elif has_verify:
        result["verify"] = [dict(zip(("size", "device", "cpu_us", "npu_us"), r))
                            for r in verify_costs(cpu, prompt, False)]
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
        for v in result.get("verify", []):
            npu_s = f"{v['npu_us']} us" if v["npu_us"] else "-"
            print(f"verify {v['size']:>4} nodes: CPU {v['cpu_us']} us, NPU {npu_s} -> {v['device']}")
        if result.get("verify_notice"):
            print(result["verify_notice"])
        if "npu_prefill_min_tokens" in result:
            print(f"NPU prefill threshold: {result['npu_prefill_min_tokens']} tokens"
                  + (f" (written to {result['written']})" if result.get("written") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
