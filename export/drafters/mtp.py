"""The checkpoint's own MTP head as a drafter: read `mtp.*` and export it to ONNX for the CPU.

Wiring (docs/mtp-drafter.md; vLLM's qwen3_5_mtp.py, llama.cpp's qwen35 MTP), one MTP layer, every
norm a zero-centred x̂·(1+w) RMSNorm as in the target:
    h   = norm(r)                    r: the target's residual after its last layer (tap.{L});
                                     norm: the target's final norm, so h is the post-norm hidden
    x   = fc([pre_fc_norm_embedding(embed(t)) ; pre_fc_norm_hidden(h)])    [N, 2H] -> [N, H]
    x   = x + o_proj(attn(input_layernorm(x)) · sigmoid(gate))           own K/V, q/k norms, partial RoPE
    x   = x + mlp(post_attention_layernorm(x))
    out = mtp.norm(x):   logits = lm_head(out);   out is the hidden of the next chained step
The pair (h at position p, token p+1) sits at MTP position p and predicts token p+2.

Graphs (same I/O names as the EAGLE-3 drafter's, so runtime/drafters/draft_tree.py's K/V, window and tree code
serve both; runtime/drafters/mtp.py):
  mtp_in.onnx   taps [N, H] (tap.{L})  -> features [N, H]  (the target's final norm)
  mtp.onnx      features [N, H], input_ids [N], rope_cos/rope_sin [N, rd], attn_mask [N, past+N],
                past_key/past_value [nKV, past, hd], logit_rows [M]
                -> logits [M, V] (a trimmed head: [M, Vd]), hidden [M, H] (mtp.norm(x)) of the rows `logit_rows` only,
                   new_key/new_value [nKV, N, hd] of every row (a row's K/V depends on it alone)
The embedding and lm_head are the target's, copied into the drafter's weights (see the doc for
what that costs at real size).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_FORMAT, MTP_KIND as KIND
from hybrid_npu.kernels.attention import emit_dynamic_gqa
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.kernels.norms import emit_rmsnorm_1p_cpu
from hybrid_npu.kernels.rope import emit_partial_rope
from hybrid_npu.manifest import DrafterManifest

from .shared import (drafter_linear, drafter_step_inputs, drafter_weight_plan, gathered_rows, weight_input,
                     weights_entry, write_draft_vocab, write_drafter_files)
from ..safetensors_io import SafetensorsFile
from ..weights import WeightPlan

WEIGHTS_FILE = "mtp_weights.bin"
IN_GRAPH, STEP_GRAPH = "mtp_in", "mtp"
N, M = "n", "m"
P = "mtp."
A, MLP = P + "layers.0.self_attn.", P + "layers.0.mlp."
DRAFT_HEAD = "draft_head.weight"  # a trimmed head's rows of the target's lm_head (trim_head)


@dataclass(frozen=True)
class MtpConfig:
    """The target's dimensions the head uses (the MTP layer is a target full-attention layer)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    num_layers: int        # the target's L: the head reads tap.{L}

    @classmethod
    def of(cls, cfg: ModelConfig) -> "MtpConfig":
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.vocab_size, cfg.num_layers)


@dataclass
class MtpCheckpoint:
    source: Path
    config: MtpConfig
    shapes: dict[str, tuple[int, ...]]
    loaders: dict[str, Callable[[], np.ndarray]] = field(repr=False)
    draft_ids: np.ndarray | None = field(default=None, repr=False)  # a trimmed head's target ids (trim_head)

    def load(self, name: str) -> np.ndarray:
        arr = np.asarray(self.loaders[name]())
        if tuple(arr.shape) != tuple(self.shapes[name]):
            raise UserError(f"MTP tensor {name}: data has shape {tuple(arr.shape)}, expected {self.shapes[name]}")
        return arr


def expected_shapes(c: MtpConfig) -> dict[str, tuple[int, ...]]:
    """The `mtp.*` tensors of a one-layer head and their shapes (the released Qwen3.5 names)."""
    H, I, nh, nkv, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layer = P + "layers.0."
    return {P + "fc.weight": (H, 2 * H), P + "pre_fc_norm_embedding.weight": (H,),
            P + "pre_fc_norm_hidden.weight": (H,), P + "norm.weight": (H,),
            layer + "input_layernorm.weight": (H,), layer + "post_attention_layernorm.weight": (H,),
            A + "q_proj.weight": (2 * nh * hd, H), A + "k_proj.weight": (nkv * hd, H),
            A + "v_proj.weight": (nkv * hd, H), A + "o_proj.weight": (H, nh * hd),
            A + "q_norm.weight": (hd,), A + "k_norm.weight": (hd,),
            MLP + "gate_proj.weight": (I, H), MLP + "up_proj.weight": (I, H), MLP + "down_proj.weight": (H, I)}


def _mtp_tensors_of(path: Path) -> tuple[dict, dict]:
    """`mtp.*` shapes and loaders from a directory's *.safetensors (a head trained apart from its target)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors with the MTP head's mtp.* tensors")
    shapes, loaders = {}, {}
    for f in files:
        st = SafetensorsFile(f)
        for name in st.names():
            if name.startswith(P):
                shapes[name], loaders[name] = st.shape(name), (lambda st=st, name=name: st.load(name))
    return shapes, loaders


def read_mtp(ck, source=None) -> MtpCheckpoint:
    """The MTP head of checkpoint `ck` (export/checkpoint.Checkpoint), or of `source` (a directory whose
    safetensors hold `mtp.*` for this target), with the target's embedding, lm_head and final norm."""
    cfg = MtpConfig.of(ck.config)
    where = Path(source) if source is not None else ck.path
    shapes, loaders = _mtp_tensors_of(where) if source is not None else (dict(ck.mtp_shapes), dict(ck.mtp_loaders))
    if not shapes:
        raise UserError(f"{where} has no MTP head (no mtp.* tensors) to draft with; export without --drafter mtp, "
                        "or give an EAGLE-3 drafter checkpoint: --drafter DIR")
    text = ck.raw_config.get("text_config", ck.raw_config) if source is None else {}
    layers = int(text.get("mtp_num_hidden_layers", 1) or 1)
    extra = sorted({n.split(".")[2] for n in shapes if n.startswith(P + "layers.")} - {"0"})
    if layers != 1 or extra:
        raise UserError(f"{where}: the MTP head has {layers if layers != 1 else 1 + len(extra)} layers; "
                        "only one-layer heads (every released Qwen3.5) are supported")
    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            raise UserError(f"MTP tensor {name} is missing from {where}; is this a Qwen3.5 MTP head?")
        if tuple(shapes[name]) != want:
            raise UserError(f"MTP tensor {name} has shape {tuple(shapes[name])}, the target's config implies {want}; "
                            "this MTP head belongs to another model")
    target = ["embed_tokens.weight", "norm.weight"] + ([] if ck.config.tie_word_embeddings else ["lm_head.weight"])
    for name in target:
        shapes[name], loaders[name] = ck.shapes[name], (lambda name=name: ck.load(name))
    return MtpCheckpoint(source=where, config=cfg, shapes=shapes, loaders=loaders)


# ---------------------------------------------------------------------------------------- graphs
class _Graphs:
    def __init__(self, ck: MtpCheckpoint, plan: WeightPlan):
        self.ck, self.c, self.plan = ck, ck.config, plan

    def w(self, g: GraphBuilder, stored: str) -> str:
        return weight_input(g, self.plan, stored)

    def norm(self, g, x: str, name: str) -> str:
        w = self.w(g, self.plan.vector(name, self.ck.shapes[name][0]))
        return emit_rmsnorm_1p_cpu(g, x, w, self.c.rms_norm_eps)

    def linear(self, g, x: str, name: str, sources: list[str], head: bool = False) -> list[str]:
        outs = [self.ck.shapes[s][0] for s in sources]
        y = drafter_linear(g, self.plan, x, name, sources, self.ck.shapes[sources[0]][1], outs, head)
        return [y] if len(outs) == 1 else g.split(y, outs, axis=-1)

    def hidden_in(self) -> GraphBuilder:
        """tap.{L} [N, H] -> the target's post-norm hidden [N, H]."""
        g = GraphBuilder(IN_GRAPH)
        x = g.input("taps", np.float32, [N, self.c.hidden_size])
        g.output(self.norm(g, x, "norm.weight"), "features", np.float32, [N, self.c.hidden_size])
        return g

    def step(self) -> GraphBuilder:
        c, g = self.c, GraphBuilder(STEP_GRAPH)
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h, ids, cos, sin, mask, past_k, past_v, rows = drafter_step_inputs(g, H, nkv, hd, c.rotary_dim)
        table = self.plan.table("embed_tokens.weight", self.ck.shapes["embed_tokens.weight"])
        e = self.norm(g, gathered_rows(g, self.plan, table, ids), P + "pre_fc_norm_embedding.weight")
        x = g.op("Concat", e, self.norm(g, h, P + "pre_fc_norm_hidden.weight"), axis=-1)  # embedding first
        x = self.linear(g, x, P + "fc", [P + "fc.weight"])[0]
        a = self.norm(g, x, P + "layers.0.input_layernorm.weight")
        qg, k, v = self.linear(g, a, A + "qkv", [A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"])
        q, gate = g.split(g.reshape(qg, [-1, nh, 2 * hd]), [hd, hd], axis=-1)  # q | gate interleaved per head
        q = emit_partial_rope(g, self.norm(g, q, A + "q_norm.weight"), cos, sin, hd, c.rotary_dim)
        k = emit_partial_rope(g, self.norm(g, g.reshape(k, [-1, nkv, hd]), A + "k_norm.weight"), cos, sin, hd,
                              c.rotary_dim)
        new_k, new_v = g.transpose(k, [1, 0, 2]), g.transpose(g.reshape(v, [-1, nkv, hd]), [1, 0, 2])
        # one layer: a row's K/V depends on that row alone, so only the rows asked for go on (export/drafters/eagle3.py)
        q, gate, mask, x = (g.op("Gather", t, rows, axis=0) for t in (q, gate, mask, x))
        attn = emit_dynamic_gqa(g, q, past_k, past_v, new_k, new_v, mask, nh=nh, nkv=nkv, hd=hd)
        gated = g.op("Mul", attn, g.op("Sigmoid", g.reshape(gate, [-1, nh * hd])))
        x = g.op("Add", x, self.linear(g, gated, A + "o_proj", [A + "o_proj.weight"])[0])
        m = self.norm(g, x, P + "layers.0.post_attention_layernorm.weight")
        up_gate = self.linear(g, m, MLP + "gate_up", [MLP + "gate_proj.weight", MLP + "up_proj.weight"])
        x = g.op("Add", x, self.linear(g, g.op("Mul", g.silu(up_gate[0]), up_gate[1]), MLP + "down_proj",
                                       [MLP + "down_proj.weight"])[0])
        out = self.norm(g, x, P + "norm.weight")
        src = head_source(self.ck)
        if self.plan.quant is None:  # (untrimmed and tied: the embedding's table, one copy)
            logits = g.op("Gemm", out, self.w(g, self.plan.table(src, self.ck.shapes[src])), transB=1)
        else:  # its own block-quantised copy (the table stays for the embedding's Gather)
            logits = self.linear(g, out, "lm_head", [src], head=True)[0]
        g.output(logits, "logits", np.float32, [M, self.ck.shapes[src][0]])
        g.output(out, "hidden", np.float32, [M, H])
        g.output(new_k, "new_key", np.float32, [nkv, N, hd])
        g.output(new_v, "new_value", np.float32, [nkv, N, hd])
        return g


def head_source(ck: MtpCheckpoint) -> str:
    """The tensor the head's logits come from: the trimmed rows when there are (trim_head), else the
    target's lm_head, or its embedding when tied."""
    for name in (DRAFT_HEAD, "lm_head.weight"):
        if name in ck.shapes:
            return name
    return "embed_tokens.weight"


def trim_head(ck: MtpCheckpoint, draft_ids: np.ndarray) -> MtpCheckpoint:
    """The head drafting only `draft_ids` (ascending target ids; export/drafters/vocab.py): its logits
    are rows draft_ids of the target's lm_head, draft id i standing for target id draft_ids[i]."""
    src, ids = head_source(ck), np.asarray(draft_ids, np.int64)
    shapes = {**ck.shapes, DRAFT_HEAD: (len(ids), ck.shapes[src][1])}
    loaders = {**ck.loaders, DRAFT_HEAD: lambda: np.ascontiguousarray(ck.load(src)[ids])}
    return MtpCheckpoint(ck.source, ck.config, shapes, loaders, draft_ids=ids)


def export_mtp(ck: MtpCheckpoint, out_dir, dtype: str = "fp32", quant=None) -> dict:
    """write_mtp, returning drafter.json as written."""
    return write_mtp(ck, out_dir, dtype, quant).to_json()


def write_mtp(ck: MtpCheckpoint, out_dir, dtype: str = "fp32", quant=None) -> DrafterManifest:
    """Write mtp_in.onnx, mtp.onnx, mtp_weights.bin and drafter.json (kind "mtp") into out_dir, and
    for a trimmed head (trim_head) vocab.safetensors, its draft-to-target ids; returns the manifest record.
    quant: the target's QuantSpec (export/drafters/shared.py drafter_weight_plan)."""
    plan = drafter_weight_plan(ck.load, dtype, quant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b = _Graphs(ck, plan)
    graphs = write_drafter_files(out, plan, {IN_GRAPH: b.hidden_in(), STEP_GRAPH: b.step()}, WEIGHTS_FILE)
    c = ck.config
    manifest = DrafterManifest(
        format=DRAFTER_FORMAT, kind=KIND, source=str(ck.source), config=asdict(c),
        taps={"convention": "residual stream after the last target layer (before the final norm)",
              "layers": [c.num_layers], "input_order": [c.num_layers]},
        graphs=graphs, weights=weights_entry(plan, WEIGHTS_FILE, dtype),
        # the same record as an EAGLE-3 drafter's own vocabulary
        vocab=write_draft_vocab(out, ck.draft_ids) if ck.draft_ids is not None else None)
    manifest.write(out)
    return manifest
