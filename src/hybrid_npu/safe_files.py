"""Reading files we did not write: a downloaded export or checkpoint, a --tools file, a snapshot.

Each one is hostile until checked, so every read here
* names a regular file (a FIFO would block the open, /dev/zero never ends, a directory is no file);
  it is checked by stat before the open, which is non-blocking where the platform has that flag,
  and by fstat after it (a file swapped in between is refused too);
* reads at most `max_bytes` (a size taken from a manifest or a limit for the kind of file), so a
  file that grows or lies about its size cannot take the memory;
* for JSON, refuses nesting deeper than `max_depth` (Python's parser recurses: 100k levels would
  be a RecursionError traceback, and what reads the value later recurses too).
`inside(root, rel)` resolves a path a manifest names and refuses one that leaves root: absolute,
with `..`, or through a symlink that points out. Every refusal is one UserError line naming the
file and the fix (`fix`, given by the caller).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from hybrid_npu.errors import UserError

MAX_NAME = 255                # a path component: NTFS and ext4 both stop at 255
JSON_DEPTH = 64               # any manifest, config or tools file we read nests far less
CONFIG_BYTES = 16 << 20       # config.json, tokenizer_config.json, model.json, drafter.json, --tools
TOKENIZER_BYTES = 256 << 20   # tokenizer.json: a 250k-token BPE vocabulary with merges is ~20 MB
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX: opening a FIFO does not wait for a writer
_BINARY = getattr(os, "O_BINARY", 0)      # Windows: no newline translation


def short(path) -> str:
    """A path for a message: one line, at most ~120 characters."""
    s = str(path).replace("\n", "\\n")
    return s if len(s) <= 120 else s[:60] + "…" + s[-50:]


def check_names(path, what: str = "path") -> None:
    """Refuse a path with a component the filesystem would refuse (ENAMETOOLONG as a traceback)."""
    for part in Path(path).parts:
        if len(part) > MAX_NAME:
            raise UserError(f"{what} {short(path)}: a name in it is {len(part)} characters, the limit is "
                            f"{MAX_NAME}; give a shorter path")


def inside(root: Path, rel, what: str, fix: str) -> Path:
    """root / rel, refused unless rel is a relative path without `..` that stays in root after
    symlinks are resolved (on either platform's separators: an export made on Windows is read here)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise UserError(f"{short(root)}: {what} {rel!r} is not a file name; {fix}")
    for pure in (PurePosixPath(rel), PureWindowsPath(rel)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            raise UserError(f"{short(root)}: {what} {short(rel)} points outside the folder; {fix}")
    check_names(rel, what)
    path = root / rel
    try:
        real, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise UserError(f"{short(path)}: {what} cannot be resolved ({e}); {fix}") from None
    if real != base and base not in real.parents:
        raise UserError(f"{short(path)}: {what} is a link to {short(real)}, outside {short(root)}; {fix}")
    return path


def regular_size(path: Path, what: str, fix: str) -> int:
    """The size of a regular file, else a UserError (missing, a directory, a device, a FIFO)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{short(path)}: {what} does not exist; {fix}") from None
    except OSError as e:
        raise UserError(f"{short(path)}: cannot read {what} ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{short(path)}: {what} is not a regular file ({_kind(st.st_mode)}); {fix}")
    return st.st_size


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def open_regular(path: Path, what: str, fix: str):
    """A binary file object for a regular file; never blocks on a FIFO, never opens a device."""
    regular_size(path, what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _BINARY)
    except OSError as e:
        raise UserError(f"{short(path)}: cannot read {what} ({e.strerror or e}); {fix}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
        f.close()
        raise UserError(f"{short(path)}: {what} is not a regular file; {fix}")
    return f


def read_bytes(path, max_bytes: int, what: str, fix: str) -> bytes:
    """At most max_bytes of a regular file; a larger one is refused before it is read."""
    path = Path(path)
    size = regular_size(path, what, fix)
    if size > max_bytes:
        raise UserError(f"{short(path)}: {what} is {size} bytes, more than the {max_bytes} allowed; {fix}")
    with open_regular(path, what, fix) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise UserError(f"{short(path)}: cannot read {what} ({e.strerror or e}); {fix}") from None
    if len(data) > max_bytes:  # it grew after the stat
        raise UserError(f"{short(path)}: {what} is more than the {max_bytes} bytes allowed; {fix}")
    return data


def read_text(path, max_bytes: int, what: str, fix: str) -> str:
    data = read_bytes(path, max_bytes, what, fix)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{short(path)}: {what} is not UTF-8 text (byte {e.start}); {fix}") from None


def parse_json(text, where: str, what: str, fix: str, max_depth: int | None = JSON_DEPTH):
    """json.loads, with a too-deep document and every parse error as one UserError line."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: {what} nests too deeply; {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: {what} is not valid JSON ({str(e)[:160]}); {fix}") from None
    if max_depth is not None and depth(value, max_depth) > max_depth:
        raise UserError(f"{where}: {what} nests deeper than {max_depth} levels; {fix}")
    return value


def read_json(path, max_bytes: int, what: str, fix: str, max_depth: int | None = JSON_DEPTH):
    """A bounded regular JSON file; None is never returned for a missing file (that is refused)."""
    return parse_json(read_text(path, max_bytes, what, fix), short(path), what, fix, max_depth)


def depth(value, stop: int) -> int:
    """Nesting depth of a parsed JSON value, without recursion; counting ends past `stop`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > stop:
                return deepest
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v)
                        if isinstance(c, (dict, list)))
    return deepest


def safetensors_header(f, size: int, max_header: int, where: str, fix: str) -> tuple[dict, int]:
    """(header, data start) of the safetensors file open as `f` (of `size` bytes), reading the
    header only: names, dtypes, shapes and offsets can be checked before a byte of tensor data is
    read. Refuses a header that is not a JSON object of {dtype, shape, data_offsets} entries inside
    the file. where: the start of every refusal ("cannot load state FILE")."""

    def bad(detail: str) -> UserError:
        return UserError(f"{where}: not a readable safetensors file ({detail}); {fix}")

    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= min(max_header, size - 8):
        raise bad(f"header length {n} in a file of {size} bytes: truncated or damaged")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise bad("its header nests too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise bad("its header is not JSON: truncated or damaged") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("damaged metadata")
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and isinstance(info.get("shape"), list) and all(type(d) is int and d >= 0 for d in info["shape"])
                and isinstance(info.get("dtype"), str) and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {str(name)[:60]} has a damaged header entry")
        if offsets[1] > size - 8 - n:
            raise bad(f"tensor {str(name)[:60]} runs past the end of the file: truncated")
    return header, 8 + n
