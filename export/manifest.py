"""model.json: everything the runtime needs to know about an export, and nothing it must guess."""
from __future__ import annotations

from pathlib import Path

import onnx

from hybrid_npu.errors import UserError
from hybrid_npu.format import FORMAT, MANIFEST
from hybrid_npu.safe_files import CONFIG_BYTES, read_json

_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
           onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8"}


def value_infos(values) -> list[dict]:
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "shape": shape, "dtype": _DTYPES[t.elem_type]})
    return out


def read_manifest_json(path: Path):
    """model.json of a folder as parsed JSON (any type), or None when it is absent or unreadable as
    a bounded regular JSON file (a link to /dev/zero, a FIFO, 100k nested lists)."""
    try:
        return read_json(path / MANIFEST, CONFIG_BYTES, "the manifest", "")
    except (UserError, OSError):
        return None


def is_export(path: Path) -> bool:
    m = read_manifest_json(path)
    return isinstance(m, dict) and m.get("format") == FORMAT

