"""Which drafter an export speculates with, and opening it: the one factory the engine calls.

An export records its default drafter in model.json (`drafter`: dir and kind) and every drafter it
ships in `drafters` ({kind: dir}); a drafter directory's drafter.json says its kind ("eagle3" when
absent: exports made before MTP). Both are read through hybrid_npu.manifest. The engine's
`drafter=` argument chooses:
  None            the export's default drafter (its `drafter/` in older exports), if any
  "eagle3"/"mtp"  the export's drafter of that kind
  a directory     that exported drafter
  an object       used as is (anything with reset/observe/propose)
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, EAGLE3_KIND as EAGLE3, MTP_KIND as MTP
from hybrid_npu.manifest import Manifest, load_drafter_manifest

KINDS = (EAGLE3, MTP)


def choose_drafter_dir(export: Path, manifest: Manifest, choice):
    """The drafter directory `choice` names for this export (None: it has none)."""
    shipped = manifest.drafter_dirs
    if choice is None:
        own = export / manifest.default_drafter_dir
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
    record = load_drafter_manifest(Path(d))  # checked once, or one UserError line
    kind = record.drafter_kind
    if kind == MTP:
        from .mtp import MtpDrafter
        return MtpDrafter(d, threads, record=record)
    if kind == EAGLE3:
        from .eagle3 import Eagle3Drafter
        return Eagle3Drafter(d, threads, record=record)
    raise UserError(f"{d / DRAFTER_MANIFEST}: drafter kind {kind!r} is not one of {', '.join(KINDS)}; "
                    "a newer hybrid-npu exported it")
