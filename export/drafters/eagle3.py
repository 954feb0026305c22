"""The EAGLE-3 drafter: read a checkpoint (both published layouts) and export it to ONNX for the CPU.

Spec: docs/eagle3-drafter.md, docs/speculation.md. One decoder layer (Llama-style, plain x̂·w RMSNorm,
full RoPE, GQA, SwiGLU) whose first attention input is concat(embedding, feature), 2h wide.

Accepted layouts (docs/eagle3-drafter.md):
* official / SpecForge: `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, optional
  `embed_tokens.weight` (absent: the target's table is shared), `d2t`, `t2d`; config at the top
  level, tap ids optional in `eagle_config.eagle_aux_hidden_state_layer_ids` meaning "output of
  layer k" (SpecForge/SGLang), SpecForge `norm_output` = apply the final norm before lm_head.
* vLLM speculators: `layers.0.*` (optional `self_attn.{q,k}_norm`), optional `input_norm.weight`
  (`norm_before_fc`), config in `transformer_layer_config`, `draft_vocab_size`,
  `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` used as is ("entering layer k"),
  `norm_output` = feed the post-norm hidden back (Eagle 3.1).
Both canonicalise to the `midlayer.*` names, so they export to identical graphs.

Tap convention (docs/eagle3-drafter.md, the known off-by-one trap): recorded ONLY as "residual stream
entering layers (a, b, ...)", the quantity our target graphs output as `tap.{j}`.

Export (`export_drafter`): two graphs over one weights file, N (tokens) and past dynamic:
  drafter_fc.onnx  taps [N, nT·H] (the target's taps, concatenated in target_cfg.tap_layers order)
                   -> features [N, h]   (select the drafter's taps, optional norms, fc)
  drafter.onnx     features [N, h], input_ids [N] (target ids), rope_cos/rope_sin [N, rd],
                   attn_mask [N, past+N], past_key/past_value [nKV, past, hd], logit_rows [M]
                   -> logits [M, Vd], hidden [M, h] (pre-final-norm x, the feature fed back) of the
                      rows `logit_rows` only; new_key/new_value [nKV, N, hd] of every row
Two graphs rather than one with a switch: the fc costs as much as q/k/v and runs only on target
features. `logit_rows` keeps a long observe from paying for rows nobody reads: the drafter is one
layer, so a row's K/V depends on that row alone, and attention, MLP and head run only for the rows
asked for (an observe of 64 positions reads one: the last).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.format import DRAFTER_FORMAT, DRAFTER_MANIFEST
from hybrid_npu.kernels.attention import emit_dynamic_gqa
from hybrid_npu.kernels.graph import GraphBuilder
from hybrid_npu.kernels.norms import emit_rmsnorm
from hybrid_npu.kernels.rope import emit_partial_rope
from hybrid_npu.manifest import DrafterManifest

from ..checkpoint import PICKLE_SUFFIXES, read_config_json
from ..safetensors_io import SafetensorsFile
from ..quantize import QuantSpec
from ..weights import WeightPlan
from .shared import (M, N, drafter_linear, drafter_step_inputs, drafter_weight_plan, gathered_rows, weight_input,
                     weights_entry, write_draft_vocab, write_drafter_files)

EAGLE3, SPECULATORS = "eagle3", "speculators"
FORMAT, MANIFEST = DRAFTER_FORMAT, DRAFTER_MANIFEST
WEIGHTS_FILE = "drafter_weights.bin"


L = "midlayer."  # canonical layer prefix


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int                 # h
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                    # honoured when the config has it (docs/eagle3-drafter.md)
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    vocab_size: int                  # target V
    draft_vocab_size: int            # Vd
    target_hidden_size: int          # H
    tap_layers: tuple[int, ...]      # residual stream ENTERING these target layers, fc input order
    tap_source: str                  # where tap_layers came from and how they were converted
    layout: str                      # eagle3 | speculators
    norm_before_fc: bool = False     # one RMSNorm over the concatenated taps (speculators `input_norm`)
    fc_norm: bool = False            # one RMSNorm per tap before fc (`fc_norm.{j}`)
    norm_before_residual: bool = False  # residual = hidden_norm(f) instead of f
    final_norm: bool = True          # logits = lm_head(norm(x)); SpecForge norm_output=false: lm_head(x)
    feed_back_normed: bool = False   # speculators norm_output (Eagle 3.1): hidden out = norm(x)
    qk_norm: bool = False
    attention_bias: bool = False
    fc_bias: bool = False
    embedding: str = "drafter"       # drafter | target (shared, copied in at export)


@dataclass
class DrafterCheckpoint:
    path: Path
    config: DrafterConfig
    raw_config: dict
    target_tap_layers: tuple[int, ...]  # what the target graphs export, in their concat order
    shapes: dict[str, tuple[int, ...]]
    loaders: dict[str, Callable[[], np.ndarray]] = field(repr=False)
    draft_to_target: np.ndarray = field(repr=False)  # int64 [Vd]: target_id = i + d2t[i]

    def load(self, name: str) -> np.ndarray:
        arr = np.asarray(self.loaders[name]())
        if tuple(arr.shape) != tuple(self.shapes[name]):
            raise UserError(f"drafter tensor {name}: data has shape {tuple(arr.shape)}, expected {self.shapes[name]}")
        return arr


# ---------------------------------------------------------------------------------------- loading
def _weights(path: Path) -> dict[str, SafetensorsFile]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(f.suffix in PICKLE_SUFFIXES for f in path.iterdir()):
            raise UserError(f"drafter {path} has only pickle weights (pytorch_model.bin); refusing to unpickle: "
                            "convert it to model.safetensors first (safetensors.torch.save_file)")
        raise UserError(f"drafter {path} has no model.safetensors")
    names = {}
    for f in files:
        st = SafetensorsFile(f)
        for name in st.names():
            names[name.removeprefix("model.")] = (st, name)
    return names


def _layout(names) -> str:
    has_mid = any(n.startswith("midlayer.") for n in names)
    has_l0 = any(n.startswith("layers.0.") for n in names)
    if has_mid == has_l0:
        raise UserError("drafter weights have " + ("both midlayer.* and layers.0.*" if has_mid else
                        "neither midlayer.* nor layers.0.*") + "; not an EAGLE-3 checkpoint")
    if any(n.startswith("layers.") and not n.startswith("layers.0.") for n in names):
        raise UserError("drafter has more than one decoder layer; only single-layer EAGLE-3 drafters are supported")
    return EAGLE3 if has_mid else SPECULATORS


def _rope(c: dict, hd: int) -> tuple[float, int]:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"drafter rope type {kind!r} is not supported yet (only default RoPE)")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    return theta, int(hd * factor)


def _taps(raw: dict, layout: str, target_cfg: ModelConfig) -> tuple[tuple[int, ...], str]:
    """Tap layers as 'residual stream entering layer j' (docs/eagle3-drafter.md)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layout == EAGLE3 and top is None and nested is not None:
        taps = tuple(int(k) + 1 for k in nested)
        return taps, (f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} "
                      "(SpecForge/SGLang: output of layer k = entering k+1)")
    ids = top if top is not None else nested
    if ids is not None:
        return tuple(int(k) for k in ids), (f"eagle_aux_hidden_state_layer_ids {list(ids)} "
                                            "(vLLM: entering layer k, as is)")
    return tuple(target_cfg.tap_layers), "default (2, L//2, L-3): the reference's entering-layer taps"


def read_drafter(path, target_cfg: ModelConfig, target_embedding=None) -> DrafterCheckpoint:
    """A local EAGLE-3 drafter directory (config.json + *.safetensors), checked against the target.
    target_embedding: the target's [V, H] embedding (array or zero-argument callable), used when the
    drafter has no `embed_tokens.weight` (official checkpoints omit it, docs/eagle3-drafter.md)."""
    path = Path(path)
    raw = read_config_json(path, "drafter path", "an EAGLE-3 checkpoint")
    cfg_file = path / "config.json"
    files = _weights(path)
    layout = _layout(files)
    prefix = "midlayer." if layout == EAGLE3 else "layers.0."
    canon = {(L + n[len(prefix):] if n.startswith(prefix) else n): src for n, src in files.items()}
    c = raw.get("transformer_layer_config", raw) if layout == SPECULATORS else raw
    try:
        h, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
        nkv = int(c.get("num_key_value_heads") or nh)
        hd = int(c.get("head_dim") or h // nh)
        inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    except KeyError as e:
        raise UserError(f"{cfg_file}: missing key {e.args[0]!r}; is this an EAGLE-3 drafter config?") from None
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"drafter has num_hidden_layers={c['num_hidden_layers']}; "
                        "only single-layer drafters are supported")
    if nh % nkv:
        raise UserError(f"drafter num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
    theta, rd = _rope(c, hd)
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    if vocab != V:
        raise UserError(f"drafter vocabulary is {vocab} tokens but the target's is {V}; "
                        "this drafter belongs to another model")
    vd = int(raw.get("draft_vocab_size") or c.get("draft_vocab_size") or vocab)
    taps, tap_source = _taps(raw, layout, target_cfg)
    missing = [t for t in taps if t not in target_cfg.tap_layers]
    if missing:
        raise UserError(f"drafter taps the residual stream entering layers {list(taps)} ({tap_source}) but the target "
                        f"exports only {list(target_cfg.tap_layers)}; layer(s) {missing} are not available")
    if "fc.weight" not in canon:
        raise UserError("drafter has no fc.weight; EAGLE-3 drafters fuse the target taps with it")
    fc_in = canon["fc.weight"][0].shape(canon["fc.weight"][1])[-1]
    th = raw.get("target_hidden_size") or c.get("target_hidden_size")
    if th and int(th) != H:
        raise UserError(f"drafter expects target hidden size {int(th)} but the target's hidden size is {H}; "
                        "this drafter belongs to another model")
    if fc_in != len(taps) * H:
        raise UserError(f"drafter fc takes {fc_in} features but the target gives {len(taps)} taps x hidden {H} = "
                        f"{len(taps) * H}; this drafter belongs to another model")

    if layout == SPECULATORS:
        fbn, final = bool(raw.get("norm_output", False)), True
        nbr = bool(raw.get("norm_before_residual", False))
    else:
        fbn, final = False, bool(raw.get("norm_output", True))
        nbr = bool(raw.get("norm_before_residual", False))
    nbf = bool(raw.get("norm_before_fc", "input_norm.weight" in canon))
    cfg = DrafterConfig(
        hidden_size=h, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, intermediate_size=inter,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rotary_dim=rd, vocab_size=vocab,
        draft_vocab_size=vd, target_hidden_size=H, tap_layers=taps, tap_source=tap_source, layout=layout,
        norm_before_fc=nbf, fc_norm=bool(raw.get("fc_norm", False)), norm_before_residual=nbr, final_norm=final,
        feed_back_normed=fbn, qk_norm=L + "self_attn.q_norm.weight" in canon,
        attention_bias=L + "self_attn.q_proj.bias" in canon, fc_bias="fc.bias" in canon,
        embedding="drafter" if "embed_tokens.weight" in canon else "target")

    shapes = {n: st.shape(k) for n, (st, k) in canon.items()}
    loaders = {n: (lambda st=st, k=k: st.load(k)) for n, (st, k) in canon.items()}
    if cfg.embedding == "target":
        if target_embedding is None:
            raise UserError("drafter has no embed_tokens.weight and no target embedding was given; "
                            "export it together with its target checkpoint")
        if h != H:
            raise UserError(f"drafter has no embed_tokens.weight and its hidden size {h} differs from the "
                            f"target's {H}; it cannot share the target's embedding")
        shapes["embed_tokens.weight"] = (V, H)
        loaders["embed_tokens.weight"] = target_embedding if callable(target_embedding) else (lambda: target_embedding)
    if "lm_head.weight" not in shapes and raw.get("tie_word_embeddings") and vd == V:
        shapes["lm_head.weight"] = shapes["embed_tokens.weight"]
        loaders["lm_head.weight"] = loaders["embed_tokens.weight"]
    _check_shapes(cfg, shapes)
    d2t = _draft_to_target(cfg, shapes, loaders)
    return DrafterCheckpoint(path=path, config=cfg, raw_config=raw, target_tap_layers=tuple(target_cfg.tap_layers),
                             shapes=shapes, loaders=loaders, draft_to_target=d2t)


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, nh, nkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.intermediate_size)
    k_in = len(cfg.tap_layers) * cfg.target_hidden_size
    a, m = L + "self_attn.", L + "mlp."
    s = {"embed_tokens.weight": (cfg.vocab_size, h), "fc.weight": (h, k_in), "norm.weight": (h,),
         "lm_head.weight": (cfg.draft_vocab_size, h),
         L + "input_layernorm.weight": (h,), L + "hidden_norm.weight": (h,),
         L + "post_attention_layernorm.weight": (h,),
         a + "q_proj.weight": (nh * hd, 2 * h), a + "k_proj.weight": (nkv * hd, 2 * h),
         a + "v_proj.weight": (nkv * hd, 2 * h), a + "o_proj.weight": (h, nh * hd),
         m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h), m + "down_proj.weight": (h, inter)}
    if cfg.norm_before_fc:
        s["input_norm.weight"] = (k_in,)
    if cfg.fc_norm:
        s.update({f"fc_norm.{j}.weight": (cfg.target_hidden_size,) for j in range(len(cfg.tap_layers))})
    if cfg.fc_bias:
        s["fc.bias"] = (h,)
    if cfg.qk_norm:
        s.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
    if cfg.attention_bias:
        s.update({a + "q_proj.bias": (nh * hd,), a + "k_proj.bias": (nkv * hd,), a + "v_proj.bias": (nkv * hd,)})
    return s


def _check_shapes(cfg: DrafterConfig, shapes: dict) -> None:
    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            raise UserError(f"drafter tensor {name} is missing ({cfg.layout} layout)")
        if tuple(shapes[name]) != want:
            raise UserError(f"drafter tensor {name} has shape {tuple(shapes[name])}, the config implies {want}")


def _draft_to_target(cfg: DrafterConfig, shapes: dict, loaders: dict) -> np.ndarray:
    """target_id = i + d2t[i] (docs/eagle3-drafter.md); identity when the draft vocabulary is the target's."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in shapes:
        if vd != v:
            raise UserError(f"drafter vocabulary is {vd} tokens, the target's {v}, but it has no d2t mapping")
        return np.arange(v, dtype=np.int64)
    if tuple(shapes["d2t"]) != (vd,):
        raise UserError(f"drafter d2t has shape {tuple(shapes['d2t'])}, expected ({vd},) (draft_vocab_size)")
    ids = np.arange(vd, dtype=np.int64) + np.asarray(loaders["d2t"]()).astype(np.int64)
    if ids.min() < 0 or ids.max() >= v:
        raise UserError(f"drafter d2t maps into [{ids.min()}, {ids.max()}], outside the target vocabulary of {v}")
    return ids


# ---------------------------------------------------------------------------------------- graphs
class _Graphs:
    def __init__(self, ck: DrafterCheckpoint, plan: WeightPlan):
        self.ck, self.cfg, self.plan = ck, ck.config, plan

    def w(self, g: GraphBuilder, stored: str) -> str:
        return weight_input(g, self.plan, stored)

    def vec(self, g, name: str) -> str:
        return self.w(g, self.plan.vector(name, self.ck.shapes[name][0]))

    def norm(self, g, x: str, name: str) -> str:
        return emit_rmsnorm(g, x, self.vec(g, name), self.cfg.rms_norm_eps)

    def linear(self, g, x: str, name: str, sources: list[str], bias: list[str] | None = None,
               head: bool = False) -> list[str]:
        outs = [self.ck.shapes[s][0] for s in sources]
        y = drafter_linear(g, self.plan, x, name, sources, self.ck.shapes[sources[0]][1], outs, head)
        if bias:
            b = self.w(g, self.plan.add(name + ".bias", (sum(outs),),
                                        lambda: np.concatenate([self.ck.load(s) for s in bias]).astype(np.float32)))
            y = g.op("Add", y, b)
        return [y] if len(outs) == 1 else g.split(y, outs, axis=-1)

    def fc(self) -> GraphBuilder:
        """taps [N, nT·H] in the target's order -> features [N, h]."""
        c, g = self.cfg, GraphBuilder("drafter_fc")
        H, target = c.target_hidden_size, self.ck.target_tap_layers
        x = g.input("taps", np.float32, [N, len(target) * H])
        slots = [target.index(t) for t in c.tap_layers]
        if tuple(c.tap_layers) != tuple(target):  # the drafter's taps, in its fc order
            cols = np.concatenate([np.arange(s * H, (s + 1) * H) for s in slots])
            x = g.op("Gather", x, g.ints(cols), axis=1)
        if c.fc_norm:
            parts = g.split(x, [H] * len(slots), axis=-1)
            x = g.op("Concat", *[self.norm(g, p, f"fc_norm.{j}.weight") for j, p in enumerate(parts)], axis=-1)
        if c.norm_before_fc:
            x = self.norm(g, x, "input_norm.weight")
        f = self.linear(g, x, "fc", ["fc.weight"], ["fc.bias"] if c.fc_bias else None)[0]
        g.output(f, "features", np.float32, [N, c.hidden_size])
        return g

    def step(self) -> GraphBuilder:
        """One drafter step over N positions (docs/eagle3-drafter.md):
            x   = concat(input_layernorm(embed(ids)), hidden_norm(f))        [N, 2h], embedding first
            x   = attn(x) + (f | hidden_norm(f) if norm_before_residual)
            x   = x + mlp(post_attention_layernorm(x))
            out hidden = x (pre-final-norm; norm(x) for speculators norm_output), logits = lm_head(norm(x))"""
        c, g = self.cfg, GraphBuilder("drafter")
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        f, ids, cos, sin, mask, past_k, past_v, rows = drafter_step_inputs(g, h, nkv, hd, c.rotary_dim)
        table = self.plan.table("embed_tokens.weight", self.ck.shapes["embed_tokens.weight"])
        e = self.norm(g, gathered_rows(g, self.plan, table, ids), L + "input_layernorm.weight")
        fn = self.norm(g, f, L + "hidden_norm.weight")
        x = g.op("Concat", e, fn, axis=-1)
        a = L + "self_attn."
        bias = [a + p + "_proj.bias" for p in "qkv"] if c.attention_bias else None
        q, k, v = self.linear(g, x, a + "qkv", [a + p + "_proj.weight" for p in "qkv"], bias)
        q, k, v = g.reshape(q, [-1, nh, hd]), g.reshape(k, [-1, nkv, hd]), g.reshape(v, [-1, nkv, hd])
        if c.qk_norm:
            q, k = self.norm(g, q, a + "q_norm.weight"), self.norm(g, k, a + "k_norm.weight")
        q = emit_partial_rope(g, q, cos, sin, hd, c.rotary_dim)
        k = emit_partial_rope(g, k, cos, sin, hd, c.rotary_dim)
        new_k, new_v = g.transpose(k, [1, 0, 2]), g.transpose(v, [1, 0, 2])  # [nKV, N, hd]
        # one layer: every row's K/V depends on that row alone, so only the rows asked for go on (logit_rows)
        q, mask, resid = (g.op("Gather", t, rows, axis=0) for t in (q, mask, fn if c.norm_before_residual else f))
        attn = emit_dynamic_gqa(g, q, past_k, past_v, new_k, new_v, mask, nh=nh, nkv=nkv, hd=hd)
        o = self.linear(g, attn, a + "o_proj", [a + "o_proj.weight"])[0]
        x = g.op("Add", o, resid)
        m = L + "mlp."
        gate, up = self.linear(g, self.norm(g, x, L + "post_attention_layernorm.weight"), m + "gate_up",
                               [m + "gate_proj.weight", m + "up_proj.weight"])
        x = g.op("Add", x, self.linear(g, g.op("Mul", g.silu(gate), up), m + "down_proj", [m + "down_proj.weight"])[0])
        xn = self.norm(g, x, "norm.weight")
        logits = self.linear(g, xn if c.final_norm else x, "lm_head", ["lm_head.weight"], head=True)[0]
        g.output(logits, "logits", np.float32, [M, c.draft_vocab_size])
        g.output(xn if c.feed_back_normed else x, "hidden", np.float32, [M, h])
        g.output(new_k, "new_key", np.float32, [nkv, N, hd])
        g.output(new_v, "new_value", np.float32, [nkv, N, hd])
        return g


def build_drafter_graphs(ck: DrafterCheckpoint, plan: WeightPlan) -> dict[str, GraphBuilder]:
    b = _Graphs(ck, plan)
    return {"drafter_fc": b.fc(), "drafter": b.step()}


def export_drafter(ck: DrafterCheckpoint, out_dir, dtype: str = "fp32", quant: QuantSpec | None = None) -> dict:
    """Write drafter_fc.onnx, drafter.onnx, drafter_weights.bin, vocab.safetensors and drafter.json
    into out_dir; returns drafter.json as written. quant: drafter_weight_plan."""
    return write_drafter(ck, out_dir, dtype, quant).to_json()


def write_drafter(ck: DrafterCheckpoint, out_dir, dtype: str = "fp32", quant: QuantSpec | None = None) -> DrafterManifest:
    """export_drafter, returning the drafter's manifest record."""
    plan = drafter_weight_plan(ck.load, dtype, quant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    graphs = write_drafter_files(out, plan, build_drafter_graphs(ck, plan), WEIGHTS_FILE)
    c = ck.config
    manifest = DrafterManifest(
        format=FORMAT, source=str(ck.path), config={**asdict(c), "tap_layers": list(c.tap_layers)},
        taps={"convention": "residual stream entering target layers", "layers": list(c.tap_layers),
              "source": c.tap_source, "input_order": list(ck.target_tap_layers)},
        graphs=graphs, weights=weights_entry(plan, WEIGHTS_FILE, dtype),
        vocab=replace(write_draft_vocab(out, ck.draft_to_target), target_vocab_size=c.vocab_size))
    manifest.write(out)
    return manifest
