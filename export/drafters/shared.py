"""What every drafter's export shares (EAGLE-3's layer, eagle3.py, and the MTP head, mtp.py): the
weight plan, linear layers over float or block-quantised weights, the step graph's inputs, and
writing the weights, graphs and draft vocabulary. The runtime reads both kinds with the same K/V
and tree code (runtime/drafters/draft_tree.py), so their step graphs take the same inputs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from hybrid_npu.errors import UserError
from hybrid_npu.format import MASK_DIM, PAST_DIM, STORAGE_DTYPES
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.manifest import DraftVocab, Graph

from ..quantize import QuantSpec, plan_quantized_linear
from ..value_infos import value_infos
from ..weights import WeightPlan

VOCAB_FILE = "vocab.safetensors"  # draft_to_target int64 [Vd]: target id of each draft id
PAST, MASK_LEN, N, M = PAST_DIM, MASK_DIM, "n", "m"


def drafter_weight_plan(load, dtype: str, quant: QuantSpec | None = None) -> WeightPlan:
    """A drafter's weights, stored as `dtype` ("fp32" | "fp16"); any other is one line. quant: its
    linear layers block-quantised as the target's (MatMulNBits, the head at quant.head_bits). At the
    real size a float drafter reads more bytes a draft level than an int4 target's decode step
    (docs/speculation.md), so a quantised target ships a drafter quantised alike."""
    if dtype not in STORAGE_DTYPES:
        raise UserError(f"drafter dtype {dtype!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
    return WeightPlan(load, STORAGE_DTYPES[dtype], quant=quant)


def drafter_linear(g: GraphBuilder, plan: WeightPlan, x: str, name: str, sources: list[str], in_dim: int,
                   out_dims: list[int], head: bool = False) -> str:
    """x @ the sources' stacked [Σout, in] matrix^T: Gemm over the float matrix, or MatMulNBits over
    its block-quantised form when the plan quantises (head: at the head's bits)."""
    q = plan.quant
    if q is None:
        return g.op("Gemm", x, weight_input(g, plan, plan.linear_weight(name, sources, in_dim, out_dims)), transB=1)
    ql = plan_quantized_linear(plan, name, sources, in_dim, out_dims, q.head_bits if head else q.bits, q)
    for stored in (ql.b, ql.scales, ql.zero_points):
        if stored:
            g.weight(stored, plan.entries[stored].shape, plan.entries[stored].dtype)
    return g.matmul_nbits(x, ql.b, ql.scales, ql.zero_points, k=ql.k, n=ql.n, bits=ql.bits, block_size=ql.block_size)


def weights_entry(plan: WeightPlan, weights_file: str, dtype: str) -> dict:
    """The drafter manifest's "weights": its file, size, float dtype and quantisation (None: float)."""
    return {"file": weights_file, "bytes": plan.total_bytes(), "dtype": dtype,
            "quant": None if plan.quant is None else plan.quant.to_manifest()}


def weight_input(g: GraphBuilder, plan: WeightPlan, stored: str) -> str:
    """A planned weight as a graph input of `g`, widened to fp32 when stored narrower."""
    e = plan.entries[stored]
    g.weight(stored, e.shape, e.dtype)
    return stored if e.dtype == np.float32 else g.op("Cast", stored, to=onnx.TensorProto.FLOAT)


def write_drafter_files(out: Path, plan: WeightPlan, builders: dict[str, GraphBuilder],
                        weights_file: str) -> dict[str, Graph]:
    """Write the planned weights and each built graph (checked) into out; returns the manifest's
    graph records. Every drafter kind is written this way."""
    placements = plan.write(out / weights_file)
    graphs = {}
    for name, gb in builders.items():
        model = gb.model(placements)
        onnx.save_model(model, out / f"{name}.onnx")
        onnx.checker.check_model(str(out / f"{name}.onnx"))
        graphs[name] = Graph(file=f"{name}.onnx", nodes=len(model.graph.node), inputs=tuple(value_infos(model.graph.input)),
                             outputs=tuple(value_infos(model.graph.output)))
    return graphs


def gathered_rows(g: GraphBuilder, plan: WeightPlan, stored: str, ids: str) -> str:
    """Rows `ids` of a planned table, widened to fp32 after the Gather, as the target's graphs do:
    a Cast of the whole table ahead of it is folded by ORT into an fp32 copy of the table (1.0 GB
    for Qwen3.5-0.8B's embedding, measured: a drafter session of 1.1 GB for 0.56 GB of weights)."""
    e = plan.entries[stored]
    g.weight(stored, e.shape, e.dtype)
    rows = g.op("Gather", stored, ids, axis=0)
    return rows if e.dtype == np.float32 else g.op("Cast", rows, to=onnx.TensorProto.FLOAT)


def drafter_step_inputs(g: GraphBuilder, hidden: int, nkv: int, hd: int, rotary_dim: int):
    """The step graph's inputs every drafter shares (EAGLE-3's layer and the MTP head run through the
    same runtime K/V and tree code, runtime/drafters/draft_tree.py): features [n, hidden], input_ids [n], rope
    rows (unsqueezed for the heads), the additive mask [n, past + n], past K/V [nKV, past, hd] and
    the rows whose hidden and logits are wanted [m] (their K/V rows come for all n)."""
    f = g.input("features", np.float32, [N, hidden])
    ids = g.input("input_ids", np.int64, [N])
    cos = g.unsqueeze(g.input("rope_cos", np.float32, [N, rotary_dim]), [1])
    sin = g.unsqueeze(g.input("rope_sin", np.float32, [N, rotary_dim]), [1])
    mask = g.input("attn_mask", np.float32, [N, MASK_LEN])
    past_k = g.input("past_key", np.float32, [nkv, PAST, hd])
    past_v = g.input("past_value", np.float32, [nkv, PAST, hd])
    rows = g.input("logit_rows", np.int64, [M])
    return f, ids, cos, sin, mask, past_k, past_v, rows


def write_draft_vocab(out: Path, draft_to_target) -> DraftVocab:
    """VOCAB_FILE in `out`: the target id of each draft id; returns the manifest's "vocab" record
    (runtime/drafters/draft_tree.py read_draft_vocab). EAGLE-3's own vocabulary and a trimmed MTP head's."""
    from safetensors.numpy import save_file

    ids = np.ascontiguousarray(draft_to_target, dtype=np.int64)
    save_file({"draft_to_target": ids}, str(out / VOCAB_FILE))
    return DraftVocab(file=VOCAB_FILE, tensor="draft_to_target", draft_vocab_size=len(ids))
