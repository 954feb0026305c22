"""A graph's inputs and outputs as the manifests list them (hybrid_npu.manifest Graph.inputs/outputs)."""
from __future__ import annotations

import onnx

_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
           onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8"}


def value_infos(values) -> list[dict]:
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "shape": shape, "dtype": _DTYPES[t.elem_type]})
    return out
