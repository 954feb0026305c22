"""The never-arrows: the runtime never imports export/ (a laptop that only runs models needs none of
it), kernels import neither side; the format's names live in hybrid_npu.format for both."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: str, package: str):
    for file in sorted((ROOT / folder).rglob("*.py")):  # subfolders too (runtime/chat/, export/npu/, ...)
        name = file.relative_to(ROOT / folder).as_posix()
        here = ".".join([package, *file.relative_to(ROOT / folder).parent.parts])  # the file's own package
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                yield name, [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the file's package
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                yield name, [base]


@pytest.mark.parametrize("folder, package, forbidden", [
    ("runtime", "hybrid_npu.runtime", ("hybrid_npu.export",)),
    ("kernels", "hybrid_npu.kernels", ("hybrid_npu.export", "hybrid_npu.runtime")),
])
def test_never_arrows(folder, package, forbidden):
    bad = [(f, m) for f, mods in imported_modules(folder, package) for m in mods if m.startswith(forbidden)]
    assert not bad, bad


def test_export_uses_the_runtime_through_one_seam():
    """export/ reaches the runtime only through hybrid_npu.runtime.for_export, so what the exporter
    needs of the runtime is one list that can be read (and kept short)."""
    used = {(f, m) for f, mods in imported_modules("export", "hybrid_npu.export") for m in mods
            if m.startswith("hybrid_npu.runtime")}
    assert used and {m for _, m in used} == {"hybrid_npu.runtime.for_export"}, sorted(used)


def test_the_resolver_sees_relative_imports():
    """The check above would pass on nothing: it must see runtime's own relative imports."""
    mods = {m for _, ms in imported_modules("runtime", "hybrid_npu.runtime") for m in ms}
    assert "hybrid_npu.runtime.state" in mods and "hybrid_npu.format" in mods
