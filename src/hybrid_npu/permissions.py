"""Files and folders we create through tempfile (which makes them private: 0600 / 0700) get the
permissions the user's umask gives any other new file before they take their final names."""
from __future__ import annotations

import os


def current_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and put back at once
    os.umask(mask)
    return mask


def as_user_would_create(path, directory: bool = False) -> None:
    """chmod `path` to what open()/mkdir() would have given it (0666 / 0777 less the umask)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())
