"""The one graph family: advance the model by N new tokens given its state (docs/architecture.md).

A graph is one of the Kinds below (KINDS: chain or tree, how many tokens a call brings, the op
set it is written in): a chain (prefill chunk N = C, decode N = 1, the CPU's any-N graph) or a
token tree (verify: the ancestor mask and conv selections come in as inputs, per-node commit
tensors go out). The op set (export/graph_ops.py) is chosen once per graph: ORT's fused CPU
kernels, plain HTP-safe ops, or those for an NPU part. A graph
may cover a contiguous layer range (parts for the NPU): the first part embeds ids, the last
applies the head. The host feeds what is cheap there: rotary cos/sin, the additive attention
mask, the token-validity vector (a padded token writes no state), conv selections.

I/O names (stable; the manifest lists them with shapes):
  in   input_ids [N] int64 | hidden_in [N, H]; token_valid [N]; rope_cos/rope_sin [N, rd];
       attn_mask [N, past_len+N]; conv_state_select [K-1, K-1+N]; last_index [1] int64;
       tree_mask [N, N]; conv_tree_select [K-1, N, K-1+N];
       conv_state.{i} [conv_dim, K-1]; recurrent_state.{i} [Hv, Dk, Dv] fp32, in units of
       recurrent_scale.{i} [Hv] (prefill and verify; 1 = real units; S out and commit u in them too);
       past_key.{i} [nKV, past_len, hd]; past_value.{i} [nKV, hd, past_len] (transposed: the
       decode product reads the values as its rows, kernels/attention.py), in the K/V cache's dtype
       (StepSpec.kv_cache); int8: past_key_scale.{i} / past_value_scale.{i} [nKV, 1, past_len] fp32
  out  logits [1 | N, V] | hidden_out [N, H]; conv_state_out.{i}; recurrent_state_out.{i} (as the
       state, [1, Hv, Dk, Dv] in the CPU op set's graphs: LinearAttention's own output);
       new_key.{i} / new_value.{i} [nKV, N, hd]; tap.{j} [N, H] (residual entering layer j; j = L:
       after the last layer, with StepSpec.final_tap);
       tree only: commit_k.{i} [N, Hv, Dk], commit_u.{i} [N, Hv, Dv], commit_g.{i} [N, Hv],
       pre_conv.{i} [N, conv_dim]
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import onnx

from hybrid_npu.config import LINEAR, ModelConfig
from hybrid_npu.format import KV_CACHES, MASK_DIM, PAST_DIM
from hybrid_npu.kernels.attention import (MASKED, VALUE_ROWS_MAX_N, emit_as_cached, emit_few_rows_attention,
                                          emit_gqa_attention, emit_tiled_gqa_attention, widen_past)
from hybrid_npu.kernels.conv import chain_state_select
from hybrid_npu.kernels.delta_rule import SOLVE_BLOCK, emit_solve_eye_blocks
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.kernels.rope import emit_partial_rope

from .graph_ops import OP_SETS
from .quantize import plan_quantized_linear
from .weights import WeightPlan

PAST, MASK_LEN = PAST_DIM, MASK_DIM


class Kind(Enum):
    PREFILL = "prefill"            # a chain chunk of n tokens (the NPU's parts are cut from it)
    DECODE = "decode"              # one token
    ANY_N = "any_n"                # the CPU's graph: one token (decode) or a chunk of n (prefill) per call,
    #                                the N-specific cores under If and the weight matmuls outside, so one
    #                                session prepacks the weights once
    VERIFY = "verify"              # a token tree of n nodes: every node's logits, taps and commit tensors
    SIZED_VERIFY = "sized_verify"  # the CPU's verify graph: a tree of any 2..n nodes per call; the sizes up
    #                                to ANY_COUNT_MAX share one core built for any count, each larger one of
    #                                tree_sizes has its cores under If, and a count between two sizes is
    #                                padded up to the larger inside them (the weight matmuls run on the real rows)


@dataclass(frozen=True)
class Traits:
    tree: bool   # a token tree (ancestor mask in; every node's logits and commit tensors out), else a chain
    rows: str    # the I/O's token dim: "static" (n), "any" (1 or n per call), "sizes" (any up to n; the cores
    #              run at the smallest of tree_sizes that holds the call)
    ops: str     # the op set on the CPU (graph_ops.OP_SETS); an NPU part takes "npu"
    whole: bool  # the whole model only, never a layer range


ANY_COUNT_MAX = 2 * SOLVE_BLOCK  # the CPU verify's one core for any count takes 2 .. this many nodes (the
#                                 masked solve's two blocks, kernels/delta_rule.emit_unit_lower_solve)

KINDS = {
    Kind.PREFILL: Traits(tree=False, rows="static", ops="plain", whole=False),
    Kind.DECODE: Traits(tree=False, rows="static", ops="cpu", whole=False),
    Kind.ANY_N: Traits(tree=False, rows="any", ops="cpu", whole=True),
    Kind.VERIFY: Traits(tree=True, rows="static", ops="plain", whole=False),
    Kind.SIZED_VERIFY: Traits(tree=True, rows="sizes", ops="cpu_tree", whole=True),
}


@dataclass(frozen=True)
class StepSpec:
    kind: Kind
    n: int                            # new tokens per call (static; the largest for any / sizes)
    first_layer: int = 0
    end_layer: int | None = None      # exclusive; None = all layers
    npu: bool = False                 # an NPU part: the "npu" op set
    tree_sizes: tuple[int, ...] = ()  # SIZED_VERIFY: the tree sizes, the largest n
    kv_cache: str = "fp32"            # the past K/V inputs' dtype (format.KV_CACHES; int8 adds their scales)
    final_tap: bool = False           # also tap.{L}: the residual after the last layer (before the final
    #                                   norm), every row: what an MTP drafter reads (export/drafters/mtp.py)
    after_attention: bool = False     # a tiled NPU segment: the first layer's attention core ran on the host
    #                                   (in: hidden_in = the residual entering it, attn_out/attn_gate)
    to_attention: bool = False        # a tiled NPU segment: stop at the last layer's attention core (out:
    #                                   hidden_out = the residual entering it, attn_q, attn_gate, new K/V)

    def __post_init__(self):
        t = self.traits
        if t.whole and (self.first_layer or self.end_layer is not None):
            raise ValueError(f"a {self.kind.value} graph is the whole model's")
        if self.npu and t.ops != "plain":
            raise ValueError(f"a {self.kind.value} graph runs on the CPU only (its ops are ORT's CPU kernels)")
        if (self.after_attention or self.to_attention) and (self.kind != Kind.PREFILL or not self.npu):
            raise ValueError("only an NPU prefill part is cut at the attention cores")
        if self.kind == Kind.DECODE and self.n != 1:
            raise ValueError("a decode graph takes one token")
        if self.kind == Kind.ANY_N and self.n < 2:
            raise ValueError("the any-N graph's chunk n is > 1")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache {self.kv_cache!r}: one of {', '.join(KV_CACHES)}")
        if self.npu and self.kv_cache == "int8":
            raise ValueError("an NPU part reads an fp16 or fp32 K/V cache, not int8")
        if (self.kind == Kind.SIZED_VERIFY) != bool(self.tree_sizes) or self.tree_sizes and (
                max(self.tree_sizes) != self.n or min(self.tree_sizes) < 2):
            raise ValueError("tree_sizes is the sized verify graph's (and only its), sizes >= 2 up to n")

    @property
    def traits(self) -> Traits:
        return KINDS[self.kind]

    @property
    def all_logits(self) -> bool:  # a tree's every node is a candidate; a chain needs only last_index's
        return self.traits.tree

    def layers(self, cfg: ModelConfig) -> range:
        return range(self.first_layer, cfg.num_layers if self.end_layer is None else self.end_layer)


class _Builder:
    def __init__(self, cfg: ModelConfig, plan: WeightPlan, spec: StepSpec, name: str):
        self.cfg, self.plan, self.spec, self.traits = cfg, plan, spec, spec.traits
        self.g = GraphBuilder(name)
        self.ops = OP_SETS["npu" if spec.npu else self.traits.ops](self.g, cfg.rms_norm_eps)
        self.n = spec.n
        self.rows = spec.n if self.traits.rows == "static" else "n"  # N in the graph's I/O shapes
        self.padding = False  # inside a case whose cores take their rows padded (rows "sizes")

    def declare(self, stored: str) -> str:
        entry = self.plan.entries[stored]
        self.g.weight(stored, entry.shape, entry.dtype)
        return stored

    def w(self, stored: str) -> str:
        """Declare a stored weight in this graph; fp16-stored matrices are widened (folded at load)."""
        if self.plan.entries[self.declare(stored)].dtype == np.float32:
            return stored
        return self.g.op("Cast", stored, to=onnx.TensorProto.FLOAT)

    def linear(self, x: str, name: str, sources: list[str], in_dim: int, out_dims: list[int], quantize: bool = True,
               bits: int | None = None) -> list[str]:
        """Gemm(transB=1) over the stored float matrix, or MatMulNBits over its block-quantised form."""
        q = self.plan.quant if quantize else None
        if q is None:
            y = self.g.op("Gemm", x, self.w(self.plan.linear_weight(name, sources, in_dim, out_dims)), transB=1)
        else:
            ql = plan_quantized_linear(self.plan, name, sources, in_dim, out_dims, bits or q.bits, q)
            rank3 = self.ops.rank3_matmul
            y = self.g.matmul_nbits(self.g.unsqueeze(x, [0]) if rank3 else x, self.declare(ql.b),
                                    self.declare(ql.scales), self.declare(ql.zero_points) if ql.zero_points else None,
                                    k=ql.k, n=ql.n, bits=ql.bits, block_size=ql.block_size)
            y = self.g.op("Squeeze", y, self.g.ints([0])) if rank3 else y
        return [y] if len(out_dims) == 1 else self.g.split(y, out_dims, axis=-1)

    def norm1p(self, x: str, src: str, size: int) -> str:
        return self.ops.norm1p(x, self.w(self.plan.vector(src, size)))

    def add_norm1p(self, x: str, delta: str | None, src: str) -> tuple[str, str]:
        """(x + delta, its RMSNorm1p): the residual add and the next norm (one node on the CPU)."""
        if delta is None:
            return x, self.norm1p(x, src, self.cfg.hidden_size)
        return self.ops.add_norm1p(x, delta, self.w(self.plan.vector(src, self.cfg.hidden_size)))

    def per_call(self, core, token_axes: tuple[int, ...] = ()) -> list[str]:
        """core(m) -> output names for m new tokens, for the token counts a call may bring: n (static),
        1 or n under If (any), one of the tree sizes or, padded up to the smallest that holds it, any
        count up to n (sizes; m None: the one core for any count up to ANY_COUNT_MAX, its shapes the
        call's); the case by self._by_count. A padded case's core pads its per-token
        inputs (self.pad_rows) and its outputs are cut back to the call's rows (token_axes)."""
        g = self.g
        if self.traits.rows == "static":
            return core(self.n)

        def cut(m: int) -> list[str]:
            outs = core(m)
            if not self.padding:
                return outs
            return [g.op("Slice", o, g.ints([0]), self.count, g.ints([axis])) for o, axis in zip(outs, token_axes)]
        return self._by_count(cut)

    def _by_count(self, body) -> list[str]:
        """body(m) for the case (self.cases: the counts it takes, m, padded) the call's count falls in,
        under Ifs that halve the cases (a call passes log2(cases) of them, not one per case before
        its own), with self.padding set while each case's body is emitted."""
        g = self.g

        def within(lo: int, hi: int) -> list[str]:
            if hi - lo == 1:
                _, m, self.padding = self.cases[lo]
                return body(m)
            mid = (lo + hi) // 2
            with g.capture() as low:
                outs = within(lo, mid)
            with g.capture() as high:
                rest = within(mid, hi)
            top = self.cases[mid - 1][0][1]  # the largest count the lower half takes
            return g.if_(self.count_at_most[top], (low, outs), (high, rest))
        try:
            return within(0, len(self.cases))
        finally:
            self.padding = False

    def pad_rows(self, x: str, m: int, axis: int, rank: int, value: float = 0.0) -> str:
        """x with its token axis padded up to m rows inside a padded case (else x itself). A padded
        node is zeros: no conv input, key or query, beta and decay 0, an ancestor of none."""
        if not self.padding:
            return x
        return self.g.op("Pad", x, self.pads[(m, rank, axis)], self.g.const(value))

    def _count_cases(self, ids: str) -> None:
        """The cases a call's token count selects, each ((fewest, most) counts it takes, m, padded):
        any: 1, or n. sizes: a size right above the one before it takes its own count (no padding);
        one further apart takes every count above the size before it, padded up to it (its own
        count too: one core less to build and load, and at 16 nodes a zero pad is no cost)."""
        self.count = self.g.op("Shape", ids, start=0, end=1)
        if self.traits.rows == "any":
            self.cases = [((1, 1), 1, False), ((2, self.n), self.n, False)]
        else:
            self.cases, below = [], 1  # a tree has its root and at least one draft node
            for m in sorted(self.spec.tree_sizes):
                self.cases.append(((below + 1, m), m, m > below + 1))
                below = m
            # the exact sizes up to ANY_COUNT_MAX share one core built for any count (m None): each If
            # level a call passes costs every layer a subgraph frame (0.8B int4, 24 layers: the three
            # levels to a 2-4 node core were 2.3-2.8 ms of a 32-44 ms verify)
            # (a padded size too: a core for any count takes its counts as they come, unpadded)
            small = [case for case in self.cases if case[1] <= ANY_COUNT_MAX]
            if len(small) > 1 and small == self.cases[:len(small)]:
                self.cases[:len(small)] = [((small[0][0][0], small[-1][0][1]), None, False)]
        # every split's condition once a call, in the main graph (each layer's Ifs read them); any: count == 1
        test = "Equal" if self.traits.rows == "any" else "LessOrEqual"
        self.count_at_most = {most: self.g.op(test, self.count, self.g.ints([most])) for (_, most), _, _ in self.cases[:-1]}
        self.pads = {}
        for m in sorted({m for _, m, padded in self.cases if padded}):
            amount = self.g.op("Sub", self.g.ints([m]), self.count)
            for rank, axis in ((2, 0), (2, 1), (3, 0), (3, 1), (3, 2)):
                after = [self.g.ints([0] * (rank - axis - 1))] if axis < rank - 1 else []
                self.pads[(m, rank, axis)] = self.g.op("Concat", self.g.ints([0] * (rank + axis)), amount, *after,
                                                       axis=0)

    def gdn_rows(self, m: int) -> tuple:
        """(validity, ancestor masks, conv tree selections) as a GDN core of m rows reads them."""
        p = self.pad_rows
        masks = self.masks and tuple(p(p(t, m, 0, 2), m, 1, 2) if t else t for t in self.masks)
        if isinstance(self.tree_select, list):  # the taps' selections [N, K-1+N], picked in the main graph
            select = [p(p(t, m, 0, 2), m, 1, 2) for t in self.tree_select]
        else:
            select = self.tree_select and p(p(self.tree_select, m, 1, 3), m, 2, 3)
        return self.valid and p(self.valid, m, 0, 2), masks, select

    def attention_rows(self, m: int) -> tuple:
        """(rotary cos, sin, additive mask) as an attention core of m rows reads them; a padded key
        is hidden from every query."""
        p = self.pad_rows
        return p(self.cos, m, 0, 3), p(self.sin, m, 0, 3), p(p(self.attn_mask, m, 0, 2), m, 1, 2, MASKED)

    # ---------------------------------------------------------------- graph
    def build(self) -> GraphBuilder:
        c, g, n, spec = self.cfg, self.g, self.rows, self.spec
        layers = spec.layers(c)
        gdn_layers = [i for i in layers if c.layer_types[i] == LINEAR]
        attn_layers = [i for i in layers if c.layer_types[i] != LINEAR]
        resumed = layers.start if spec.after_attention else None  # its core ran on the host
        stopped = layers.stop - 1 if spec.to_attention else None  # its core runs on the host next
        cores = [i for i in attn_layers if i not in (resumed, stopped)]  # read the past K/V in this graph
        if spec.first_layer == 0 and resumed is None:
            ids = g.input("input_ids", np.int64, [n])
            if self.traits.rows != "static":  # which cores run: by the call's token count
                self._count_cases(ids)
            table = self.plan.table("embed_tokens.weight", (c.vocab_size, c.hidden_size))
            if not self.plan.quantizable:
                x = g.op("Gather", self.w(table), ids, axis=0)
            else:  # gather the fp16 rows, then widen: the table is never widened (nor read) whole
                x = g.op("Cast", g.op("Gather", self.declare(table), ids, axis=0), to=onnx.TensorProto.FLOAT)
        else:
            x = g.input("hidden_in", np.float32, [n, c.hidden_size])
        self.valid = None
        if gdn_layers and self.n > 1:
            self.valid = g.unsqueeze(g.input("token_valid", np.float32, [n]), [1])
            if self.traits.rows == "any":  # a one-token call need not feed it (its default: valid)
                g.initializers["token_valid"] = np.ones(1, np.float32)
        self.attn_mask = None
        if cores or stopped is not None:
            rd = c.rotary_dim
            self.cos = g.unsqueeze(g.input("rope_cos", np.float32, [n, rd]), [1])
            self.sin = g.unsqueeze(g.input("rope_sin", np.float32, [n, rd]), [1])
        if cores:
            self.attn_mask = g.input("attn_mask", np.float32, [n, MASK_LEN])
        if gdn_layers:
            self._gdn_selections()
        down = None  # the last MLP's output, added to the residual together with the next norm
        for i in layers:
            p = f"layers.{i}."
            if i == resumed:
                mixed = self.attention_after_core(i)
            else:
                x, h = self.add_norm1p(x, down, p + "input_layernorm.weight")
                if i in c.tap_layers:
                    g.output(x, f"tap.{i}", np.float32, [n, c.hidden_size])
                if i == stopped:
                    self.attention_to_core(h, i)
                    g.output(x, "hidden_out", np.float32, [n, c.hidden_size])
                    return g
                mixed = self.gdn(h, i) if c.layer_types[i] == LINEAR else self.attention(h, i)
            x, h = self.add_norm1p(x, mixed, p + "post_attention_layernorm.weight")
            gate, up = self.linear(h, p + "mlp.gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                   c.hidden_size, [c.intermediate_size] * 2)
            down = self.linear(g.op("Mul", g.silu(gate), up), p + "mlp.down_proj", [p + "mlp.down_proj.weight"],
                               c.intermediate_size, [c.hidden_size])[0]
        if down is not None:
            x = g.op("Add", x, down)
        if layers.stop == c.num_layers and spec.final_tap:
            g.output(x, f"tap.{c.num_layers}", np.float32, [n, c.hidden_size])
        if layers.stop == c.num_layers:
            self.head(x)
        else:
            g.output(x, "hidden_out", np.float32, [n, c.hidden_size])
        return g

    def _gdn_selections(self):
        """The conv's selections (host inputs) and the masked delta rule's masks (none on the CPU ops)."""
        c, g, n = self.cfg, self.g, self.n
        k = c.linear_conv_kernel_dim
        self.state_select = self.tree_select = None
        self.masks = self.eye = None
        if self.traits.tree:
            m = g.input("tree_mask", np.float32, [self.rows, self.rows])
            if self.traits.rows == "sizes":  # the diagonal of whatever size the call brings
                eye = g.op("EyeLike", m)
                strict = g.op("Sub", m, g.op("Mul", m, eye))
                self.eye = eye  # the any-count core's solve: over SOLVE_BLOCK nodes, its two diagonal blocks
                if self.cases[0][1] is None and self.cases[0][0][1] > SOLVE_BLOCK:
                    self.eye = emit_solve_eye_blocks(g, eye)
            else:
                strict = g.op("Mul", m, g.const(1.0 - np.eye(n, dtype=np.float32)))
            self.masks = (m, g.transpose(m, [1, 0]), strict)
            self.tree_select = g.input("conv_tree_select", np.float32, [k - 1, n, k - 1 + n]
                                       if self.traits.rows == "static" else [k - 1, "n", "k_minus_1_plus_n"])
            if self.traits.rows == "sizes":  # each tap's selection once a call, not once a layer under its Ifs
                self.tree_select = [g.op("Gather", self.tree_select, g.const(np.int64(s), np.int64), axis=0)
                                    for s in range(k - 1)]
            return
        if not self.ops.chain_only:
            causal = np.tril(np.ones((n, n), dtype=np.float32))
            self.masks = (g.const(causal), g.const(causal.T), g.const(np.tril(causal, -1)) if n > 1 else None)
        if n > 1:
            any_n = self.traits.rows == "any"
            self.state_select = g.input("conv_state_select", np.float32, [k - 1, "k_minus_1_plus_n" if any_n
                                                                         else k - 1 + n])
            if any_n:  # a one-token call does not read it; the default keeps the feed optional
                g.initializers["conv_state_select"] = chain_state_select(1, 1, k)

    def gdn(self, h: str, i: int) -> str:
        c, g, n = self.cfg, self.g, self.rows
        a = f"layers.{i}.linear_attn."
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        k = c.linear_conv_kernel_dim
        sources = [a + s + ".weight" for s in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
        if not self.plan.quantizable:
            qkv, z, b, a_in = self.linear(h, a + "in_proj_all", sources, c.hidden_size, [c.conv_dim, hv * dv, hv, hv])
        else:  # b and a stay float: they set beta and the decay that the recurrent state compounds every
            # token, and they are tiny (2·Hv rows)
            qkv, z = self.linear(h, a + "in_proj_qkvz", sources[:2], c.hidden_size, [c.conv_dim, hv * dv])
            b, a_in = self.linear(h, a + "in_proj_ba", sources[2:], c.hidden_size, [hv, hv], quantize=False)
        conv_state = g.input(f"conv_state.{i}", np.float32, [c.conv_dim, k - 1])
        S = g.input(f"recurrent_state.{i}", np.float32, [hv, dk, dv])
        conv_w = self.w(self.plan.conv_weight(a + "conv1d.weight", c.conv_dim, k))
        if self.traits.rows == "sizes":  # the taps' rows sliced outside the Ifs, where ORT folds them
            conv_w = [g.slice(conv_w, j, j + 1, axis=0) for j in range(k)]
        beta = g.op("Sigmoid", b)
        # g = -exp(A_log) * softplus(a + dt_bias)
        a_in = g.op("Add", a_in, self.w(self.plan.vector(a + "dt_bias", hv)))
        decay = g.op("Mul", g.op("Neg", g.op("Exp", self.w(self.plan.vector(a + "A_log", hv)))), self.ops.softplus(a_in))
        unit = None
        if self.ops.state_units:  # the state comes in per-head units (runtime/pipeline.py: 1 on the CPU; on
            # the NPU chosen so no value beyond fp16 enters the HTP). A plain input, not an initializer
            # default: QNN context binaries drop those
            unit = g.reshape(g.input(f"recurrent_scale.{i}", np.float32, [hv]), [hv, 1, 1])

        def core(m: int) -> list[str]:
            rows = [self.pad_rows(t, m, 0, 2) for t in (qkv, beta, decay)]
            o, new_conv, S_after, commit = self._gdn_core(rows[0], conv_state, conv_w, S, *rows[1:], n=m, unit=unit)
            return [o, *commit] if self.traits.tree else [o, new_conv, S_after]
        o, *rest = self.per_call(core, (0, 0, 0, 0))  # o, commit k, u, g: token-major
        if self.traits.tree:
            ck, cu, cg = rest
            g.output(ck, f"commit_k.{i}", np.float32, [n, hv, dk])
            g.output(cu, f"commit_u.{i}", np.float32, [n, hv, dv])
            g.output(cg, f"commit_g.{i}", np.float32, [n, hv])
            g.output(qkv, f"pre_conv.{i}", np.float32, [n, c.conv_dim])
        else:
            new_conv, S_after = rest
            g.output(new_conv, f"conv_state_out.{i}", np.float32, [c.conv_dim, k - 1])
            g.output(self.ops.state_out(S_after), f"recurrent_state_out.{i}", np.float32,
                     [1, hv, dk, dv] if self.ops.state_unit_axis else [hv, dk, dv])
        norm_w = self.w(self.plan.vector(a + "norm.weight", dv))
        normed = self.ops.gated_norm(o, z, norm_w, rows=n if self.traits.rows == "static" else -1, hv=hv, dv=dv,
                                     unit=unit)
        return self.linear(normed, a + "out_proj", [a + "out_proj.weight"], hv * dv, [c.hidden_size])[0]

    def _gdn_core(self, qkv, conv_state, conv_w, S, beta, decay, *, n: int, unit: str | None):
        """The short conv and the delta rule over n tokens: (o, conv state out, S_after, tree commit
        tensors); o as the op set's gated_norm takes it."""
        c = self.cfg
        dims = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        valid, masks, tree_select = self.gdn_rows(n)
        y, new_conv = self.ops.short_conv(qkv, conv_state, conv_w, n=n, k=c.linear_conv_kernel_dim,
                                          state_select=self.state_select, tree_select=tree_select)
        if valid is not None and (n is None or n > 1):  # a padded token neither decays nor writes the state
            beta, decay = self.g.op("Mul", beta, valid), self.g.op("Mul", decay, valid)
        o, S_after, commit = self.ops.delta_rule(y, decay, beta, S, n=n, dims=dims, masks=masks,
                                                 tree=self.traits.tree, unit=unit, eye=self.eye if n is None else None)
        return o, new_conv, S_after, commit

    def attention(self, h: str, i: int) -> str:
        c, g, n = self.cfg, self.g, self.rows
        a = f"layers.{i}.self_attn."
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = self.linear(h, a + "qkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                               c.hidden_size, [2 * nh * hd, nkv * hd, nkv * hd])
        kv, dtype = self.spec.kv_cache, KV_CACHES[self.spec.kv_cache]
        past = (g.input(f"past_key.{i}", dtype, [nkv, PAST, hd]),
                g.input(f"past_value.{i}", dtype, [nkv, hd, PAST]))  # transposed (kernels/attention.py)
        scales = (g.input(f"past_key_scale.{i}", np.float32, [nkv, 1, PAST]),
                  g.input(f"past_value_scale.{i}", np.float32, [nkv, 1, PAST])) if kv == "int8" else (None, None)
        if not self.ops.tiled_attention and kv != "fp32":  # the whole past widened once a layer
            past, scales = widen_past(g, *past, *scales), (None, None)
        gated, new_k, new_v = self.per_call(
            lambda m: list(self._attention_core(*(self.pad_rows(t, m, 0, 2) for t in (qg, k, v)), *past, a, n=m,
                                                scales=scales)),
            (0, 1, 1))
        g.output(new_k, f"new_key.{i}", np.float32, [nkv, n, hd])
        g.output(new_v, f"new_value.{i}", np.float32, [nkv, n, hd])
        return self.linear(gated, a + "o_proj", [a + "o_proj.weight"], nh * hd, [c.hidden_size])[0]

    def _attention_inputs(self, qg, k, v, a: str, n: int):
        """The projections -> (q [n, nH, hd] normed and rotated, gate [n, nH·hd], new K, new V [nKV, n, hd])."""
        c, g = self.cfg, self.g
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rows = -1 if n is None else n  # None: any count (_count_cases)
        q, gate = g.split(g.reshape(qg, [rows, nh, 2 * hd]), [hd, hd], axis=-1)  # interleaved per head (docs/qwen35-model.md trap 2)
        cos, sin, _ = self.attention_rows(n)
        q = emit_partial_rope(g, self.norm1p(q, a + "q_norm.weight", hd), cos, sin, hd, c.rotary_dim)
        k = emit_partial_rope(g, self.norm1p(g.reshape(k, [rows, nkv, hd]), a + "k_norm.weight", hd),
                              cos, sin, hd, c.rotary_dim)
        new_k, new_v = g.transpose(k, [1, 0, 2]), g.transpose(g.reshape(v, [rows, nkv, hd]), [1, 0, 2])
        return q, g.reshape(gate, [rows, nh * hd]), new_k, new_v

    def _attention_core(self, qg, k, v, past_k, past_v, a: str, *, n: int, scales=(None, None)):
        """Gated attention over n new tokens after the projections: (gated [n, Hq·hd], new K, new V)."""
        c, g = self.cfg, self.g
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rows = -1 if n is None else n
        q, gate, new_k, new_v = self._attention_inputs(qg, k, v, a, n)
        mask = self.attention_rows(n)[2]
        # the CPU graphs take the new rows as the cache will hold them (kernels/attention.emit_as_cached:
        # why); the NPU-shaped graphs, which the HTP computes in fp16 whatever the cache, as they are
        kv = self.spec.kv_cache if self.ops.tiled_attention else "fp32"
        seen_k, seen_v = emit_as_cached(g, new_k, kv), emit_as_cached(g, new_v, kv)
        # tiles wherever a call would otherwise hold per-context memory: a chunk's [N, T] scores, or a
        # widened copy of an fp16 / int8 cache; a few rows over an fp32 cache read it in place untiled
        # (decode: a Loop's tile copies took 3.2x the attention time at 8k, docs/kv-cache.md), over an
        # fp16 / int8 cache widen a bounded past whole (kernels/attention.WIDEN_ROWS)
        few, widen = n is None or n <= VALUE_ROWS_MAX_N, self.spec.kv_cache != "fp32"
        if self.ops.tiled_attention and few and widen:
            attn = emit_few_rows_attention(g, q, past_k, past_v, seen_k, seen_v, mask, n=n, nh=nh, nkv=nkv, hd=hd,
                                           k_scale=scales[0], v_scale=scales[1])
        elif self.ops.tiled_attention and not few:
            attn = emit_tiled_gqa_attention(g, q, past_k, past_v, seen_k, seen_v, mask, n=n, nh=nh, nkv=nkv, hd=hd,
                                            widen=widen, k_scale=scales[0], v_scale=scales[1])
        else:
            attn = emit_gqa_attention(g, q, past_k, past_v, seen_k, seen_v, mask, n=n, nh=nh, nkv=nkv, hd=hd)
        gated = g.op("Mul", g.reshape(attn, [rows, nh * hd]), g.op("Sigmoid", gate))
        return gated, new_k, new_v

    def attention_to_core(self, h: str, i: int) -> None:
        """A tiled segment's end: what the host's tile calls read (kernels/attention_tile.py) and what the
        next segment takes back. attn_q holds query head k·G + j's rows at j·n.. of KV head k."""
        c, g, n = self.cfg, self.g, self.n
        a = f"layers.{i}.self_attn."
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = self.linear(h, a + "qkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                               c.hidden_size, [2 * nh * hd, nkv * hd, nkv * hd])
        q, gate, new_k, new_v = self._attention_inputs(qg, k, v, a, n)
        grouped = g.reshape(g.transpose(q, [1, 0, 2]), [nkv, nh // nkv * n, hd])
        g.output(grouped, f"attn_q.{i}", np.float32, [nkv, nh // nkv * n, hd])
        g.output(gate, f"attn_gate.{i}", np.float32, [n, nh * hd])
        g.output(new_k, f"new_key.{i}", np.float32, [nkv, n, hd])
        g.output(new_v, f"new_value.{i}", np.float32, [nkv, n, hd])

    def attention_after_core(self, i: int) -> str:
        """A tiled segment's start: the host's attention output back in token order, gated, projected."""
        c, g, n = self.cfg, self.g, self.n
        a = f"layers.{i}.self_attn."
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        out = g.input(f"attn_out.{i}", np.float32, [nkv, nh // nkv * n, hd])
        gate = g.input(f"attn_gate.{i}", np.float32, [n, nh * hd])
        attn = g.reshape(g.transpose(g.reshape(out, [nh, n, hd]), [1, 0, 2]), [n, nh * hd])
        gated = g.op("Mul", attn, g.op("Sigmoid", gate))
        return self.linear(gated, a + "o_proj", [a + "o_proj.weight"], nh * hd, [c.hidden_size])[0]

    def head(self, x: str) -> None:
        c, g = self.cfg, self.g
        if not self.spec.all_logits:
            x = g.op("Gather", x, g.input("last_index", np.int64, [1]), axis=0)
        h = self.norm1p(x, "norm.weight", c.hidden_size)
        rows = self.rows if self.spec.all_logits else 1
        if self.plan.quantizable:  # its own copy when tied; int8 under MatMulNBits (QuantSpec.head_bits)
            src = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
            bits = self.plan.quant.head_bits if self.plan.quant is not None else None
            logits = self.linear(h, "lm_head", [src], c.hidden_size, [c.vocab_size], bits=bits)[0]
        elif c.tie_word_embeddings:  # docs/qwen35-model.md trap 6: tie explicitly to the embedding table
            table = self.w(self.plan.table("embed_tokens.weight", (c.vocab_size, c.hidden_size)))
            logits = g.op("Gemm", h, table, transB=1)
        else:
            logits = g.op("Gemm", h, self.w(self.plan.linear_weight("lm_head", ["lm_head.weight"], c.hidden_size,
                                                                    [c.vocab_size])), transB=1)
        g.output(logits, "logits", np.float32, [rows, c.vocab_size])


def build_step_graph(cfg: ModelConfig, plan: WeightPlan, spec: StepSpec, name: str) -> GraphBuilder:
    return _Builder(cfg, plan, spec, name).build()
