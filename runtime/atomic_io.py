"""Replace a file in one step: what a reader opens is always one whole earlier or later version.

The content goes to a temporary file with a unique name beside the target (two savers to one path
never share a temporary file), is fsynced, then renamed over the target with os.replace (atomic on
POSIX and on Windows/NTFS). Any failure (disk full, a name the filesystem refuses, no permission)
removes the temporary file, leaves the previous version untouched and becomes one UserError line
that says why and what to do. A save killed outright (SIGKILL, power loss) cannot clean up: its
temporary file's name carries its process id and start time, and the next save to the same path
removes those whose process is gone.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Callable

import psutil

from hybrid_npu.errors import UserError
from hybrid_npu.permissions import as_user_would_create

_FIX = {
    errno.ENOSPC: "free disk space or save elsewhere",
    errno.ENAMETOOLONG: "choose a shorter file name",
    errno.EACCES: "choose a writable directory",
    errno.EPERM: "choose a writable directory",
    errno.EROFS: "choose a writable directory (this one is read-only)",
}
if hasattr(errno, "EDQUOT"):
    _FIX[errno.EDQUOT] = "free disk space (quota) or save elsewhere"


def os_error_line(e: OSError) -> str:
    """'No space left on device; free disk space or save elsewhere': the reason and the fix."""
    return f"{e.strerror or e}; {_FIX.get(e.errno, 'check the path and free disk space')}"


def check_target(path: Path, what: str) -> None:
    """Refuse up front a target that cannot take a file: a directory, a missing parent, a bad name."""
    try:
        if path.is_dir():
            raise UserError(f"cannot save {what} to {path}: it is a directory; give a file name such as "
                            f"{path / 'chat.state'}")
        if not path.parent.is_dir():
            raise UserError(f"cannot save {what} to {path}: directory {path.parent} does not exist; create it first")
    except OSError as e:  # e.g. ENAMETOOLONG from stat() of a 300-character name
        raise UserError(f"cannot save {what} to {path.name[:40]}…: {os_error_line(e)}") from None


def write_atomically(path, write: Callable[[Path], None], what: str) -> None:
    """`write(tmp)` fills a fresh temporary file beside `path`; then it takes the final name in one
    step. OSError anywhere is a UserError and the file under `path` is whatever it was before."""
    path = Path(path)
    check_target(path, what)
    short = path.name if len(path.name) <= 60 else path.name[:40] + "…"
    remove_stale_temporaries(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f"{_prefix(path)}{_owner()}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"cannot save {what} to {short}: {os_error_line(e)}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "r+b") as f:  # on disk before it takes the final name
            os.fsync(f.fileno())
        as_user_would_create(tmp)  # mkstemp's 0600 would stay on the saved file
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    except OSError as e:
        raise UserError(f"cannot save {what} to {short}: {os_error_line(e)}; the previous file is unchanged") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)  # gone already after os.replace; never mask the real error
        except OSError:
            pass


def _prefix(path: Path) -> str:
    return f".{path.name[:24]}."


def _owner() -> str:
    """pid-starttime of this process: a later save can tell a temporary file whose writer is gone."""
    me = psutil.Process()
    return f"{me.pid}-{int(me.create_time() * 1000)}"


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files of earlier saves to `path` whose process no longer runs (killed
    with SIGKILL, or by a power loss, before it could clean up). Another machine's writer on a
    shared disk would look gone: its file is left alone unless its pid is not running here either,
    which is the best a name can tell."""
    removed = []
    prefix = _prefix(path)
    try:
        candidates = [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(".tmp")]
    except OSError:
        return removed
    for tmp in candidates:
        owner = tmp.name[len(prefix):].split(".", 1)[0]
        pid, _, started = owner.partition("-")
        if not (pid.isdigit() and started.isdigit()) or tmp.is_symlink() or not tmp.is_file():
            continue  # not a name this module gives
        try:
            alive = abs(psutil.Process(int(pid)).create_time() * 1000 - int(started)) < 1000
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:
            alive = True
        if not alive:
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); Windows cannot open a directory for this."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
