"""What a drafter is (the `Drafter` protocol and its optional capabilities, checked once when the
engine is given one), which drafter an export speculates with, and opening it: the one factory the
engine calls.

An export records its default drafter in model.json (`drafter`: dir and kind) and every drafter it
ships in `drafters` ({kind: dir}); a drafter directory's drafter.json says its kind ("eagle3" when
absent: exports made before MTP). Both are read through hybrid_npu.manifest. The engine's
`drafter=` argument chooses:
  None            the export's default drafter (its `drafter/` in older exports), if any
  "eagle3"/"mtp"  the export's drafter of that kind
  a directory     that exported drafter
  an object       used as is (a Drafter: reset/observe/propose)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_MANIFEST, EAGLE3_KIND as EAGLE3, MTP_KIND as MTP
from hybrid_npu.manifest import Manifest, load_drafter_manifest

KINDS = (EAGLE3, MTP)


@runtime_checkable
class Drafter(Protocol):
    """What speculation needs of a drafter. observe(tokens, features) takes (token, the target's taps
    at the position before it) pairs; propose(root, top_k, depth, total_tokens) returns a draft tree
    as (tokens, parent index of each, -1: the root)."""
    def reset(self) -> None: ...
    def observe(self, tokens, features, *args, **kwargs): ...
    def propose(self, root_token: int, top_k: int, depth: int, total_tokens: int, *args, **kwargs): ...


@runtime_checkable
class Rewinds(Protocol):
    """Goes back to an earlier length (a turn checkpoint) instead of starting over."""
    length: int
    def rewind(self, length: int) -> None: ...


@runtime_checkable
class Guesses(Protocol):
    """Says the token it expects next (the speculation policy scores its guesses)."""
    def guess(self) -> int | None: ...


@runtime_checkable
class Skips(Protocol):
    """Reads only the last context_rows pairs: older ones are skipped, not observed."""
    context_rows: int | None
    def skip(self, n: int) -> None: ...


@runtime_checkable
class Picks(Protocol):
    """picks True: propose takes pick= (a sampled reply's chain picks by the sampler's noise)."""
    picks: bool


@runtime_checkable
class ReadsTaps(Protocol):
    """Reads these target tap layers, concatenated in this order (else the target's tap layers)."""
    input_order: tuple


@dataclass(frozen=True)
class DrafterCaps:
    """A drafter's optional capabilities, found once when the engine is given it."""
    rewinds: bool = False
    guesses: bool = False
    skips: bool = False
    picks: bool = False
    input_order: tuple | None = None

    @classmethod
    def of(cls, drafter) -> "DrafterCaps":
        if not isinstance(drafter, Drafter):
            missing = [m for m in ("reset", "observe", "propose") if not callable(getattr(drafter, m, None))]
            raise UserError(f"drafter={type(drafter).__name__} has no {', '.join(missing)}; give None, \"eagle3\", "
                            "\"mtp\", an exported drafter directory, or an object with reset/observe/propose")
        return cls(rewinds=isinstance(drafter, Rewinds), guesses=isinstance(drafter, Guesses),
                   skips=isinstance(drafter, Skips), picks=isinstance(drafter, Picks) and drafter.picks is True,
                   input_order=tuple(drafter.input_order) if isinstance(drafter, ReadsTaps) else None)


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
