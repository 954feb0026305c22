"""Accuracy of quantised exports on a trained model: held-out perplexity of the float, int8 and
int4 exports (our runtime, decode graph, teacher-forced) and their top-1 agreement with float.

    python scripts/bench/eval_quantized.py TARGET_CHECKPOINT [--positions 2048] [--htp] [--out JSON]

Held-out text: the held-out code documents of scripts/train/stdlib_corpus.py, in windows of --window
tokens (each window from a fresh state), until --positions predictions are scored.

--htp adds the NPU rows, run on onnxruntime-qnn's HTP emulator with CPU fallback off: the
float graphs in fp16, QDQ w8a16 and w4a16 (calibrated on the corpus' training documents, never
the held-out ones), and MatMulNBits int8/int4 on the HTP. They are scored through the NPU
tree-verify parts fed chain-shaped trees of --tree tokens (the one NPU graph with logits for every
token), at the same positions as the CPU rows; top-1 agreement is with the CPU fp32 row.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # stdlib_corpus: the corpus the trainers use
import stdlib_corpus  # noqa: E402
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)

MODES = {"fp32": {}, "int8": {"weights": "int8"}, "int4": {"weights": "int4"},
         "int4-head4": {"weights": "int4", "head_bits": 4},
         # larger blocks: fewer scales, a smaller prepacked copy in memory (README, memory)
         "int4-head4-b64": {"weights": "int4", "head_bits": 4, "block_size": 64},
         "int4-head4-b128": {"weights": "int4", "head_bits": 4, "block_size": 128},
         "int8-b128": {"weights": "int8", "block_size": 128}}
HTP_MODES = {"htp-fp16": {}, "htp-qdq-w8a16": {"weights": "int8", "calibration": True},
             "htp-qdq-w4a16": {"weights": "int4", "calibration": True},
             "htp-nbits-int8": {"weights": "int8", "npu_quant": "nbits"},
             "htp-nbits-int4": {"weights": "int4", "npu_quant": "nbits"}}


def windows(tokenizer, positions: int, window: int) -> list[list[int]]:
    docs = sorted((d for d in stdlib_corpus.documents() if d.held_out and d.kind == "code"), key=lambda d: d.name)
    out, scored = [], 0
    for d in docs:
        ids = tokenizer.encode(d.text).ids
        for s in range(0, len(ids) - 1, window):
            w = ids[s: s + window + 1]
            if len(w) < 2 or scored >= positions:
                continue
            w = w[: positions - scored + 1]
            out.append(w)
            scored += len(w) - 1
    return out


def nll(logits: np.ndarray, target: int) -> float:
    """-log softmax(logits)[target], in float64."""
    row = logits.astype(np.float64)
    m = row.max()
    return m + math.log(np.exp(row - m).sum()) - row[target]


def score(engine, wins) -> tuple[float, list[int]]:
    total, argmax = 0.0, []
    for w in wins:
        engine.reset()
        for tok, nxt in zip(w[:-1], w[1:]):
            logits = engine.step("decode", [tok])
            total += nll(logits, nxt)
            argmax.append(int(logits.argmax()))
    return total / len(argmax), argmax


def score_htp(path: Path, profile, wins) -> tuple[float, list[int]]:
    """Teacher-forced through the NPU verify parts: each window in chain-shaped trees from a fresh
    state of exactly T_max K/V rows (the shape the HTP graphs were compiled for)."""
    from hybrid_npu.export.npu.qdq import calibration_steps
    from hybrid_npu.runtime.npu_sessions import open_npu_pipeline

    from hybrid_npu.manifest import load_manifest

    manifest = load_manifest(path)
    cfg, n = manifest.model_config, manifest.verify.n
    pipe = open_npu_pipeline(path, manifest, profile, "verify")
    total, argmax = 0.0, []
    for w in wins:
        inputs, targets = w[:-1], w[1:]
        for s, (feed, commit) in zip(range(0, len(inputs), n),
                                     calibration_steps(cfg, inputs, n, True, profile.attention_capacity)):
            out = pipe.run(feed)
            commit(out)
            for row, nxt in zip(out["logits"][: len(inputs[s: s + n])], targets[s: s + n]):
                total += nll(row, nxt)
                argmax.append(int(row.argmax()))
    return total / len(argmax), argmax


def htp_profile(tmp: Path, window: int, tree: int):
    """The X Elite profile, verifying on the NPU with --tree nodes, T_max just over a window,
    finalization mode 1 (compiles faster; docs/htp-traps.md). Written as a profile file
    because the exporter takes a profile name or path."""
    import dataclasses

    from hybrid_npu.profiles.loader import dumps, load_profile

    base = load_profile("snapdragon-x-elite")
    prof = dataclasses.replace(base, name="eval-htp", verify_device="npu", verify_tree_size=tree,
                               attention_capacity=-(-(window + tree) // 128) * 128,
                               npu=dataclasses.replace(base.npu, graph_finalization=1))
    path = tmp / "eval-htp.toml"
    path.write_text(dumps(prof.to_dict()), encoding="utf-8")
    return load_profile(str(path))


def calibration_file(tmp: Path, chars: int = 200_000) -> Path:
    docs = sorted((d for d in stdlib_corpus.documents() if not d.held_out and d.kind == "code"), key=lambda d: d.name)
    path = tmp / "calibration.txt"
    path.write_text("\n\n".join(d.text for d in docs)[:chars], encoding="utf-8")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--htp", action="store_true", help="also the NPU rows, on the HTP emulator (slow)")
    ap.add_argument("--tree", type=int, default=32, help="verify tree size of the NPU rows")
    ap.add_argument("--only-htp", action="store_true", help="skip the CPU int8/int4 rows (fp32 is the reference)")
    ap.add_argument("--modes", help="comma-separated rows to run (fp32, the reference, always runs)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.export.exporter import export

    result = {"target": str(args.target), "positions": args.positions, "window": args.window, "modes": {}}
    reference = None
    modes = {"fp32": {}} if args.only_htp else dict(MODES)
    if args.htp or args.only_htp:
        modes.update(HTP_MODES)
    if args.modes:
        wanted = set(args.modes.split(","))
        unknown = wanted - set(MODES) - set(HTP_MODES)
        if unknown:
            ap.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join([*MODES, *HTP_MODES])}")
        modes = {m: kw for m, kw in {**MODES, **HTP_MODES}.items() if m == "fp32" or m in wanted}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prof = htp_profile(tmp, args.window, args.tree) if any(m.startswith("htp-") for m in modes) else None
        for mode, kw in modes.items():
            out = tmp / mode
            if mode.startswith("htp-"):
                kw = dict(kw, profile=str(prof.source), verify=args.tree, compile_context=False, dtype="fp16")
                if kw.pop("calibration", False):
                    kw["calibration"] = calibration_file(tmp)
                result.setdefault("htp_profile", prof.to_dict())
            manifest = export(args.target, out, **kw)
            engine = hybrid_npu.load_engine(out, threads=args.threads, prefill="cpu")
            wins = windows(engine.tokenizer, args.positions, args.window)
            mean_nll, top1 = score_htp(out, prof, wins) if mode.startswith("htp-") else score(engine, wins)
            row = {"perplexity": round(math.exp(mean_nll), 3), "weights_bytes": manifest["weights"]["bytes"]}
            if mode.startswith("htp-"):
                row["npu_weights"] = {k: v for k, v in manifest["npu"][prof.name]["weights"].items() if k != "float"}
                qdq_data = list((out / "graphs").glob("*.onnx.data"))  # QDQ parts carry their own weights
                row["npu_weights_bytes"] = sum(f.stat().st_size for f in qdq_data) or row["weights_bytes"]
            if reference is None:
                reference = (mean_nll, top1)
            else:
                row["top1_agreement_with_fp32"] = round(float(np.mean(np.array(top1) == np.array(reference[1]))), 4)
                row["perplexity_vs_fp32"] = round(math.exp(mean_nll - reference[0]), 4)
            result["modes"][mode] = row
            print(mode, row, flush=True)
    harness.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
