"""The one paired-A/B harness every benchmark here reports through.

A shared VM drifts by ±20% over minutes, so only arms measured side by side in one run compare:
each arm runs in a fresh process (memory freed by an earlier arm does not always go back to the
OS), the arms alternate and their order turns each round (A B, B A, ...: with A always first the
second process of a pair read faster in 6 of 7 pairs, so a fixed order hands that slot to one arm),
each arm keeps its best round, and B / A is the median of the rounds' paired ratios. Every result
records the machine and the commit it was measured on.

Library: `emit`, `machine`, `commit`, `fresh_process`, `rotated`, `paired`, `ab`.
Command line: two commands that each print one JSON object, alternated in fresh processes:

    python scripts/bench/harness.py --a "CMD A" --b "CMD B" --metric decode_tokens_per_s [--metric ...]
                                    [--rounds 3] [--out FILE]

A metric is a dotted path into the arm's JSON (e.g. hybrid_npu_cpu_int4.decode_tokens_per_s);
higher is better. Environment switches go in the command (`HYBRID_NPU_SPINNING=0 python ...`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]

SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "fphp", "asimdhp")


def cpu_model() -> dict:
    """The CPU by name and the SIMD flags that decide these kernels' speed (Linux: /proc/cpuinfo,
    what lscpu prints; elsewhere platform.processor())."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return {"model_name": platform.processor() or platform.machine(), "flags": []}
    text = info.read_text()
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    present = set(flags.group(1).split()) if flags else set()
    family, model = (re.search(rf"^{k}\s*:\s*(\d+)$", text, re.M) for k in ("cpu family", "model"))
    return {"model_name": name.group(1).strip() if name else platform.machine(),
            "family_model": [int(m.group(1)) for m in (family, model) if m],  # a VM may hide the name, not these
            "flags": [f for f in SIMD_FLAGS if f in present]}


def machine() -> dict:
    """What a number was measured on: CPU, cores, OS, Python, ONNX Runtime, the load at the time."""
    try:
        import onnxruntime
        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
            "onnxruntime": ort, "load_average": load}


def commit() -> str | None:
    """The checkout's commit (short), with "-dirty" when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def emit(result: dict, out: Path | None = None) -> None:
    """One JSON object on stdout, and the same text in `out`; the machine, commit and UTC date are
    added where the benchmark did not record them itself."""
    result.setdefault("machine", machine())
    result.setdefault("commit", commit())
    result.setdefault("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")


def fresh_process(fn: Callable, *args):
    """fn(*args) in a new process: memory freed by an earlier row does not always go back to the OS."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def rotated(arms: list, r: int) -> list:
    """Round r's order of the arms: the list turned by r, so that no arm always runs in the same slot.
    Round 0 keeps the first arm first (a benchmark's reference, e.g. plain decoding, runs first)."""
    k = r % len(arms)
    return arms[k:] + arms[:k]


def paired(rates: list[float], base: list[float]) -> dict:
    """Each round's rate over the base arm's rate in the same round: their median and all of them."""
    ratios = [r / p for r, p in zip(rates, base)]
    return {"paired_vs_plain": round(statistics.median(ratios), 3), "paired_ratios": [round(x, 3) for x in ratios]}


def ab(arms: dict[str, Callable[[], dict]], metrics: list[str], rounds: int) -> dict:
    """Run each arm (a callable returning a flat or nested dict) `rounds` times, alternated with the
    order turned each round; per arm every round's metrics and the best; per later arm its paired
    median ratio over the first arm for each metric."""
    names = list(arms)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            row = arms[name]()
            runs[name].append({m: _pick(row, m) for m in metrics})
            print(name, runs[name][-1], file=sys.stderr)
    first = names[0]
    out = {}
    for name in names:
        out[name] = {"runs": runs[name], **{f"best_{m}": max(x[m] for x in runs[name]) for m in metrics}}
        if name != first:
            out[name][f"over_{first}_paired"] = {
                m: paired([x[m] for x in runs[name]], [x[m] for x in runs[first]])["paired_vs_plain"] for m in metrics}
    return out


def _pick(row: dict, path: str) -> float:
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"the arm's JSON has no {path!r}")
        value = value[key]
    return float(value)


def _run_command(command: str) -> dict:
    """A shell-free command in a fresh process (leading NAME=VALUE words set its environment); its
    stdout's one JSON object."""
    words = shlex.split(command)
    env = dict(os.environ)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    done = subprocess.run(words, capture_output=True, text=True, encoding="utf-8", env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{command!r} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--a", required=True, help="arm A: a command printing one JSON object")
    ap.add_argument("--b", required=True, help="arm B: the same for B")
    ap.add_argument("--metric", action="append", required=True, help="dotted path into the JSON; repeatable")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("give --rounds >= 1")
    try:
        rows = ab({"a": lambda: _run_command(args.a), "b": lambda: _run_command(args.b)}, args.metric, args.rounds)
    except (KeyError, RuntimeError, ValueError) as e:
        print(f"harness.py: error: {e}", file=sys.stderr)
        return 2
    emit({"arms": {"a": args.a, "b": args.b}, "rounds": args.rounds, **rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
