"""Where an export may be written, and the partial directories it is built in.

An export is built in a hidden sibling `.OUT.partial-XXXX` and renamed into place at the end. The
rules that keep a user's files safe:
* the output never equals or contains the source checkpoint (replacing it would delete the
  checkpoint), and inside the checkpoint only a valid export is ever replaced;
* an existing non-empty output is replaced only when it is one of our exports: a valid manifest
  always, a damaged or older manifest (model.json beside graphs/) with --force; a directory
  without model.json is never replaced, --force or not;
* and only when it holds nothing but what export-hybrid wrote: the files its manifest's integrity
  entry lists (and model.json), or, where that list cannot be read (a damaged manifest, an export
  from before hashes), files in an export's own places (graphs/, drafter/, mtp/, ctx/, the
  tokenizer files). Anything else there (a saved chat, notes) is refused in one line, --force
  or not: replacing the folder would delete it;
* each partial directory holds a marker naming the process that builds it; a partial whose
  process is gone (SIGKILL, OOM, power loss) is removed by the next export of that output.
  Directories without our marker are never touched.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

import psutil

from hybrid_npu.errors import UserError
from hybrid_npu.format import MANIFEST
from hybrid_npu.manifest import is_export, listed_files
from hybrid_npu.permissions import as_user_would_create

PARTIAL_MARKER = ".hybrid-npu-partial"
_MARKER_KIND = "hybrid-npu partial export"


def _ours_by_name(out: Path) -> bool:
    """A damaged or other-version export of ours: model.json beside graphs/ (what --force may replace)."""
    return (out / MANIFEST).is_file() and (out / "graphs").is_dir()


EXPORT_DIRS = ("graphs", "drafter", "mtp", "ctx")  # where an export writes, beside its top-level files
EXPORT_TOP = (MANIFEST, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "chat_template.json")


def _listed(out: Path) -> set[str] | None:
    """The files the export in `out` says it wrote (its integrity entry), or None when it cannot say."""
    return listed_files(out)


def foreign_files(out: Path) -> list[str]:
    """Files (and links) under `out` that export-hybrid did not write, as relative POSIX paths."""
    listed = _listed(out)
    found = []
    for root, dirs, files in os.walk(out):  # never follows a link to a directory: the link itself is foreign
        here = Path(root)
        links = [d for d in dirs if (here / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links]
        for name in [*files, *links]:
            rel = (here / name).relative_to(out).as_posix()
            ours = (rel in listed and not (here / name).is_symlink()) if listed is not None else \
                (rel in EXPORT_TOP or rel.split("/")[0] in EXPORT_DIRS)
            if not ours:
                found.append(rel)
    return sorted(found)


def _refuse_foreign(out: Path) -> None:
    foreign = foreign_files(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(f"output directory {out} holds {foreign[0]}{more}, which export-hybrid did not write; "
                        "replacing the export would delete it (even with --force): move it out, or choose "
                        "another output directory")


def check_output(src: Path, out: Path, force: bool) -> None:
    """Refuse (UserError) an output that would lose anything when replaced."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is a file; choose a directory path")
    s, o = src.resolve(), out.resolve()
    if o == s or o in s.parents:
        raise UserError(f"output {out} {'is' if o == s else 'contains'} the source checkpoint {src}; replacing it "
                        "would delete the checkpoint: choose an output directory outside it")
    if not out.exists() or not any(out.iterdir()):
        return
    if is_export(out):
        _refuse_foreign(out)
        return
    if s in o.parents:  # whatever else is in there may be part of the checkpoint
        raise UserError(f"output {out} is an existing directory inside the source checkpoint {src} and not a "
                        "valid export; refusing to replace it (even with --force): choose a directory outside it")
    if force and _ours_by_name(out):
        _refuse_foreign(out)
        return
    if _ours_by_name(out):
        raise UserError(f"output directory {out} holds a damaged or older hybrid-npu export; pass --force to "
                        "replace it, or choose another path")
    raise UserError(f"output directory {out} exists and is not a hybrid-npu export (no {MANIFEST}); refusing to "
                    "replace it (even with --force): choose a new or empty directory")


def _marker() -> dict:
    me = psutil.Process()
    return {"kind": _MARKER_KIND, "pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()}


def _stale(partial: Path) -> bool:
    """True for a partial export of ours whose builder process no longer runs on this host."""
    try:
        m = json.loads((partial / PARTIAL_MARKER).read_text(encoding="utf-8"))
        if m.get("kind") != _MARKER_KIND or m.get("host") != socket.gethostname():
            return False  # not ours, or another machine's (a shared disk): we cannot tell if it runs
        pid, started = int(m["pid"]), float(m["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        return abs(psutil.Process(pid).create_time() - started) > 1.0  # pid reused by another process
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def remove_stale_partials(out: Path, say: Callable[[str], None]) -> list[Path]:
    """Remove the partial directories of earlier exports of `out` that died; says what it removed."""
    removed = []
    try:
        candidates = sorted(out.parent.glob(f".{out.name}.partial-*"))
    except OSError:
        return removed
    for p in candidates:
        if p.is_dir() and not p.is_symlink() and _stale(p):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
                say(f"removed {p.name}: the partial output of an export that was killed ({size / 1e6:.1f} MB)")
    return removed


def make_partial(out: Path) -> Path:
    """A fresh hidden sibling of `out` to build the export in, marked as ours and as this process's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    as_user_would_create(tmp, directory=True)  # mkdtemp's 0700 would stay on the renamed export
    try:
        (tmp / PARTIAL_MARKER).write_text(json.dumps(_marker()), encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def finish_partial(tmp: Path) -> None:
    """The marker goes before the rename: a finished export carries no trace of being partial."""
    (tmp / PARTIAL_MARKER).unlink(missing_ok=True)


def os_error_line(e: OSError, where: Path) -> str:
    """One line for a failed write: what, where, and the fix."""
    what = e.strerror or str(e)
    fix = {errno.ENOSPC: "free some space or choose another disk",
           errno.EDQUOT: "free some space or choose another disk",
           errno.EROFS: "that filesystem is read-only: choose a writable directory",
           errno.EACCES: "choose a directory you can write to", errno.EPERM: "choose a directory you can write to"
           }.get(e.errno, "choose another output directory")
    target = e.filename or where
    return f"cannot export to {where} ({what}: {target}); {fix}; nothing was written"

