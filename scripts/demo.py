"""The main job end to end on a machine with nothing downloaded: build a tiny random Qwen3.5
checkpoint offline (transformers, the test suite's fixture builder), export it with
export-hybrid, and generate with the ONNX runtime. Replaced by the embedded default model once
that ships (its own issue).

    python scripts/demo.py [--workdir DIR] [--prompt TEXT]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hybrid-npu-demo")
    ap.add_argument("--prompt", default="The quick brown fox")
    args = ap.parse_args()

    import fixtures  # tiny random checkpoint builder (transformers, offline)

    import hybrid_npu

    src, out = args.workdir / "checkpoint", args.workdir / "export"
    fixtures.write_release_checkpoint(src, seed=0, tie=True, with_mtp=True)
    exe = Path(sysconfig.get_path("scripts")) / "export-hybrid"
    subprocess.run([str(exe), str(src), str(out), "--chunk", "16"], check=True)
    engine = hybrid_npu.load(out)
    ids = engine.tokenizer.encode(args.prompt).ids
    new = engine.generate(ids, max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    print("prompt:", args.prompt)
    print("output (random weights, so gibberish):", engine.tokenizer.decode(new))
    print(json.dumps(engine.last_stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
