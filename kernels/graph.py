"""A thin helper over onnx.helper for writing graphs as straight-line code.

`g.op("MatMul", a, b)` adds a node and returns its output name, so kernels read like the
numpy references beside them. Constants become initializers (NPU-safe: no Constant-of-shape
tricks, every shape static).
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MatMulNBits)
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
              np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}


def all_nodes(nodes):
    """Every node of `nodes` and of their subgraphs (If branches), depth first."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g.node)


class GraphBuilder:
    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: dict[str, np.ndarray] = {}
        self._ids = itertools.count()
        self._const_cache: dict[tuple, str] = {}
        self.external: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.opset = OPSET

    def require_opset(self, version: int) -> None:
        """A node from a later ONNX opset (CPU graphs only: the NPU graphs stay at OPSET)."""
        self.opset = max(self.opset, version)

    # ---- names and values ----
    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    def input(self, name: str, dtype, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))
        return name

    def output(self, value: str, name: str, dtype, shape) -> str:
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], list(shape)))
        return name

    def weight(self, name: str, shape, dtype) -> str:
        """A named model weight, stored outside the graph (external data shared by all graphs of
        one model); its bytes are placed by the writer. Returns the tensor name."""
        self.external[name] = (tuple(shape), np.dtype(dtype))
        return name

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_cache:
            name = self.fresh("const")
            self.initializers[name] = arr
            self._const_cache[key] = name
        return self._const_cache[key]

    def ints(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.int64), np.int64)

    # ---- nodes ----
    @contextmanager
    def capture(self):
        """Nodes emitted inside the block are taken out of the graph into the yielded list (an If
        branch's body). Constants and weights they declare stay this graph's initializers: a
        branch reads them from the outer scope, so both branches share one copy."""
        start, body = len(self.nodes), []
        yield body
        body.extend(self.nodes[start:])
        del self.nodes[start:]

    def if_(self, cond: str, then: tuple[list, list[str]], otherwise: tuple[list, list[str]]) -> list[str]:
        """If(cond) over two captured bodies, each (nodes, output names); returns the outputs."""
        def branch(kind, nodes, outs):
            return helper.make_graph(nodes, self.fresh(kind), [],
                                     [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
        outs = [self.fresh("if") for _ in then[1]]
        self.nodes.append(helper.make_node("If", [cond], outs, name=outs[0], then_branch=branch("then", *then),
                                           else_branch=branch("else", *otherwise)))
        return outs

    def loop(self, trip_count: str, carried: list[str], body) -> list[str]:
        """Loop over trip_count ([1] int64) iterations, each body(i, *carried) -> the next carried values
        (fp32; i a [1] int64 counter). The body reads the outer graph's values directly."""
        it, cond, ins = self.fresh("iter"), self.fresh("cond"), [self.fresh("carry") for _ in carried]
        with self.capture() as nodes:
            outs = body(self.op("Unsqueeze", it, self.ints([0])), *ins)
            outs = [self.op("Identity", o) if o in ins else o for o in outs]  # a body output needs its own name
        cond_out = self.fresh("cond_out")
        nodes.append(helper.make_node("Identity", [cond], [cond_out], name=cond_out))
        f = TensorProto.FLOAT
        body_graph = helper.make_graph(
            nodes, self.fresh("loop_body"),
            [helper.make_tensor_value_info(it, TensorProto.INT64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
             *[helper.make_tensor_value_info(x, f, None) for x in ins]],
            [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
             *[helper.make_tensor_value_info(o, f, None) for o in outs]])
        results = [self.fresh("loop") for _ in carried]
        trips = self.op("Squeeze", trip_count, self.ints([0]))
        self.nodes.append(helper.make_node("Loop", [trips, "", *carried], results, name=results[0], body=body_graph))
        return results

    def op(self, op_type: str, *inputs: str, n_out: int = 1, omit: tuple[int, ...] = (), **attrs):
        """omit: indices of optional outputs left unnamed (not computed); the rest are returned."""
        outs = ["" if i in omit else self.fresh(op_type.lower()) for i in range(n_out)]
        used = [o for o in outs if o]
        # named: tools (quantizer, QNN reports) address nodes by name
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=used[0], **attrs))
        return used[0] if len(used) == 1 else used

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", x, self.ints(shape))

    def transpose(self, x: str, perm) -> str:
        return self.op("Transpose", x, perm=list(perm))

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        """Constant slice only: the NPU rejects runtime starts."""
        return self.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([axis]))

    def split(self, x: str, sizes, axis: int) -> list[str]:
        outs = self.op("Split", x, self.ints(sizes), axis=axis, n_out=len(sizes))
        return outs if isinstance(outs, list) else [outs]

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", x, self.ints(axes))

    def matmul(self, a: str, b: str) -> str:
        return self.op("MatMul", a, b)

    def matmul_nbits(self, x: str, b: str, scales: str, zero_points: str | None, *, k: int, n: int, bits: int,
                     block_size: int) -> str:
        """x [M, K] @ dequant(B)^T -> [M, N] with B block-quantised along K (export/quantize.py layout).
        accuracy_level 4: MLAS quantises x to int8 per block and multiplies in integers; measured on
        this project's x86 CI (AVX2, M=1, K=1024, N=7168): int4 2.4 ms vs 8.6 ms at fp32 compute, and
        int8 runs only at level 4 (4.2 ms; fp32 compute falls back to dequantising all of B per call)."""
        inputs = [x, b, scales] + ([zero_points] if zero_points else [])
        return self.op("MatMulNBits", *inputs, domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=block_size,
                       accuracy_level=4)

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def safe_exp(self, x: str) -> str:
        """Exp with its input clamped at -60: the HTP returns garbage below about -88
        (docs/htp-traps.md); e^-60 is 0 for every purpose here."""
        return self.op("Exp", self.op("Max", x, self.const(-60.0)))

    def softplus(self, x: str) -> str:
        """softplus(x) = relu(x) + log(1 + t), t = e^-|x|: the HTP's own Softplus is off by ~9% near
        x = -2 (docs/htp-traps.md) and feeds straight into the decay g. For t < 0.01 the
        series t - t²/2 + t³/3 - t⁴/4 replaces log(1 + t), which fp32 cannot resolve there."""
        t = self.safe_exp(self.op("Neg", self.op("Abs", x)))
        series = self.op("Mul", t, self.op("Add", self.const(1.0), self.op("Mul", t, self.op(
            "Add", self.const(-0.5), self.op("Mul", t, self.op("Add", self.const(1.0 / 3.0),
                                                                 self.op("Mul", t, self.const(-0.25))))))))
        exact = self.op("Log", self.op("Add", self.const(1.0), t))
        tail = self.op("Where", self.op("Less", t, self.const(0.01)), series, exact)
        return self.op("Add", self.op("Relu", x), tail)

    def model(self, placements: dict[str, tuple[str, int, int]] | None = None) -> onnx.ModelProto:
        """placements: weight name -> (file, offset, length) of its bytes in the external data file."""
        inits = [numpy_helper.from_array(np.asarray(v, order="C"), k) for k, v in self.initializers.items()]
        for name, (shape, dtype) in self.external.items():
            location, offset, length = placements[name]
            t = onnx.TensorProto(name=name, data_type=NP_TO_ONNX[dtype], dims=list(shape))
            t.data_location = TensorProto.EXTERNAL  # the bytes already sit in the shared weights file
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            inits.append(t)
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, inits)
        opsets = [helper.make_opsetid("", self.opset)]
        if any(node.domain == MS_DOMAIN for node in all_nodes(self.nodes)):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="hybrid-npu")
        model.ir_version = 10
        return model
