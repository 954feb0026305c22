"""Prove NPU placement: compile a graph on the QNN HTP with CPU fallback disabled, in a child
process (a backend crash or a multi-GB compile cannot take the caller down), and report the node
count, how many nodes the HTP took, and the first node it refused with the EP's own reason.

    python -m hybrid_npu.export.npu.check GRAPH.onnx --options JSON [--free-dims JSON]   (worker)
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import onnx

from hybrid_npu.orphan import exit_with_parent, parent_token

_PASSED = re.compile(r"Validation PASSED for (\d+) nodes")
_FAILED = re.compile(r"Validation FAILED for (\d+) nodes in OrtNodeUnit \((\w+)\)")
_NODE = re.compile(r"Node name: (\S+)")
_REASON = re.compile(r"REASON : (.*)")


def _parse_validation(log: str) -> dict:
    """Counts from the EP's first capability pass (ORT asks twice); the first refusal and why."""
    passed, failed, first = 0, 0, None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "Unsupported nodes in QNN EP" in line:
            break
        if m := _PASSED.search(line):
            passed += int(m.group(1))
        elif m := _FAILED.search(line):
            failed += int(m.group(1))
            if first is None:
                ctx = "\n".join(lines[i: i + 3])
                node, reason = _NODE.search(ctx), _REASON.search(ctx)
                first = {"op": m.group(2), "node": node.group(1) if node else "?",
                         "reason": reason.group(1).strip() if reason else "?"}
    return {"validated_on_htp": passed, "refused": failed, "first_unsupported": first}


def compile_on_npu(graph: Path, provider_options: dict, free_dims: dict | None = None,
                   config: dict | None = None, timeout: float = 1800) -> dict:
    """Compile `graph` on the HTP in a child process; returns a report dict (never raises on refusal)."""
    cmd = [sys.executable, "-m", "hybrid_npu.export.npu.check", str(graph), "--options", json.dumps(provider_options),
           "--free-dims", json.dumps(free_dims or {}), "--config", json.dumps(config or {}),
           "--parent", parent_token()]  # the compile ends with us, however we end
    report = {"graph": Path(graph).name, "nodes": len(onnx.load(str(graph), load_external_data=False).graph.node)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # reported like a refusal: the other graphs still get checked
        return {**report, "ok": False, "on_htp": 0, "first_unsupported": None, "refused": 0,
                "error": f"the HTP compile did not finish in {timeout:.0f} s"}
    tail = proc.stdout.strip().splitlines()
    result = json.loads(tail[-1]) if tail and tail[-1].startswith("{") else {"ok": False, "error": proc.stderr[-500:]}
    report.update(result)
    report.update(_parse_validation(proc.stderr))
    # success: every node is on the HTP (fallback was disabled); refusal: the validation's count
    report["on_htp"] = report["nodes"] if report.get("ok") else report["validated_on_htp"]
    report.pop("validated_on_htp")
    return report


def _worker(argv) -> int:
    import argparse

    import onnxruntime as ort
    import psutil

    from hybrid_npu.runtime.for_export import NpuUnavailable, qnn_session_options

    ap = argparse.ArgumentParser()
    ap.add_argument("graph")
    ap.add_argument("--options", required=True)
    ap.add_argument("--free-dims", default="{}")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--parent", help="pid:start-ms of the export that started us: end when it ends")
    args = ap.parse_args(argv)
    if args.parent:
        exit_with_parent(args.parent)
    try:
        so = qnn_session_options(json.loads(args.options), json.loads(args.free_dims), json.loads(args.config))
    except NpuUnavailable as e:
        print(json.dumps({"ok": False, "error": str(e), "npu_unavailable": True}))
        return 0
    so.log_severity_level = 0  # the EP's per-node validation lines are the placement report
    t0 = time.perf_counter()
    try:
        ort.InferenceSession(args.graph, so)
        ok, error = True, None
    except Exception as e:  # refusal: reported, not raised
        ok, error = False, str(e).splitlines()[0][:300]
    print(json.dumps({"ok": ok, "error": error, "compile_s": round(time.perf_counter() - t0, 2),
                      "peak_rss_gb": round(psutil.Process().memory_info().rss / 1e9, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
