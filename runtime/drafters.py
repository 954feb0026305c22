"""Which drafter an export speculates with, and opening it: the one factory the engine calls.

An export records its default drafter in model.json (`drafter`: dir and kind) and every drafter it
ships in `drafters` ({kind: dir}); a drafter directory's drafter.json says its kind ("eagle3" when
absent: exports made before MTP). The engine's `drafter=` argument chooses:
  None            the export's default drafter (its `drafter/` in older exports), if any
  "eagle3"/"mtp"  the export's drafter of that kind
  a directory     that exported drafter
  an object       used as is (anything with reset/observe/propose)
"""
from __future__ import annotations

import json
from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_DIR, DRAFTER_MANIFEST, EAGLE3_KIND as EAGLE3, MTP_KIND as MTP

KINDS = (EAGLE3, MTP)


def drafter_kind(d: Path) -> str:
    return json.loads((d / DRAFTER_MANIFEST).read_text(encoding="utf-8")).get("kind", EAGLE3)


def choose_drafter_dir(export: Path, manifest: dict, choice):
    """The drafter directory `choice` names for this export (None: it has none)."""
    shipped = dict(manifest.get("drafters") or {})
    default = manifest.get("drafter") or {}
    if default.get("dir"):
        shipped.setdefault(default.get("kind", EAGLE3), default["dir"])
    if choice is None:
        own = export / default.get("dir", DRAFTER_DIR)
        return own if (own / DRAFTER_MANIFEST).exists() else None
    if isinstance(choice, str) and choice in KINDS and not Path(choice).is_dir():
        if choice not in shipped:
            have = ", ".join(sorted(shipped)) or "none"
            raise UserError(f"{export} ships no {choice} drafter (it has: {have}); export one with: "
                            f"export-hybrid SOURCE {export} --drafter " + ("mtp" if choice == MTP else "DIR"))
        return export / shipped[choice]
    return Path(choice)


def load_drafter(d: Path, threads: int | None = None):
    """Open the exported drafter in directory d by the kind its drafter.json records."""
    kind = drafter_kind(d)
    if kind == MTP:
        from .mtp import MtpDrafter
        return MtpDrafter(d, threads)
    if kind == EAGLE3:
        from .eagle3 import Eagle3Drafter
        return Eagle3Drafter(d, threads)
    raise UserError(f"{d / DRAFTER_MANIFEST}: drafter kind {kind!r} is not one of {', '.join(KINDS)}; "
                    "a newer hybrid-npu exported it")
