"""What ONNX Runtime runs for one decode token and one prefill chunk of an export, per graph
optimisation level: the kernels executed (after ORT's fusions), by op type, with their share of
the time, from ORT's own profiler (which itself slows a step: compare levels, not with bench_cpu).
The any-N graph's If nodes are counted through their branches' kernels. Tells which of our nodes ORT fuses at each level and where a
step's time goes. Prints one JSON object.

    python scripts/profile_cpu_graph.py EXPORT_DIR [--levels disable,basic,extended,all] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_cpu import LEVELS  # noqa: E402
from bench_cpu import fresh_process  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)


def profile_level(export_dir: Path, level: str, threads: int, prompt: list[int], decode: int) -> dict:
    """One engine whose CPU sessions profile: a prompt's prefill, then `decode` tokens."""
    import onnxruntime as ort

    import hybrid_npu

    plain, sessions = ort.InferenceSession, []
    prefix = Path(tempfile.mkdtemp()) / "ort"

    def session(path, sess_options=None, *args, **kw):
        sess_options = sess_options or ort.SessionOptions()
        sess_options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
        sess_options.enable_profiling = True
        sess_options.profile_file_prefix = str(prefix)
        sessions.append(plain(path, sess_options, *args, **kw))
        return sessions[-1]

    ort.InferenceSession = session
    engine = hybrid_npu.load(export_dir, threads=threads)
    engine.generate(prompt, decode, stop_at_eos=False)
    events = []
    for s in sessions:
        events += json.loads(Path(s.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    # model_run events in order: the prefill chunks first, then one per decoded token
    chunks = -(-len(prompt) // engine.chunk)
    split = runs[chunks - 1]["ts"] + runs[chunks - 1]["dur"]
    out = {}
    for part, keep in (("prefill", lambda e: e["ts"] < split), ("decode", lambda e: e["ts"] >= split)):
        part_runs = [r for r in runs if keep(r)]
        part_nodes = [e for e in nodes if keep(e)]
        count, time_us = Counter(), Counter()
        for e in part_nodes:
            count[e["args"]["op_name"]] += 1
            time_us[e["args"]["op_name"]] += e["dur"]
        # an If's time includes its branch's nodes (profiled too): kept out of the sums and shares
        count.pop("If", None)
        if_us = time_us.pop("If", 0)
        total = sum(time_us.values())
        out[part] = {"calls": len(part_runs), "kernels_per_call": round(sum(count.values()) / len(part_runs)),
                     "ms_per_call": round(sum(r["dur"] for r in part_runs) / len(part_runs) / 1e3, 2),
                     "kernel_ms_per_call": round(total / len(part_runs) / 1e3, 2),
                     "if_ms_per_call": round(if_us / len(part_runs) / 1e3, 2),
                     "by_op": {op: {"per_call": round(count[op] / len(part_runs), 1),
                                    "time_share": round(time_us[op] / total, 3)}
                               for op, _ in time_us.most_common()}}
    return out


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("--levels", default="disable,basic,extended,all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not (args.export / "model.json").is_file():
        ap.error(f"{args.export} is not an export (no model.json); make one with export-hybrid")
    levels = args.levels.split(",")
    if bad := [lv for lv in levels if lv not in LEVELS]:
        ap.error(f"unknown level {bad[0]!r}; use {','.join(LEVELS)}")
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 200_000, args.prefill)]
    result = {"export": str(args.export), "threads": args.threads,
              **{lv: fresh_process(profile_level, args.export, lv, args.threads, prompt, args.decode)
                 for lv in levels}}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
