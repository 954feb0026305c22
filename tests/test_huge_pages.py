"""runtime/huge_pages.py: a new session's memory goes onto 2 MiB pages on Linux, and nothing else changes."""
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from hybrid_npu.runtime import huge_pages
from hybrid_npu.runtime.session_options import cpu_inference_session

MAPS = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f1200000000-7f1200a00000 rw-p 00000000 00:00 0
7f1200a00000-7f1200a01000 ---p 00000000 00:00 0
7f1300000000-7f1300400000 r--p 00000000 08:01 123                        /data/weights.bin
7f1400100000-7f1400500000 rw-p 00000000 00:00 0
7f1500000000-7f1500001000 rw-s 00000000 00:05 77                         /dev/zero (deleted)
"""


def test_only_private_anonymous_writable_mappings_and_their_whole_huge_pages():
    regions = huge_pages.anonymous_regions(MAPS)
    assert regions == [(0x55D0C0A00000, 0x55D0C0A21000), (0x7F1200000000, 0x7F1200A00000),
                       (0x7F1400100000, 0x7F1400500000)]
    spans = huge_pages.huge_spans(regions)
    # 10 MiB aligned: all five huge pages; 4 MiB starting 1 MiB in: the one whole page at +2 MiB
    assert spans == [(0x7F1200000000, 10 << 20), (0x7F1400200000, 2 << 20)]


def test_new_ranges_are_only_what_was_not_mapped_before():
    before = [(100, 200), (300, 400)]
    after = [(100, 250), (280, 450), (500, 600), (50, 80), (120, 180)]  # grown, merged, new, new, inside
    assert huge_pages.new_ranges(before, after) == [(200, 250), (280, 300), (400, 450), (500, 600), (50, 80)]
    assert huge_pages.new_ranges([], [(1, 2)]) == [(1, 2)]


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.find("[") + 1: text.find("]")] if "[" in text else "never"


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _kernel_collapses() -> bool:
    """Whether this kernel backs a fresh mapping with huge pages on MADV_COLLAPSE (Linux >= 6.1, THP
    not 'never'), asked directly of libc, not through the module under test."""
    if not sys.platform.startswith("linux") or _thp_mode() == "never":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe.write(b"\1" * (8 << 20))
    start = np.frombuffer(probe, np.uint8).ctypes.data
    aligned = (start + (2 << 20) - 1) & ~((2 << 20) - 1)
    return libc.madvise(aligned, 2 << 20, 14) == 0 and libc.madvise(aligned, 2 << 20, 25) == 0


linux_thp = pytest.mark.skipif(not _kernel_collapses(),
                               reason="needs Linux >= 6.1 with transparent huge pages not 'never'")


@linux_thp
def test_a_new_mapping_is_collapsed_and_keeps_its_contents(monkeypatch):
    monkeypatch.delenv("HYBRID_NPU_HUGE_PAGES", raising=False)
    size = 16 << 20
    with huge_pages.new_memory_on_huge_pages(background=False):
        new = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        new.write(b"\2" * size)
    address = np.frombuffer(new, np.uint8).ctypes.data
    assert _anon_huge_kb(address) >= 12 << 10  # at least 6 of its 7-8 whole huge pages
    assert new[:4] == b"\2\2\2\2" and new[-1] == 2


def _matmul_nbits_model(k: int = 4096, n: int = 20480) -> bytes:
    rng = np.random.default_rng(0)
    blocks = k // 32
    b = rng.integers(0, 256, size=(n, blocks, 16), dtype=np.uint8)
    scales = rng.random(n * blocks, dtype=np.float32) * 0.01
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def _process_anon_huge_kb() -> int:
    line = next(x for x in Path("/proc/self/smaps_rollup").read_text().splitlines() if x.startswith("AnonHugePages:"))
    return int(line.split()[1])


@linux_thp
def test_a_quantised_sessions_prepacked_weights_land_on_huge_pages(monkeypatch):
    """The real path: ORT's prepacked MatMulNBits weights, collapsed in the background; the session's
    output is the same as with huge pages off. 40 MiB of weights: above glibc's largest mmap threshold
    (32 MiB), so their buffer is a mapping of its own and not a reused part of an older one."""
    model = _matmul_nbits_model()
    x = np.random.default_rng(1).standard_normal((1, 4096)).astype(np.float32)
    monkeypatch.setenv("HYBRID_NPU_HUGE_PAGES", "0")
    before = _process_anon_huge_kb()
    plain = cpu_inference_session(model)
    huge_pages.wait()
    assert _process_anon_huge_kb() - before < 16 << 10  # off: nothing collapsed for it
    monkeypatch.delenv("HYBRID_NPU_HUGE_PAGES")
    before = _process_anon_huge_kb()
    huge = cpu_inference_session(model)
    huge_pages.wait()
    assert _process_anon_huge_kb() - before >= 32 << 10
    np.testing.assert_array_equal(huge.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])


def test_off_elsewhere(monkeypatch):
    monkeypatch.setattr(huge_pages.sys, "platform", "win32")
    assert not huge_pages.enabled()
    with huge_pages.new_memory_on_huge_pages(background=False):
        pass  # a no-op, not an error
