"""What every CLI shares: argument errors in one line, exit code 2; memory sizes as flags."""
from __future__ import annotations

import argparse
import os
import re
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (problem + where to look), not the usage block."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def report(prog: str, error) -> int:
    """A refused input or fault, as every CLI says it: one line 'PROG: error: ...'; its exit code."""
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return getattr(error, "exit_code", 2)


def max_threads() -> int:
    """The most --threads any CLI takes: 4x this machine's logical CPUs (more only adds contention;
    each thread holds a stack and ORT's per-thread buffers, so 100000 took gigabytes)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads, name: str = "--threads ") -> None:
    """Threads as every CLI (name "--threads ") and the engine ("threads=") check them: None (the
    profile's), or a whole number from 1 to max_threads()."""
    from hybrid_npu.errors import UserError

    ok = isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= max_threads()
    if threads is not None and not ok:
        raise UserError(f"{name}{threads!r}: give 1 to {max_threads()} (4x the {os.cpu_count() or 1} CPUs here)")


_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def byte_size(text: str) -> int:
    """argparse type for memory sizes: bytes (8589934592) or with a binary unit (8G, 512M, 8GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; give bytes or e.g. 8G, 512M")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def path_arg(text: str) -> str:
    """argparse type for a file or folder path: a name longer than the filesystem allows is one
    line here, not an ENAMETOOLONG traceback wherever the path is first used."""
    from hybrid_npu.safe_files import MAX_NAME

    longest = max((len(part) for part in re.split(r"[\\/]", text)), default=0)
    if longest > MAX_NAME:
        raise argparse.ArgumentTypeError(f"a name in this path is {longest} characters, the limit is {MAX_NAME}; "
                                         "give a shorter path")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot hold a NUL character")
    return text


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': sizes as the CLIs print them (binary units, like byte_size reads them)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def stdout_closed() -> int:
    """The reader of stdout went away (`| head`): Python's documented SIGPIPE handling. Point stdout
    at the null device so the flush at exit cannot raise again, and exit quietly with 1 (what
    Python itself returns on EPIPE). Works the same on Windows, which has no SIGPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass
    return 1


def _reconfigure(stream, **kw) -> None:
    if hasattr(stream, "reconfigure"):  # a real text stream (a test may have put a StringIO there)
        stream.flush()
        stream.reconfigure(**kw)


def data_output() -> None:
    """stdout carries data (--json, --render-only, a reply or summary meant for a file or a pipe):
    UTF-8 whatever the console's code page or locale says (PYTHONIOENCODING=cp1252, LANG=C), so the
    bytes are the text's exactly; stderr (progress, errors) shows what it can, '?' for the rest."""
    _reconfigure(sys.stdout, encoding="utf-8", errors="replace")  # "replace": only lone surrogates
    _reconfigure(sys.stderr, errors="replace")


def console_output(prog: str) -> None:
    """Interactive text: where stdout is a file or a pipe it is data (data_output) and stdin, the
    messages piped in, is read as UTF-8 too; on a terminal the console's own encoding, with what it
    cannot show replaced by '?' and said once on stderr (note_unshowable)."""
    if not sys.stdout.isatty():
        data_output()
    else:
        _reconfigure(sys.stdout, errors="replace")
        _reconfigure(sys.stderr, errors="replace")
    if not sys.stdin.isatty():
        _reconfigure(sys.stdin, encoding="utf-8", errors="replace")
    _unshowable.update(prog=prog, said=False)


_unshowable = {"prog": None, "said": False}


def note_unshowable(text: str, stream=None) -> None:
    """Say once (stderr) that the console replaced characters it cannot show, and how to see them."""
    stream = stream or sys.stdout
    if _unshowable["said"] or _unshowable["prog"] is None:
        return
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        _unshowable["said"] = True
        print(f"{_unshowable['prog']}: note: this console's encoding ({encoding}) cannot show some characters; "
              "they appear as '?'. Set PYTHONIOENCODING=utf-8 (Windows: also `chcp 65001`), or use --json, "
              "to see them", file=sys.stderr, flush=True)
    except LookupError:
        pass
