"""Record the integrity entry (sizes + sha256 of every file, src/hybrid_npu/integrity.py) in an export
made before export-hybrid wrote one, e.g. the embedded default model. Rewrites only model.json.

    python scripts/train/add_integrity.py EXPORT_DIR [--replace]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybrid_npu import integrity
from hybrid_npu.format import MANIFEST
from hybrid_npu.manifest import is_export


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--replace", action="store_true", help="recompute an existing entry (after editing files)")
    a = ap.parse_args()
    if not is_export(a.export_dir):
        print(f"{a.export_dir} is not a hybrid-npu export", file=sys.stderr)
        return 2
    mf = a.export_dir / MANIFEST
    manifest = json.loads(mf.read_text())
    if "integrity" in manifest and not a.replace:
        print(f"{mf} already has an integrity entry (--replace recomputes it)", file=sys.stderr)
        return 2
    manifest["integrity"] = integrity.record(a.export_dir)
    mf.write_text(json.dumps(manifest, indent=1))
    print(f"{mf}: {len(manifest['integrity']['files'])} files recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
