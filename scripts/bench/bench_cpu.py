"""CPU prefill and decode speed: our runtime vs transformers eager, same checkpoint, same threads.

Random weights with the real Qwen3.5-0.8B text config (speed does not depend on the values).
One row per weight mode (float = the fp32 export, int8 / int4 = export-hybrid --weights, with
-headN / -bN for --head-bits / --block-size), each measured in a fresh process so its resident
memory is its own (prefill the best of 2 runs, decode of 3: runs here vary by up to ±20%);
decode_session_gb is a session of decode.onnx alone (the engine runs decode, and on a CPU-only
machine prefill too, in one session of the any-N cpu.onnx: after_load); matmul_only is what the
same export's MatMulNBits nodes alone reach (scripts/bench/matmul_ceiling.py: the most any graph
around them could). Prints one JSON object. With --gguf (the same checkpoint, scripts/bench/make_gguf.py)
llama.cpp's llama-bench runs first in the same run, same prompt / decoded tokens / threads; a
missing llama-bench is one line and exit 2. --weights "" runs llama.cpp alone.

    python scripts/bench/bench_cpu.py [--workdir DIR] [--threads 2] [--prefill 512] [--decode 32]
                                [--weights float,int8,int4,int4-head4,int4-head4-b128] [--out FILE]
                                [--gguf F16.gguf --gguf Q8_0.gguf ... [--llama-bench PATH]]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul_ceiling import ceiling  # noqa: E402
from random_checkpoint import make_random_checkpoint  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)
from harness import cpu_model, fresh_process  # noqa: E402


def _memory_gb() -> dict:
    # PSS: the weights file is mapped once per session, so RSS counts its pages twice
    info = psutil.Process().memory_full_info()
    return {"rss_gb": round(info.rss / 1e9, 2), "pss_gb": round(info.pss / 1e9, 2)}


def bench_ours(export_dir: Path, threads: int, prompt: list[int], decode: int) -> dict:
    import hybrid_npu
    from hybrid_npu.runtime import huge_pages

    t0 = time.perf_counter()
    engine = hybrid_npu.load_engine(export_dir, threads=threads)
    load_s = time.perf_counter() - t0
    huge_pages.wait()  # the prepacked weights settled on huge pages (runtime/huge_pages.py) before timing
    after_load = _memory_gb()  # the resident weights: quantised sessions hold their prepacked copies
    engine.prefill_logits(prompt[:16])  # warm-up
    prefill_s = float("inf")
    for _ in range(2):  # the best run: this VM's slow spells last seconds (as matmul_ceiling's bound)
        t0 = time.perf_counter()
        engine.prefill_logits(prompt)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    decode_tps = 0.0
    for _ in range(3):  # plain decoding: an export with a drafter would otherwise speculate (engine default)
        engine.generate(prompt[:16], decode, stop_at_eos=False, speculative=False)
        decode_tps = max(decode_tps, engine.last_stats["decode_tokens_per_s"])
    weights = engine.manifest.weights
    return {"weights": weights.mode, "weights_file_gb": round(weights.bytes / 1e9, 3),
            "load_s": round(load_s, 2), "prefill_tokens_per_s": round(len(prompt) / prefill_s, 2),
            "decode_tokens_per_s": round(decode_tps, 2),
            "after_load": after_load, **_memory_gb()}


def decode_session_gb(export_dir: Path) -> float:
    """PSS a session of the one-token decode graph alone adds."""
    from hybrid_npu.runtime.pipeline import cpu_session

    from hybrid_npu.manifest import load_manifest

    manifest = load_manifest(export_dir)
    before = psutil.Process().memory_full_info().pss
    session = cpu_session(export_dir / manifest.decode.file, manifest.weights)
    grown = psutil.Process().memory_full_info().pss - before
    del session
    return round(grown / 1e9, 2)


def parse_mode(mode: str) -> tuple[str, dict]:
    """A weight mode: float, int8, int4, with optional -headN (--head-bits N) and -bN (--block-size
    N), e.g. int4-head4-b128 -> ("int4", {"head_bits": 4, "block_size": 128})."""
    weights, *options = mode.split("-")
    flags = {"head": "head_bits", "b": "block_size"}
    kw = {}
    for option in options:
        m = re.fullmatch(r"(head|b)(\d+)", option)
        if not m:
            raise ValueError(f"unknown option {option!r} in weight mode {mode!r}; use -headN or -bN")
        kw[flags[m.group(1)]] = int(m.group(2))
    return weights, kw


def export_dir(workdir: Path, mode: str) -> Path:
    return workdir / ("qwen35-0.8b-export" if mode == "float" else f"qwen35-0.8b-export-{mode}")


def export_mode(src: Path, out: Path, mode: str) -> Path:
    """Export one weight mode (parse_mode). Exported afresh every run: an export left by older
    code would measure older graphs."""
    from hybrid_npu.export.exporter import export

    weights, kw = parse_mode(mode)
    t0 = time.perf_counter()
    export(src, out, chunk=128, force=True, weights=weights, **kw)
    print(f"exported {mode} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def bench_transformers(src: Path, threads: int, prompt: list[int], decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        model(torch.tensor([prompt[:16]]))  # warm-up
        t0 = time.perf_counter()
        model(torch.tensor([prompt]))
        prefill_s = time.perf_counter() - t0
        out = model(torch.tensor([prompt[:16]]), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    return {"prefill_tokens_per_s": round(len(prompt) / prefill_s, 2),
            "decode_tokens_per_s": round(decode / decode_s, 2)}


def find_llama_bench(given: Path | None) -> Path | None:
    if given is not None:
        return given if given.is_file() else None
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def llama_bench_rows(out: str) -> dict:
    """llama-bench -o json rows -> prefill / decode tok/s (the prompt test has n_gen 0, the
    generation test n_prompt 0): the best repetition, as our rows take the best run (this VM's
    slow spells last seconds), with llama-bench's own average and deviation beside it."""
    result = {}
    for r in json.loads(out):
        part = "decode" if r["n_gen"] else "prefill"
        result[f"{part}_tokens_per_s"] = round(max(r.get("samples_ts") or [r["avg_ts"]]), 2)
        result[f"{part}_avg"] = round(r["avg_ts"], 2)
        result[f"{part}_stdev"] = round(r.get("stddev_ts", 0.0), 2)
    return result


def bench_llama_cpp(exe: Path, gguf: Path, threads: int, prefill: int, decode: int, reps: int) -> dict:
    """llama-bench on one GGUF: prompt `prefill` and `decode` generated tokens, `reps` repetitions."""
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-p", str(prefill), "-n", str(decode),
           "-r", str(reps), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-bench failed on {gguf.name}: {tail}")
    rows = json.loads(run.stdout)
    return {"gguf": gguf.name, "type": rows[0].get("model_type", ""), "build": rows[0].get("build_commit", ""),
            "cpu_info": rows[0].get("cpu_info", ""), "gguf_gb": round(gguf.stat().st_size / 1e9, 3),
            **llama_bench_rows(run.stdout)}


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--gguf", type=Path, action="append", default=[],
                    help="the same checkpoint as GGUF (scripts/bench/make_gguf.py), run by llama-bench in the same run; "
                         "repeat for F16 / Q8_0 / Q4_0")
    ap.add_argument("--llama-bench", type=Path, help="the llama-bench binary (default: the one on PATH)")
    ap.add_argument("--llama-reps", type=int, default=5, help="llama-bench repetitions (the best is reported, and its average)")
    ap.add_argument("--weights", default="float,int8,int4", help="comma-separated weight modes, one row each")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    for mode in filter(None, args.weights.split(",")):  # every mode checked before the first export starts
        try:
            parse_mode(mode)
        except ValueError as e:
            ap.error(str(e))
    llama_bench = None
    if args.gguf:  # checked before any export: a missing binary should not cost an hour of ours first
        llama_bench = find_llama_bench(args.llama_bench)
        if llama_bench is None:
            where = f"{args.llama_bench} not found" if args.llama_bench else "no llama-bench on PATH"
            ap.error(f"--gguf needs llama.cpp's llama-bench: {where}; build it and put it on PATH or give --llama-bench")
        for gguf in args.gguf:
            if not gguf.is_file():
                ap.error(f"GGUF {gguf} not found; make it with scripts/bench/make_gguf.py")

    for mode in filter(None, args.weights.split(",")):  # refused after llama-bench's rows, it lost them
        if (out := export_dir(args.workdir, mode)).is_symlink():
            ap.error(f"{out} is a link; each run exports afresh into its own directory: "
                     "remove the link or give another --workdir")

    src = make_random_checkpoint("0.8B", args.workdir / "qwen35-0.8b-random")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 200_000, args.prefill)]
    result = {
        "machine": {"cpu": cpu_model(), "cores": psutil.cpu_count(),
                    "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "threads": args.threads,
                    "load_average": [round(x, 1) for x in psutil.getloadavg()]},
        "model": "Qwen3.5-0.8B text config, random weights",
        "prefill_tokens": args.prefill, "decode_tokens": args.decode,
    }
    for gguf in args.gguf:  # first: llama.cpp and ours then share this run's conditions
        try:
            row = bench_llama_cpp(llama_bench, gguf, args.threads, args.prefill, args.decode, args.llama_reps)
        except RuntimeError as e:
            ap.error(f"{e}; check the GGUF was made by scripts/bench/make_gguf.py with the same llama.cpp build")
        result.setdefault("llama_cpp", []).append(row)
    for mode in filter(None, args.weights.split(",")):
        out = export_dir(args.workdir, mode)
        row = "hybrid_npu_cpu" if mode == "float" else f"hybrid_npu_cpu_{mode}"
        try:
            exported = export_mode(src, out, mode)
        except UserError as e:  # the rows measured so far are kept (stdout and --out)
            harness.emit(result, args.out)
            print(f"bench_cpu.py: error: {e}", file=sys.stderr)
            return 2
        result[row] = fresh_process(bench_ours, exported, args.threads, prompt, args.decode)
        result[row]["decode_session_gb"] = fresh_process(decode_session_gb, out)
        if mode != "float":
            bound = fresh_process(ceiling, out, args.threads)
            result[row]["matmul_only"] = {part: bound[part]["tokens_per_s"] for part in ("prefill", "decode")}
    if not args.skip_transformers and "hybrid_npu_cpu" in result:
        result["transformers_eager"] = bench_transformers(src, args.threads, prompt, args.decode)
        ours, hf = result["hybrid_npu_cpu"], result["transformers_eager"]
        result["speedup_vs_transformers"] = {k: round(ours[k] / hf[k], 2) for k in
                                             ("prefill_tokens_per_s", "decode_tokens_per_s")}
    harness.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
