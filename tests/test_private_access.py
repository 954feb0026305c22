"""No product module reaches into another object's private attributes: `x._name` is read or written
only on self, cls or super() (the object's own class), or on an imported module (os._exit). What
one part needs of another is a public attribute or method, so either side can change its insides."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("export", "runtime", "kernels", "profiles", "src/hybrid_npu")


def private_reaches(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    modules = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in modules):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def product_files():
    for folder in SCANNED:
        yield from sorted(p for p in (ROOT / folder).rglob("*.py") if "models" not in p.relative_to(ROOT).parts)


@pytest.mark.parametrize("file", list(product_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reaches_into_private_attributes(file):
    assert not private_reaches(file.read_text(encoding="utf-8")), private_reaches(file.read_text(encoding="utf-8"))


def test_the_scan_finds_a_reach_and_passes_the_allowed_forms():
    source = ("import os\n"
              "def f(engine):\n"
              "    engine._pending = []\n"
              "    return engine.state._rows, os._exit\n"
              "class A(B):\n"
              "    def g(self):\n"
              "        return self._x, super()._parse(), type(self)._y\n")
    assert [text for _, text in private_reaches(source)] == ["engine._pending", "engine.state._rows", "type(self)._y"]
