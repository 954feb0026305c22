"""export-hybrid SRC OUT: a Hugging Face Qwen3.5 checkpoint → an ONNX export directory."""
from __future__ import annotations

import sys
import time

from hybrid_npu.cli_common import OneLineParser
from hybrid_npu.errors import UserError


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="export-hybrid", description=__doc__)
    p.add_argument("source", help="local Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("output", help="directory to write the export into")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk: tokens per prefill call (default 128)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"],
                   help="stored weight dtype (fp16 halves the files; compute stays fp32)")
    p.add_argument("--force", action="store_true", help="replace an output directory that is not an export")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p




def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag, already reported in one line (2)
        return int(e.code or 0)
    from hybrid_npu.export.exporter import export

    t0 = time.perf_counter()
    say = (lambda m: None) if args.quiet else (lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    try:
        manifest = export(args.source, args.output, chunk=args.chunk, dtype=args.dtype, force=args.force, progress=say)
    except UserError as e:
        print(f"export-hybrid: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("export-hybrid: interrupted; nothing was written", file=sys.stderr)
        return 130
    cfg = manifest["config"]
    print(f"exported {len(cfg['layer_types'])} layers ({cfg['layer_types'].count('linear_attention')} GDN) to "
          f"{args.output}: weights {manifest['weights']['bytes'] / 1e6:.1f} MB, state "
          f"{manifest['state']['state_bytes'] / 1024:.1f} KiB fixed + {manifest['state']['kv_bytes_per_token']} B/token KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
