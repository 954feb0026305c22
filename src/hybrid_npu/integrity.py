"""Content hashes of an export's files, recorded in model.json and checked before the model runs.

A flipped byte in weights.bin changes the text a model writes without any error, so every file
an export writes (graphs, weights, tokenizer, drafter, context binaries; not model.json itself)
gets its size and SHA-256 in the manifest's "integrity" entry. SHA-256 because hashlib's runs on
the CPU's SHA instructions: 1.6 GB/s streaming here, twice blake2b's 0.8 GB/s (a 1.6 GB file on a
shared machine; docs/reliability-export.md).

When: sizes on every load (a stat; catches truncated and empty files), full hashes at the first
load of each file and again whenever it changes. "Changes" is a stat key (device, inode, size,
mtime, ctime: a write or a copy changes it, and ctime cannot be set back by a user) remembered in
a small per-user cache of verified files, since hashing a 0.8B fp16 weights.bin costs about 1 s
and would otherwise be paid on every load. HYBRID_NPU_VERIFY=always ignores the cache (silent
disk rot keeps the stat key); exports from before hashes were recorded load as before, checked
by size only.
QNN context binaries are checked only when their profile runs on the NPU, and a damaged one is
rebuilt from the ONNX graphs (as a binary built for another QNN version is), not refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from hybrid_npu.errors import UserError
from hybrid_npu.format import MANIFEST
from hybrid_npu.safe_files import inside, open_regular, read_json

ALGORITHM = "sha256"
_BLOCK = 1 << 20
_FIX = "copy the export again or re-export it"
_CACHE_ENTRIES = 512
_CACHE_BYTES = 1 << 20  # 512 keys of ~120 characters
SKIP = {MANIFEST, ".hybrid-npu-partial"}  # the manifest holds the record; the partial marker is removed
CONTEXT_DIR = "ctx"  # export/npu/context_binaries.py writes QNN context binaries under ctx/PROFILE/


def file_hash(path: Path, limit: int | None = None) -> str:
    """The file's digest; with `limit`, of at most that many bytes (a verify reads no more than the
    size the manifest records, whatever the file turns out to be)."""
    h = hashlib.new(ALGORITHM)
    left = limit
    with (open(path, "rb") if limit is None else open_regular(path, "an export file", _FIX)) as f:
        while left is None or left > 0:
            block = f.read(_BLOCK if left is None else min(_BLOCK, left))
            if not block:
                break
            h.update(block)
            left = None if left is None else left - len(block)
    return h.hexdigest()


def export_files(root: Path) -> list[str]:
    """Every file under an export directory the integrity entry covers, as POSIX relative paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).as_posix() not in SKIP)


def record(root: Path) -> dict:
    """The manifest's "integrity" entry for the files now under root; they count as verified."""
    files = {}
    for rel in export_files(root):
        path = root / rel
        files[rel] = {"bytes": path.stat().st_size, ALGORITHM: file_hash(path)}
        _remember(path, files[rel][ALGORITHM])
    return {"algorithm": ALGORITHM, "files": files}


def verify(root: Path, entry, weights, npu_profile: str | None = None) -> list[str]:
    """UserError naming the first missing, resized or changed file of the export at root. QNN
    context binaries are a cache the runtime can rebuild from the graphs: only those of
    npu_profile are checked, and the damaged ones are returned instead of refused. entry: the
    manifest's integrity entry as written by record() (checked here), weights: its Weights record."""
    if not isinstance(entry, dict):
        _sizes_only(root, weights)
        return []
    if entry.get("algorithm") != ALGORITHM or not isinstance(entry.get("files"), dict):
        raise UserError(f"{root / 'model.json'}: unknown integrity entry (algorithm {entry.get('algorithm')!r}); "
                        "re-export the model with this version of export-hybrid")
    contexts = f"{CONTEXT_DIR}/{npu_profile}/" if npu_profile else None
    always = os.environ.get("HYBRID_NPU_VERIFY") == "always"
    damaged = []
    for rel, want in entry["files"].items():
        is_context = rel.startswith(CONTEXT_DIR + "/")
        if is_context and not (contexts and rel.startswith(contexts)):
            continue
        path = inside(root, rel, "integrity entry", _FIX)  # an oracle for any file's content otherwise
        if not isinstance(want, dict) or type(want.get("bytes")) is not int or want["bytes"] < 0:
            raise UserError(f"{root / MANIFEST}: the integrity entry of {rel} is damaged; {_FIX}")
        problem = _problem(path, rel, root, want, always)
        if problem and is_context:
            damaged.append(rel)
        elif problem:
            raise UserError(problem)
    return damaged


def _problem(path: Path, rel: str, root: Path, want: dict, always: bool) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return f"{root} is incomplete: {rel} is missing; copy the export again or re-export it"
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the hash, /dev/zero never end it
        return f"{path} is not a regular file; {_FIX}"
    size = st.st_size
    if size != want.get("bytes"):
        return (f"{path} is {size} bytes, the export wrote {want.get('bytes')}: the file is truncated "
                "or damaged; copy the export again or re-export it")
    if not always and _known_good(path, want.get(ALGORITHM)):
        return None
    if file_hash(path, size) != want.get(ALGORITHM):
        return (f"{path} does not match the {ALGORITHM} the export recorded: the file is damaged "
                "(changed bytes); copy the export again or re-export it")
    _remember(path, want[ALGORITHM])
    return None


def _size(path: Path, rel: str, root: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        raise UserError(f"{root} is incomplete: {rel} is missing; copy the export again or re-export it") from None


def _sizes_only(root: Path, w) -> None:
    """Exports from before integrity hashes: the weights file must exist and hold what was written."""
    if w.file is None:
        return
    path = inside(root, w.file, "weights file", _FIX)
    size, want = _size(path, w.file, root), w.bytes
    if want is not None and size != want:
        raise UserError(f"{path} is {size} bytes, the export wrote {want}: the file is truncated or "
                        "damaged; copy the export again or re-export it")


# ---- the per-user cache of files already verified ----
def cache_file() -> Path:
    if os.environ.get("HYBRID_NPU_CACHE"):
        base = Path(os.environ["HYBRID_NPU_CACHE"])
    elif sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"]) / "hybrid-npu"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-npu"
    return base / "verified.json"


def _key(path: Path, digest: str) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{digest}"


def _read_cache() -> list[str]:
    try:
        keys = read_json(cache_file(), _CACHE_BYTES, "the verified-file cache", "")
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []
    except (OSError, UserError):  # absent, damaged or not a file: hash again
        return []


def _known_good(path: Path, digest) -> bool:
    return isinstance(digest, str) and _key(path, digest) in _read_cache()


def _remember(path: Path, digest: str) -> None:
    """Best effort: an unwritable cache only means hashing again next time."""
    stat_key = _key(path, "")  # this file as it is now, whatever digest an older entry had
    _write_cache([k for k in _read_cache() if not k.startswith(stat_key)] + [_key(path, digest)])


def _write_cache(keys: Iterable[str]) -> None:
    target = cache_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".verified-", dir=target.parent)  # unique: concurrent loads
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(list(keys)[-_CACHE_ENTRIES:], f)
        os.replace(tmp, target)
    except OSError:
        pass
