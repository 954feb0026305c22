"""Only hybrid_npu.manifest reads model.json's and drafter.json's keys: everything else reads the
typed records' fields. An AST scan of export/, runtime/ and src/hybrid_npu/ finds each string-key
read (x["k"], x.get("k"), x.pop("k"), "k" in x) whose x is manifest data: a name or attribute
called manifest/mf/meta, what json or read_json parsed out of model.json or drafter.json, and,
within a function, every name bound from such data (an alias, a loop variable over its entries)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("export", "runtime", "src/hybrid_npu")
OWNER = ROOT / "src/hybrid_npu/manifest.py"
MANIFEST_NAMES = {"manifest", "mf", "meta", "drafter_manifest"}
MANIFEST_FILES = {"MANIFEST", "DRAFTER_MANIFEST", "model.json", "drafter.json"}
ACCESSORS = {"get", "items", "values", "keys", "pop", "setdefault"}  # calls that hand out a mapping's data
KEY_READS = {"get", "pop", "setdefault"}


def _names_a_manifest_file(node) -> bool:
    return any(isinstance(n, ast.Name) and n.id in MANIFEST_FILES or
               isinstance(n, ast.Constant) and n.value in MANIFEST_FILES for n in ast.walk(node))


class Scan:
    def __init__(self, tree: ast.AST):
        self.tainted: set[str] = set()
        self.tree = tree

    def root_tainted(self, node) -> bool:
        """node reaches manifest data through attributes, subscripts and accessor calls."""
        while True:
            if isinstance(node, ast.Name):
                return node.id in MANIFEST_NAMES or node.id in self.tainted
            if isinstance(node, ast.Attribute):
                if node.attr in MANIFEST_NAMES:
                    return True
                node = node.value
            elif isinstance(node, ast.Subscript):
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ACCESSORS:
                node = node.func.value
            elif isinstance(node, ast.Call) and _names_a_manifest_file(node):
                return True  # json.loads((path / MANIFEST).read_text()), read_json(path / MANIFEST, ...)
            elif isinstance(node, (ast.BoolOp,)):
                return any(self.root_tainted(v) for v in node.values)
            else:
                return False

    def bind(self, target, tainted: bool) -> bool:
        """The names target binds (x, or x, y = ...; not self in self.x = ...) hold manifest data now."""
        names = [target] if isinstance(target, ast.Name) else \
            [n for n in getattr(target, "elts", ()) if isinstance(n, ast.Name)]
        new = {n.id for n in names} - self.tainted if tainted else set()
        self.tainted |= new
        return bool(new)

    def propagate(self) -> None:
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        changed |= self.bind(t, self.root_tainted(node.value))
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    changed |= self.bind(node.target, self.root_tainted(node.value))
                elif isinstance(node, (ast.For, ast.comprehension)):
                    changed |= self.bind(node.target, self.root_tainted(node.iter))

    def key_reads(self):
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str) and self.root_tainted(node.value):
                yield node.lineno, node.slice.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KEY_READS \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                    and self.root_tainted(node.func.value):
                yield node.lineno, node.args[0].value
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                    and isinstance(node.left.value, str) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                    and any(self.root_tainted(c) for c in node.comparators):
                yield node.lineno, node.left.value


def manifest_key_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of every manifest string-key read in a module's source, function by function
    (a name bound from manifest data in one function says nothing of the same name in another)."""
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    module_level = ast.Module(body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                                 ast.ClassDef))], type_ignores=[])
    found = set()
    for scope in [module_level, *scopes]:
        scan = Scan(scope)
        scan.propagate()
        found |= set(scan.key_reads())
    return sorted(found)


def scanned_files():
    for folder in SCANNED:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f != OWNER:
                yield f


def test_no_manifest_key_is_read_outside_the_manifest_module():
    reads = [f"{f.relative_to(ROOT)}:{line} [{key!r}]" for f in scanned_files()
             for line, key in manifest_key_reads(f.read_text(encoding="utf-8"))]
    assert not reads, "read these through hybrid_npu.manifest's fields:\n" + "\n".join(reads)


@pytest.mark.parametrize("source", [
    'def f(manifest):\n    return manifest["chunk"]',
    'def f(self):\n    return self.manifest.graphs["verify"].n',
    'def f(engine):\n    return engine.manifest.get("drafter")',
    'def f(manifest):\n    w = manifest.weights\n    return w["file"]',
    'def f(manifest):\n    for name, e in manifest.npu.items():\n        e.get("tile")',
    'def f(path):\n    m = json.loads((path / MANIFEST).read_text())\n    return m["tokenizer"]',
    'def f(path):\n    m = read_json(path / "drafter.json", 1, "", "")\n    return "vocab" in m',
    'def f(meta):\n    return [g["file"] for g in meta.graphs.values()]',
])
def test_the_scan_sees_a_planted_read(source):
    """The check above would pass on nothing: each of these reads is caught."""
    assert manifest_key_reads(source)


@pytest.mark.parametrize("source", [
    'def f(manifest):\n    return manifest.verify.n, manifest.npu.get(name), ModelConfig.from_dict(manifest.config)',
    'def f(out):\n    return out["logits"][0]',
    'def f(manifest):\n    cfg = manifest.model_config\n    return cfg.vocab_size',
])
def test_the_scan_passes_fields_and_other_data(source):
    assert not manifest_key_reads(source)


def test_the_scan_reads_the_real_tree():
    """The files it scans are the product's: the runtime's engine among them, the owner not."""
    files = {f.relative_to(ROOT).as_posix() for f in scanned_files()}
    assert "runtime/engine.py" in files and "export/exporter.py" in files and "src/hybrid_npu/manifest.py" not in files
