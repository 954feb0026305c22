"""export-hybrid SRC OUT: a Hugging Face Qwen3.5 checkpoint → an ONNX export directory.

    export-hybrid SRC OUT [--profile P] [--chunk C] [--dtype fp32|fp16] [--force]
    export-hybrid --check-npu OUT --profile P      (prove every NPU graph places on the HTP)
"""
from __future__ import annotations

import json
import sys
import time

from hybrid_npu.cli_common import OneLineParser
from hybrid_npu.errors import UserError


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="export-hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="local Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("output", nargs="?", help="directory to write the export into")
    p.add_argument("--profile", help="device profile name or TOML path: also write its NPU graph parts and "
                                     "precompiled QNN context binaries")
    p.add_argument("--no-compile", action="store_true", help="with --profile: skip the QNN context binaries")
    p.add_argument("--chunk", type=int, help="prefill chunk: tokens per prefill call (default: the profile's, or 128)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"],
                   help="stored weight dtype (fp16 halves the files; compute stays fp32)")
    p.add_argument("--drafter", help="an EAGLE-3 drafter checkpoint directory (official/SpecForge or speculators "
                                     "layout) to export beside the model; speculation is then on by default")
    p.add_argument("--verify", type=int, help="tree-verify graph size in tokens (default: the profile's, or 32)")
    p.add_argument("--force", action="store_true", help="replace an output directory that is not an export")
    p.add_argument("--check-npu", metavar="EXPORT", help="compile EXPORT's NPU graphs for --profile with CPU fallback "
                                                         "disabled and report placement per graph")
    p.add_argument("--json", action="store_true", help="with --check-npu: print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _check_npu(args) -> int:
    from hybrid_npu.export.npu_report import check_export

    if not args.profile:
        raise UserError("--check-npu needs --profile (e.g. --profile snapdragon-x-elite)")
    reports = check_export(args.check_npu, args.profile)
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
        if args.check_npu:
            return _check_npu(args)
        if not args.source or not args.output:
            raise UserError("give SOURCE and OUTPUT directories (or --check-npu EXPORT --profile P)")
        manifest = export(args.source, args.output, chunk=args.chunk, dtype=args.dtype, force=args.force,
                          profile=args.profile, compile_context=not args.no_compile, verify=args.verify,
                          drafter=args.drafter, progress=say)
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
    if manifest.get("drafter"):
        print(f"EAGLE-3 drafter exported to {args.output}/{manifest['drafter']['dir']}")
    for name, npu in manifest["npu"].items():
        ctx = "precompiled" if npu["context"] else "compiled on first load"
        print(f"NPU profile {name}: {len(npu['parts'])} part(s) {[p['layers'] for p in npu['parts']]}, context {ctx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
