"""Accuracy of quantised exports on a trained model: held-out perplexity of the float, int8 and
int4 exports (our runtime, decode graph, teacher-forced) and their top-1 agreement with float.

    python scripts/eval_quantized.py TARGET_CHECKPOINT [--positions 2048] [--out JSON]

Held-out text: the held-out code documents of scripts/stdlib_corpus.py, in windows of --window
tokens (each window from a fresh state), until --positions predictions are scored.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402

MODES = {"fp32": {}, "int8": {"weights": "int8"}, "int4": {"weights": "int4"}}


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


def score(engine, wins) -> tuple[float, list[int]]:
    nll, argmax = 0.0, []
    for w in wins:
        engine.reset()
        for tok, nxt in zip(w[:-1], w[1:]):
            logits = engine._step("decode", [tok]).astype(np.float64)
            m = logits.max()
            nll += m + math.log(np.exp(logits - m).sum()) - logits[nxt]
            argmax.append(int(logits.argmax()))
    return nll / len(argmax), argmax


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.export.exporter import export

    result = {"target": str(args.target), "positions": args.positions, "window": args.window, "modes": {}}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for mode, kw in MODES.items():
            out = Path(tmp) / mode
            manifest = export(args.target, out, **kw)
            engine = hybrid_npu.load(out, threads=args.threads)
            wins = windows(engine.tokenizer, args.positions, args.window)
            mean_nll, top1 = score(engine, wins)
            row = {"perplexity": round(math.exp(mean_nll), 3), "weights_bytes": manifest["weights"]["bytes"]}
            if reference is None:
                reference = (mean_nll, top1)
            else:
                row["top1_agreement_with_fp32"] = round(float(np.mean(np.array(top1) == np.array(reference[1]))), 4)
                row["perplexity_vs_fp32"] = round(math.exp(mean_nll - reference[0]), 4)
            result["modes"][mode] = row
            print(mode, row, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
