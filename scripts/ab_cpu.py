"""Paired A/B of one CPU speed lever: two (export, session options) arms, alternated A B A B ... each
in a fresh process (bench_cpu.bench_ours: prefill best of 2, decode best of 3), the order turned
each round (A B, B A, ...: a slot's advantage is not left to one arm), best of the rounds per arm
and the median of the rounds' paired ratios. This VM drifts by ±20% over minutes, so only the ratio of arms measured side by side in
one run means anything. Prints one JSON object.

An arm is EXPORT_DIR[,OPTION...]; an option is opt=disable|basic|extended|all (the graph
optimisation level), intra=N (intra-op threads), arena=0|1 (ORT's CPU memory arena) or a session
config entry KEY=VALUE, e.g.
session.intra_op.allow_spinning=0. The options are applied to every CPU session the engine opens.

    python scripts/ab_cpu.py --a /tmp/x/int4 --b /tmp/x/int4,session.intra_op.allow_spinning=0
                             [--rounds 3] [--threads 2] [--prefill 512] [--decode 32] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import bench_ours, fresh_process  # noqa: E402
from bench_speculative import paired, rotated  # noqa: E402  (the arm order turned each round, the median paired ratio)

from hybrid_npu.cli_common import OneLineParser  # noqa: E402
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
          "all": "ORT_ENABLE_ALL"}


def parse_arm(text: str) -> tuple[Path, dict[str, str]]:
    path, *options = text.split(",")
    opts = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or (key == "opt" and value not in LEVELS) or (key == "intra" and not value.isdigit()) or (
                key == "arena" and value not in ("0", "1")):
            raise ValueError(f"bad option {option!r}; use opt={'|'.join(LEVELS)}, intra=N, arena=0|1 or a session KEY=VALUE")
        opts[key] = value
    return Path(path), opts


def _apply(sess_opts, options: dict[str, str]) -> None:
    import onnxruntime as ort

    for key, value in options.items():
        if key == "opt":
            sess_opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[value])
        elif key == "intra":
            sess_opts.intra_op_num_threads = int(value)
        elif key == "arena":
            sess_opts.enable_cpu_mem_arena = value == "1"
        else:
            sess_opts.add_session_config_entry(key, value)


def measure(export_dir: Path, options: dict, threads: int, prompt: list[int], decode: int) -> dict:
    """bench_ours with `options` applied to each CPU session (run in a fresh process)."""
    import onnxruntime as ort

    plain = ort.InferenceSession

    def session(path, sess_options=None, *args, **kw):
        sess_options = sess_options or ort.SessionOptions()
        _apply(sess_options, options)
        return plain(path, sess_options, *args, **kw)

    ort.InferenceSession = session
    return bench_ours(export_dir, threads, prompt, decode)


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    arms = {}
    for name in ("a", "b"):
        try:
            arms[name] = parse_arm(getattr(args, name))
        except ValueError as e:
            ap.error(str(e))
        if not (arms[name][0] / "model.json").is_file():
            ap.error(f"{arms[name][0]} is not an export (no model.json); make one with export-hybrid")
    vocab = min(json.loads((arms[n][0] / "model.json").read_text())["config"]["vocab_size"] for n in arms)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, min(vocab, 200_000), args.prefill)]
    runs = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in rotated(list(arms), r):
            path, options = arms[name]
            row = fresh_process(measure, path, options, args.threads, prompt, args.decode)
            runs[name].append({k: row[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")})
            print(name, runs[name][-1], file=sys.stderr)
    result = {"threads": args.threads, "prefill_tokens": args.prefill, "decode_tokens": args.decode}
    for name, (path, options) in arms.items():
        result[name] = {"export": str(path), "options": options, "runs": runs[name],
                        **{f"best_{k}": max(r[k] for r in runs[name])
                           for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}}
    result["b_over_a"] = {k: round(result["b"][f"best_{k}"] / result["a"][f"best_{k}"], 3)
                          for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    result["b_over_a_paired"] = {k: paired([r[k] for r in runs["b"]], [r[k] for r in runs["a"]])["paired_vs_plain"]
                                 for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    bench_json.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
