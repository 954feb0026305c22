"""Back the memory a new ONNX Runtime session allocated (a quantised export's prepacked weights) with
2 MiB pages, on Linux; a no-op elsewhere.

Why: a decode step streams every prepacked weight once (~400 MB at the 0.8B config, int4), and in
4 KiB pages that is ~100k page-table walks a step. Backed by transparent huge pages the same step
measured 1.07-1.09x faster (docs/performance.md). ORT allocates those buffers with
plain malloc when the session is made, and where the machine's THP mode is `madvise` (Debian's and
Ubuntu's default) they get small pages. So: note the process's anonymous mappings before the
session is made, and afterwards ask the kernel to back the new ones with huge pages
(madvise MADV_HUGEPAGE, then MADV_COLLAPSE, Linux >= 6.1; on an older kernel the advice alone
lets khugepaged do it over minutes). The collapse copies the pages (~1 s for 450 MB on 2 cores),
so it runs on a background thread: the session is usable at once, and only gets faster.

HYBRID_NPU_HUGE_PAGES=0 turns it off. Windows (large pages need a privilege users do not have) and
macOS are left as they are.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman-common.h
MAPS = Path("/proc/self/maps")


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("HYBRID_NPU_HUGE_PAGES") != "0" and MAPS.exists()


def anonymous_regions(maps_text: str) -> list[tuple[int, int]]:
    """(start, end) of each private, writable, anonymous mapping in /proc/PID/maps text: unnamed ones
    (large mallocs, other threads' arenas) and [heap] (the main arena, where glibc puts allocations
    below its mmap threshold, which grows up to 32 MiB as large blocks are freed)."""
    regions = []
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        regions.append((start, end))
    return regions


def new_ranges(before, after) -> list[tuple[int, int]]:
    """The address ranges mapped in `after` but not in `before`: a mapping that grew (the heap) or
    merged with a neighbour counts only for its new part. Mappings do not overlap within one list."""
    before = sorted(before)
    starts = [s for s, _ in before]
    new = []
    for start, end in after:
        i = max(bisect.bisect_right(starts, start) - 1, 0)  # the first old mapping that can overlap
        at = start
        for b_start, b_end in before[i:]:
            if b_start >= end:
                break
            if b_end <= at:
                continue
            if b_start > at:
                new.append((at, b_start))
            at = max(at, b_end)
        if at < end:
            new.append((at, end))
    return new


def huge_spans(ranges, min_bytes: int = HUGE_PAGE) -> list[tuple[int, int]]:
    """The whole 2 MiB pages inside each range, as (address, length); ranges holding none are dropped."""
    spans = []
    for start, end in sorted(ranges):
        lo, hi = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), end & ~(HUGE_PAGE - 1)
        if hi - lo >= min_bytes:
            spans.append((lo, hi - lo))
    return spans


def back_with_huge_pages(spans) -> int:
    """Advise and collapse each span; returns the bytes the kernel collapsed (0 where it could not:
    an older kernel, THP off, or the range went away meanwhile, all harmless)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for address, length in spans:
        if libc.madvise(address, length, MADV_HUGEPAGE) == 0 and libc.madvise(address, length, MADV_COLLAPSE) == 0:
            done += length
    return done


_threads: list[threading.Thread] = []


@contextmanager
def new_memory_on_huge_pages(background: bool = True):
    """Around the making of a session: its new anonymous mappings are backed by huge pages after it."""
    if not enabled():
        yield
        return
    before = anonymous_regions(MAPS.read_text())
    yield
    spans = huge_spans(new_ranges(before, anonymous_regions(MAPS.read_text())))
    if not spans:
        return
    if not background:
        back_with_huge_pages(spans)
        return
    thread = threading.Thread(target=back_with_huge_pages, args=(spans,), name="hybrid-npu-huge-pages", daemon=True)
    thread.start()
    _threads[:] = [t for t in _threads if t.is_alive()] + [thread]  # a long-lived process keeps no finished ones


def wait() -> None:
    """Until every background collapse so far has finished (benchmarks and tests)."""
    while _threads:
        _threads.pop().join()
