"""GGUFs of the random Qwen3.5-0.8B-config checkpoint bench_cpu.py exports, for llama-bench side by side.

Converts with the llama.cpp tree's own convert_hf_to_gguf.py (run with its gguf-py on PYTHONPATH)
to F16 (--no-mtp: the random checkpoint has no MTP layers), then quantises that with llama-quantize to each of --types. Nothing of llama.cpp is part
of this project: the tree, the binaries and the GGUFs are paths given here. The checkpoint has no
tokenizer of its own, so --tokenizer names a directory with a Qwen3.5 tokenizer.json (and
tokenizer_config.json); llama-bench feeds random token ids, so only the vocabulary size matters.

    python scripts/bench/make_gguf.py --llama-cpp TREE --llama-quantize BIN --tokenizer DIR
                                [--workdir /tmp/hybrid-npu-bench] [--types Q8_0,Q4_0]
Prints the GGUF paths, one a line.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import make_random_checkpoint  # noqa: E402

from hybrid_npu.cli_common import OneLineParser  # noqa: E402


def conversion_source(src: Path, tokenizer: Path, out: Path) -> Path:
    """The checkpoint's files plus the tokenizer's, in one directory (links: the weights stay put)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in [*src.glob("*.json"), *src.glob("*.safetensors"), *tokenizer.glob("tokenizer*.json")]:
        link = out / f.name
        link.unlink(missing_ok=True)
        try:
            link.symlink_to(f.resolve())
        except OSError:  # no symlinks (Windows without developer mode): copy
            shutil.copy(f, link)
    return out


def main() -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-quantize", type=Path, required=True, help="the llama-quantize binary")
    ap.add_argument("--tokenizer", type=Path, required=True, help="directory with a Qwen3.5 tokenizer.json")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--types", default="Q8_0,Q4_0", help="llama-quantize types made from the F16")
    args = ap.parse_args()
    convert = args.llama_cpp / "convert_hf_to_gguf.py"
    if not convert.is_file():
        ap.error(f"{convert} not found: give --llama-cpp a llama.cpp source tree")
    if not args.llama_quantize.is_file():
        ap.error(f"{args.llama_quantize} not found: build llama.cpp's llama-quantize target and give its path")
    if not (args.tokenizer / "tokenizer.json").is_file():
        ap.error(f"no tokenizer.json in {args.tokenizer}: give --tokenizer a directory with a Qwen3.5 tokenizer")

    src = make_random_checkpoint("0.8B", args.workdir / "qwen35-0.8b-random")
    hf = conversion_source(src, args.tokenizer, args.workdir / "qwen35-0.8b-random-gguf-src")
    f16 = args.workdir / "qwen35-0.8b-random-F16.gguf"
    env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
    subprocess.run([sys.executable, str(convert), str(hf), "--outtype", "f16", "--outfile", str(f16),
                    "--no-mtp"],
                   check=True, env=env)
    made = [f16]
    for qtype in filter(None, args.types.split(",")):
        out = args.workdir / f"qwen35-0.8b-random-{qtype}.gguf"
        subprocess.run([str(args.llama_quantize), str(f16), str(out), qtype], check=True)
        made.append(out)
    print("\n".join(str(p) for p in made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
