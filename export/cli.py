"""export-hybrid SRC OUT: a Hugging Face Qwen3.5 checkpoint → an ONNX export directory.

    export-hybrid SRC OUT [--profile P] [--chunk C] [--dtype fp32|fp16] [--force]
                          [--weights int8|int4 [--block-size 32] [--asymmetric] [--head-bits 8|4]]
                          [--calibration TEXT_FILE | --npu-quant nbits]   (quantised + NPU profile)
                          [--drafter mtp|DIR [--drafter-weights float|int8|int4]]
    export-hybrid --check-npu OUT --profile P      (prove every NPU graph places on the HTP)

Progress goes to stderr (--quiet: none); stdout gets the closing table and, last, the parity line
("parity: ok (...)"; a mismatch exits 1 and writes nothing; --no-parity skips the check).
"""
from __future__ import annotations

import json
import sys
import time

from hybrid_npu.cli_common import OneLineParser, byte_size, path_arg
from hybrid_npu.errors import UserError
from hybrid_npu.format import DEFAULT_KV_CACHE, KV_CACHES


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="export-hybrid", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p) -> None:
    """export-hybrid's arguments; `optimum-cli export hybrid-npu` offers the same (optimum_plugin.py)."""
    p.add_argument("source", nargs="?", type=path_arg, help="local Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("output", nargs="?", type=path_arg, help="directory to write the export into")
    p.add_argument("--profile", type=path_arg, help="device profile name or TOML path: also write its NPU graph parts and "
                                     "precompiled QNN context binaries")
    p.add_argument("--no-compile", action="store_true", help="with --profile: skip the QNN context binaries")
    p.add_argument("--chunk", type=int, help="prefill chunk: tokens per prefill call (default: the profile's, or 128)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"],
                   help="stored weight dtype (fp16 halves the files; compute stays fp32)")
    p.add_argument("--kv-cache", default=DEFAULT_KV_CACHE, choices=list(KV_CACHES),
                   help="the K/V cache's dtype (default fp16: half of fp32's memory per context token; fp32: the graphs "
                        "equal transformers at fp32; int8: a quarter, CPU only, rows rounded to 8 bits; docs/kv-cache.md)")
    p.add_argument("--weights", choices=["float", "int8", "int4"],
                   help="int8/int4: quantise every linear layer (CPU: block-wise MatMulNBits; with an NPU "
                        "--profile also the NPU graphs, see --calibration; default float)")
    p.add_argument("--block-size", type=int, help="with --weights: weights per quantisation block (default 32)")
    p.add_argument("--asymmetric", action="store_true", help="with --weights: a zero point per block")
    p.add_argument("--head-bits", type=int, choices=[8, 4],
                   help="with --weights: the lm_head's bits (default 8; 4 halves the largest single matrix)")
    p.add_argument("--calibration", metavar="FILE", type=path_arg,
                   help="with --weights and an NPU --profile: UTF-8 text the NPU graphs' activation ranges are "
                        "measured on (w8a16/w4a16 QDQ; the first 4096 tokens are used)")
    p.add_argument("--npu-quant", choices=["qdq", "nbits"],
                   help="with --weights and an NPU --profile: qdq (default; needs --calibration) or nbits (the "
                        "CPU's MatMulNBits weights on the HTP, fp16 activations, no calibration)")
    p.add_argument("--drafter", type=path_arg, help="mtp: the checkpoint's own MTP head (mtp.* tensors) drafts; or an EAGLE-3 "
                                     "drafter checkpoint directory (official/SpecForge or speculators layout) to "
                                     "export beside the model; speculation is then on by default")
    p.add_argument("--drafter-weights", choices=["float", "int8", "int4"],
                   help="with --drafter: the drafter's weights (default: as --weights). A drafter only "
                        "proposes, so int8 drafts faster with the output unchanged, even beside a float model")
    p.add_argument("--mtp-vocab", type=int, metavar="N",
                   help="with --drafter mtp: the head drafts only the N most frequent tokens (a draft step's "
                        "head product N/V the size; lossless, the target verifies). Default (or 0): all "
                        "of them. Give --mtp-vocab-text too: without it the lowest ids are kept, which "
                        "favour English and code")
    p.add_argument("--mtp-vocab-text", metavar="FILE", type=path_arg,
                   help="with --mtp-vocab: count token frequencies over this UTF-8 text (default: the "
                        "tokenizer's merge order)")
    p.add_argument("--verify", type=int, help="tree-verify graph size in tokens (default: the profile's, or 32)")
    p.add_argument("--force", action="store_true",
                   help="also replace an output directory holding a damaged or older export (a directory that is "
                        "not an export, or holds the source, is never replaced)")
    p.add_argument("--check-npu", metavar="EXPORT", type=path_arg, help="compile EXPORT's NPU graphs for --profile with CPU fallback "
                                                         "disabled and report placement per graph")
    p.add_argument("--json", action="store_true", help="with --check-npu: print the report as JSON")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="refused: the NPU prefill reads any context in attention tiles, so only memory bounds the "
                        "context (see --max-context-memory)")
    p.add_argument("--max-context-memory", metavar="SIZE", type=byte_size,
                   help="memory (e.g. 8G) for the closing table's largest context (default: available memory now)")
    p.add_argument("--no-parity", action="store_true",
                   help="skip the closing check against the source weights and between prefill and decode")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _check_npu(args, say) -> int:
    from hybrid_npu.export.npu.report import check_export

    if not args.profile:
        raise UserError("--check-npu needs --profile (e.g. --profile snapdragon-x-elite)")
    reports = check_export(args.check_npu, args.profile, say)
    if args.json:
        print(json.dumps(reports, indent=1))
    else:
        for r in reports:
            status = "all on HTP" if r.get("ok") else "NOT all on HTP"
            line = f"{r['graph']}: {r['nodes']} nodes, {r['on_htp']} on HTP ({status})"
            if r.get("first_unsupported"):
                f = r["first_unsupported"]
                line += f"; first unsupported: {f['op']} {f['node']}: {f['reason']}"
            elif not r.get("ok"):
                line += f"; {r.get('error')}"
            print(line)
    return 0 if all(r.get("ok") for r in reports) else 1


def _parity(export_dir, manifest: dict, reports: list) -> None:
    from hybrid_npu.export.parity import ParityError, check_parity

    report = check_parity(export_dir, manifest)
    reports.append(report)
    if report.problems:
        raise ParityError(report.line())


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag, already reported in one line (2)
        return int(e.code or 0)
    return run(args)


def run(args, prog: str = "export-hybrid") -> int:
    """Export (or --check-npu) from parsed arguments; the exit code. prog names us in messages."""
    from hybrid_npu.export.exporter import export
    from hybrid_npu.export.options import ExportOptions
    from hybrid_npu.export.parity import ParityError
    from hybrid_npu.export.summary import summary_lines

    t0 = time.perf_counter()
    say = (lambda m: None) if args.quiet else (lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}",
                                                               file=sys.stderr, flush=True))
    parity: list = []  # the report of the check run inside export(), before the export is moved into place
    try:
        if args.check_npu:
            return _check_npu(args, say)
        if not args.source or not args.output:
            raise UserError("give SOURCE and OUTPUT directories (or --check-npu EXPORT --profile P)")
        manifest = export(args.source, args.output, ExportOptions.from_args(args), force=args.force, progress=say,
                          check=None if args.no_parity else lambda d, m: _parity(d, m, parity),
                          warn=lambda m: print(f"{prog}: warning: {m}", file=sys.stderr, flush=True))
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except ParityError as e:
        print(f"{prog}: {e}; nothing was written to {args.output}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing was written", file=sys.stderr)
        return 130
    print("\n".join(summary_lines(args.output, manifest, args.max_context_memory)))
    if parity:
        print(parity[0].line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
