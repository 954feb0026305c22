"""The residual magnitude the NPU path survives: tiny random checkpoints whose residual stream
carries one channel at a planted magnitude (every embedding row, as in issue 16's measurement,
or only a few outlier tokens), NPU prefill on onnxruntime-qnn's HTP emulator (fp16, CPU fallback
off) against fp32 transformers; prints JSON (relative max logit error per magnitude and the
largest magnitude within 5%).

    python scripts/npu_ceiling.py [--magnitudes 200,1200,...] [--out scripts/results/npu_ceiling.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)

CHUNK = 8
DEFAULT = "100,200,300,500,800,1200,2000,5000,10000,20000,40000,60000"


def htp_profile(tmp: Path) -> str:
    from hybrid_npu.profiles.loader import load_profile

    text = load_profile("snapdragon-x-elite").source.read_text()
    for key, value in (("name", '"ceiling-htp"'), ("attention_capacity", "96"), ("graph_finalization", "1"),
                       ("prefill_chunk", str(CHUNK))):
        text = re.sub(rf"(?m)^{key}\s*=\s*\S+", f"{key} = {value}", text)
    path = tmp / "ceiling-htp.toml"
    path.write_text(text)
    return str(path)


def measure(magnitude: float, mode: str, tmp: Path, profile: str, prompt_len: int) -> dict:
    import torch
    from outlier_fixtures import outlier_prompt, write_outlier_checkpoint

    import hybrid_npu
    from hybrid_npu.export.exporter import export

    d = tmp / f"{mode}-{magnitude:g}"
    from outlier_fixtures import OUTLIER_TOKENS
    tokens = None if mode == "every_token" else OUTLIER_TOKENS
    model = write_outlier_checkpoint(d / "hf", planted=((30, magnitude),), tokens=tokens)
    export(d / "hf", d / "export", chunk=CHUNK, check=lambda *_: None)
    ids = outlier_prompt(prompt_len)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    ref = out.logits[0, -1].numpy().astype(np.float64)
    residual = max(float(h.abs().max()) for h in out.hidden_states)
    t0 = time.perf_counter()
    engine = hybrid_npu.load(d / "export", profile=profile, prefill="npu")
    npu = engine.prefill_logits(ids).astype(np.float64)
    cpu = hybrid_npu.load(d / "export").prefill_logits(ids).astype(np.float64)
    scale = float(np.abs(ref).max())
    return {"magnitude": magnitude, "mode": mode, "max_residual": round(residual, 1),
            "npu_device": engine.last_stats["prefill_device"],
            "npu_rel_max_logit_error": float(np.abs(npu - ref).max() / scale) if np.isfinite(npu).all() else None,
            "cpu_rel_max_logit_error": float(np.abs(cpu - ref).max() / scale),
            "npu_finite": bool(np.isfinite(npu).all()), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--magnitudes", default=DEFAULT)
    ap.add_argument("--modes", default="every_token,outlier_tokens")
    ap.add_argument("--prompt", type=int, default=3 * CHUNK + 5)
    ap.add_argument("--label", default="", help="recorded in the JSON (e.g. which norm formulation)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        profile = htp_profile(tmp)
        for mode in a.modes.split(","):
            for m in (float(x) for x in a.magnitudes.split(",")):
                rows.append(measure(m, mode, tmp, profile, a.prompt))
                print(json.dumps(rows[-1]), file=sys.stderr)
    ceiling = {}
    for mode in a.modes.split(","):
        ok = [r["magnitude"] for r in rows if r["mode"] == mode and r["npu_rel_max_logit_error"] is not None
              and r["npu_rel_max_logit_error"] <= 0.05]
        bad = [r["magnitude"] for r in rows if r["mode"] == mode and r["magnitude"] not in ok]
        # the ceiling: the largest magnitude below the first failure
        first_bad = min(bad) if bad else None
        ceiling[mode] = max([m for m in ok if first_bad is None or m < first_bad], default=None)
    result = {"label": a.label, "emulator": "onnxruntime-qnn HTP x86_64 emulator, fp16, CPU fallback off",
              "fixture": "tests/outlier_fixtures.py: 6 layers, H=48, untied head, channel 30 planted",
              "prompt_tokens": a.prompt, "chunk": CHUNK, "criterion": "relative max logit error <= 0.05",
              "ceiling": ceiling, "rows": rows}
    bench_json.emit(result, a.out)


if __name__ == "__main__":
    main()
