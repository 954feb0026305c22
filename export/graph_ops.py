"""The op sets a step graph is written in, one per device, chosen once per graph (step_graph.KINDS).

* plain: HTP-safe plain ONNX ops (the NPU-shaped prefill and verify graphs, also run on the CPU);
  the recurrent state comes in per-head units (runtime/pipeline.py: 1 on the CPU).
* npu: plain, with MatMulNBits fed rank-3 ("Unsupported input A rank, expecting 3D" on the HTP).
* cpu: ONNX Runtime's fused CPU kernels (contrib ops the HTP does not have) where they measured
  faster than plain ops: norms, the residual add with the next norm, the one-token conv, the delta
  rule as LinearAttention; the state in real units. Only chains (a tree needs the masked form's
  commit tensors).
* cpu_tree: the CPU's verify graph. A tree needs plain's masked delta rule and conv selections;
  everything else is cpu's (fused norms, Softplus, the gated norm) and the state is in real units.
"""
from __future__ import annotations

from hybrid_npu.kernels.conv import emit_short_conv, emit_short_conv_cpu, emit_short_conv_step_cpu
from hybrid_npu.kernels.delta_rule import emit_gated_delta, emit_gated_delta_cpu
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.kernels.norms import (emit_add_rmsnorm_1p_cpu, emit_gated_rmsnorm, emit_gated_rmsnorm_cpu,
                                      emit_rmsnorm_1p, emit_rmsnorm_1p_cpu)


class PlainOps:
    rank3_matmul = False  # MatMulNBits inputs unsqueezed to 3-D
    state_units = True    # recurrent_scale.{i} inputs: the state and its readout in per-head units
    chain_only = False
    fp16_guards = True    # the delta rule's σ scaling and plain l2 norms (kernels/delta_rule.py)
    state_unit_axis = False  # recurrent_state_out is [1, Hv, Dk, Dv], not [Hv, Dk, Dv]
    tiled_attention = False  # attention over the past in tiles under a Loop (CPU only: runtime Slice starts)

    def __init__(self, g: GraphBuilder, eps: float):
        self.g, self.eps = g, eps

    def norm1p(self, x: str, weight: str) -> str:
        return emit_rmsnorm_1p(self.g, x, weight, self.eps)

    def add_norm1p(self, x: str, delta: str, weight: str) -> tuple[str, str]:
        """(x + delta, its RMSNorm1p)."""
        x = self.g.op("Add", x, delta)
        return x, self.norm1p(x, weight)

    def softplus(self, x: str) -> str:
        return self.g.softplus(x)  # the HTP's own Softplus is off near -2 (kernels/graph.py)

    def gated_norm(self, o: str, z: str, weight: str, *, rows, hv: int, dv: int, unit: str | None) -> str:
        """o [rows, Hv, Dv] in the state's units (unit [Hv, 1, 1] or None), z [rows, Hv·Dv] -> [rows, Hv·Dv]:
        the norm takes eps/u² (u⁻¹ by 1/√u twice, flushed to 0 where negligible)."""
        g, eps_scale = self.g, None
        if unit is not None:
            ru = g.op("Reciprocal", g.op("Sqrt", g.reshape(unit, [hv, 1])))
            ru2 = g.op("Mul", ru, ru)
            eps_scale = g.op("Mul", ru2, ru2)
        normed = emit_gated_rmsnorm(g, o, g.reshape(z, [rows, hv, dv]), weight, self.eps, eps_scale)
        return g.reshape(normed, [rows, hv * dv])

    def short_conv(self, x: str, state: str, w_kc: str, *, n: int, k: int, state_select, tree_select):
        return emit_short_conv(self.g, x, state, w_kc, n, k, state_select, tree_select)

    def state_out(self, S_after: str) -> str:
        """The delta rule's new state as the graph outputs it, after any If."""
        return S_after

    def delta_rule(self, y: str, gate: str, beta: str, S: str, *, n: int, dims, masks, tree: bool,
                   unit: str | None, eye: str | tuple[str, str] | None = None):
        """y [n, 2·Hk·Dk + Hv·Dv] (the conv's q|k|v) -> (o [n, Hv, Dv], S_after, tree commit tensors).
        eye: the call's [n, n] identity where n is None (any count), or its two diagonal blocks
        (kernels/delta_rule.emit_unit_lower_solve)."""
        g, (hk, hv, dk, dv) = self.g, dims
        q, kk, v = g.split(y, [hk * dk, hk * dk, hv * dv], axis=-1)
        rows = -1 if n is None else n  # None: any count (the CPU verify's small trees)
        q, kk, v = g.reshape(q, [rows, hk, dk]), g.reshape(kk, [rows, hk, dk]), g.reshape(v, [rows, hv, dv])
        mask, mask_t, strict = masks
        return emit_gated_delta(g, q, kk, v, gate, beta, S, mask, mask_t, strict, n=n, hk=hk, hv=hv, dk=dk, dv=dv,
                                chain_state=not tree, state_unit=unit, fp16_guards=self.fp16_guards, eye=eye)


class NpuOps(PlainOps):
    rank3_matmul = True


class CpuOps(PlainOps):
    """Measured on Qwen3.5-0.8B int4 head-4 (docs/performance.md): the fused norms and conv took a decode
    step from 3,222 to 2,089 nodes (14.4 -> 17.5 tok/s); LinearAttention from 1,418 to 950 kernels.
    Two fused kernels lost to plain ops and are not used: GatedRMSNorm (3-16x slower) and, for a
    chunk, CausalConvWithState (4x slower)."""
    state_units = False
    chain_only = True
    tiled_attention = True  # no [N, T] scores, no widened copy of the cache (kernels/attention.py)

    def norm1p(self, x: str, weight: str) -> str:
        return emit_rmsnorm_1p_cpu(self.g, x, weight, self.eps)

    def add_norm1p(self, x: str, delta: str, weight: str) -> tuple[str, str]:
        return emit_add_rmsnorm_1p_cpu(self.g, x, delta, weight, self.eps)

    def softplus(self, x: str) -> str:
        return self.g.op("Softplus", x)  # the CPU's own is exact

    # LinearAttention's own [1, Hv, Dk, Dv] goes out as it is: squeezed, ORT copied each layer's
    # state into the graph output (int4 0.8B decode, paired: ~5-8% of a step; docs/performance.md);
    # the host drops the unit axis as a view (runtime/step_inputs.py)
    state_unit_axis = True

    def gated_norm(self, o: str, z: str, weight: str, *, rows, hv: int, dv: int, unit: str | None) -> str:
        return emit_gated_rmsnorm_cpu(self.g, o, z, weight, self.eps, dv)  # o [rows, Hv·Dv] or [rows, Hv, Dv]

    def short_conv(self, x: str, state: str, w_kc: str, *, n: int, k: int, state_select, tree_select):
        if n == 1:  # one token: the op's own new state (the shifted window)
            return emit_short_conv_step_cpu(self.g, x, state, w_kc)
        # a chunk may end in padding, so the new state is picked among the valid tokens
        return emit_short_conv_cpu(self.g, x, state, w_kc, state_select, k)

    def delta_rule(self, y: str, gate: str, beta: str, S: str, *, n: int, dims, masks, tree: bool,
                   unit: str | None, eye: str | tuple[str, str] | None = None):
        """-> (o [n, Hv·Dv], S_after [1, Hv, Dk, Dv], None): ORT's LinearAttention, one token or a chunk."""
        g, (hk, hv, dk, dv) = self.g, dims
        qk, v = g.split(y, [2 * hk * dk, hv * dv], axis=-1)
        o, S_after = emit_gated_delta_cpu(g, qk, v, gate, beta, S, n=n, hk=hk, hv=hv, dk=dk, dv=dv)
        return o, S_after, None


class CpuTreeOps(PlainOps):
    """A token tree on the CPU. Measured on the embedded model, 8-node verify (docs/speculation.md):
    the plain graph ran ~1,800 kernels a call, most of them the HTP-safe norms' and the state units'."""
    state_units = False
    fp16_guards = False
    tiled_attention = True
    norm1p, add_norm1p, softplus, gated_norm = CpuOps.norm1p, CpuOps.add_norm1p, CpuOps.softplus, CpuOps.gated_norm


OP_SETS = {"plain": PlainOps, "npu": NpuOps, "cpu": CpuOps, "cpu_tree": CpuTreeOps}
