"""A local Hugging Face checkpoint directory → ModelConfig + canonical named weights.

Accepted layouts (docs/qwen35-model.md):
* model_type `qwen3_5` (the released VLM layout: `text_config`, tensors `model.language_model.*`,
  `model.visual.*` ignored, `mtp.*` kept aside) and `qwen3_5_text` (tensors `model.*`);
* `qwen3_next` with dense MLPs: fused in_proj_qkvz / in_proj_ba split into the Qwen3.5 layout.
Canonical names drop the prefix: `embed_tokens.weight`, `layers.{i}.linear_attn.in_proj_qkv.weight`,
`norm.weight`, `lm_head.weight`. Weights load lazily: nothing big is read until written.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hybrid_npu.chat_files import stop_token_ids
from hybrid_npu.config import FULL, LINEAR, ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import CONFIG_BYTES, TOKENIZER_BYTES, check_names, read_bytes, read_json, regular_size

from .safetensors_io import SafetensorsFile

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


@dataclass
class Checkpoint:
    path: Path
    model_type: str
    config: ModelConfig
    raw_config: dict
    shapes: dict[str, tuple[int, ...]]
    loaders: dict[str, Callable[[], np.ndarray]]
    source_dtype: str
    mtp_tensors: list[str] = field(default_factory=list)
    # the MTP head (`mtp.*`, names kept as in the file): read only by `--drafter mtp` (export/drafters/mtp.py)
    mtp_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    mtp_loaders: dict[str, Callable[[], np.ndarray]] = field(default_factory=dict, repr=False)

    def load(self, name: str) -> np.ndarray:
        arr = self.loaders[name]()
        if tuple(arr.shape) != self.shapes[name]:  # a header that lies about its data
            raise UserError(f"tensor {name}: data has shape {tuple(arr.shape)}, header says {self.shapes[name]}")
        return arr

    def fingerprint(self) -> str:
        """sha256 over config.json and every weight file's name, size and header (fast, no full read)."""
        h = hashlib.sha256(read_bytes(self.path / "config.json", CONFIG_BYTES, "config.json", _FIX))
        for f in sorted(self.path.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 16))
        return h.hexdigest()


def text_config(raw: dict) -> dict:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return raw.get("text_config", raw) if model_type == "qwen3_5" else raw


def _rope(text: dict) -> tuple[float, float]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UserError(f"rope type {rope_type!r} is not supported yet (only default RoPE / text-only MRoPE)")
    return float(theta), float(factor)


# config keys that must be positive integers (when present: optional ones have defaults)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
                  "max_position_embeddings")
_SIDE_JSON = ("generation_config.json", "tokenizer_config.json")
_FIX = "fix or delete it"
INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor


def check_config_values(path: Path, raw) -> None:
    """Refuse, in one line, the values parse_config would trip over (null, strings, zero heads, a
    list for a config) and side files that are not JSON objects, before anything reads them."""
    cfg_file = path / "config.json"
    if not isinstance(raw, dict):
        raise UserError(f"{cfg_file}: a config is a JSON object, this one is a JSON {type(raw).__name__}")
    text = raw.get("text_config", raw) if raw.get("model_type") == "qwen3_5" else raw
    if not isinstance(text, dict):
        raise UserError(f"{cfg_file}: text_config must be a JSON object")
    for key in _POSITIVE_INTS:
        if key not in text or (key == "head_dim" and text[key] is None):
            continue
        v = text[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{cfg_file}: {key} must be a positive integer, got {json.dumps(v)[:80]}")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{cfg_file}: rope_parameters must be a JSON object, got {json.dumps(rope)[:80]}")
    for where, key in (*((text, k) for k in ("rms_norm_eps", "rope_theta", "partial_rotary_factor")),
                       (rope, "rope_theta"), (rope, "partial_rotary_factor")):
        v = where.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UserError(f"{cfg_file}: {key} must be a positive number, got {json.dumps(v)[:80]}")
    lt = text.get("layer_types")
    if lt is not None and not (isinstance(lt, list) and all(isinstance(t, str) for t in lt)):
        raise UserError(f"{cfg_file}: layer_types must be a list of layer type names")
    for name in _SIDE_JSON:
        f = path / name
        if not f.exists():
            continue
        side = read_json(f, CONFIG_BYTES, name, _FIX)
        if not isinstance(side, dict):
            raise UserError(f"{f}: must be a JSON object, is a JSON {type(side).__name__}; fix or delete it")


def check_float_tensors(dtypes: dict[str, str]) -> None:
    """Weights are floating point: an integer tensor would be cast to nonsense without a word."""
    bad = {n: d for n, d in dtypes.items() if d not in FLOAT_DTYPES}
    if bad:
        name, dt = next(iter(sorted(bad.items())))
        raise UserError(f"tensor {name} is {dt}; the model's weights must be floating point "
                        f"({', '.join(FLOAT_DTYPES)}): this is not a float checkpoint (already quantised?)")


def parse_config(path: Path, raw: dict) -> ModelConfig:
    check_config_values(path, raw)
    text = text_config(raw)
    try:
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:  # transformers' default schedule (Qwen3_5TextConfig.__post_init__)
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        if len(layer_types) != n_layers:
            raise UserError(f"config: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
        theta, factor = _rope(text)
        # docs/qwen35-model.md trap 6: the top level's tie_word_embeddings wins over text_config's
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        cfg = ModelConfig(
            vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), layer_types=tuple(layer_types),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rope_theta=theta, partial_rotary_factor=factor, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie), max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            eos_token_ids=stop_token_ids(path, raw, text)[0],
        )
    except KeyError as e:
        raise UserError(f"{path / 'config.json'}: missing key {e.args[0]!r}; is this a Qwen3.5 config?") from None
    cfg.validate()
    if raw.get("model_type") == "qwen3_next":
        _refuse_moe(text, n_layers)
    return cfg


def _refuse_moe(text: dict, n_layers: int) -> None:
    dense = set(text.get("mlp_only_layers") or [])
    experts, step = int(text.get("num_experts", 0)), int(text.get("decoder_sparse_step", 1))
    moe = [i for i in range(n_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    if moe:
        raise UserError(f"Qwen3-Next MoE layers are not supported yet (layers {moe[:4]}{'...' if len(moe) > 4 else ''}"
                        " use experts); only checkpoints whose MLPs are all dense can be exported")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical text tensor and its shape, from the config alone."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        if kind == LINEAR:
            a = p + "linear_attn."
            hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            shapes.update({a + "in_proj_qkv.weight": (cfg.conv_dim, H), a + "in_proj_z.weight": (hv * dv, H),
                           a + "in_proj_b.weight": (hv, H), a + "in_proj_a.weight": (hv, H),
                           a + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                           a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (dv,),
                           a + "out_proj.weight": (H, hv * dv)})
        else:
            a = p + "self_attn."
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            shapes.update({a + "q_proj.weight": (2 * nh * hd, H), a + "k_proj.weight": (nkv * hd, H),
                           a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd),
                           a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
    return shapes


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        data = read_json(index, INDEX_BYTES, "the safetensors index", "copy the checkpoint again")
        shards = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(shards, dict) or not all(_shard_name(s) for s in shards.values()):
            raise UserError(f"{index}: not a valid safetensors index (it needs a weight_map of tensor -> shard "
                            "file in this folder); copy the checkpoint again")
        shard_names = sorted(set(shards.values()))
        missing = [s for s in shard_names if not (path / s).exists()]
        if missing:
            raise UserError(f"shard {missing[0]} listed in {index.name} is missing from {path}; copy the whole checkpoint")
        return [path / s for s in shard_names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(f.suffix in PICKLE_SUFFIXES for f in path.iterdir()):
        raise UserError(f"{path} has only pickle weights (.bin/.pt); refusing to unpickle: convert to safetensors first "
                        "(transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise UserError(f"{path} has no *.safetensors weights")


def _shard_name(name) -> bool:
    """A shard is a file beside the index: a plain name, never a path out of the checkpoint."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and ":" not in name and len(name) <= 255


def check_side_files(path: Path) -> None:
    """The checkpoint's tokenizer and config files are regular files of a bounded size (a link to
    /dev/zero or a FIFO would be read, or copied, forever)."""
    for name in ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES):
        f = path / name
        if f.exists() or f.is_symlink():
            size = regular_size(f, name, "replace it with the model's own file")
            limit = TOKENIZER_BYTES if name == "tokenizer.json" else INDEX_BYTES
            if size > limit:
                raise UserError(f"{f}: {name} is {size} bytes, more than the {limit} allowed; "
                                "replace it with the model's own file")


def _canonical(name: str) -> str | None:
    """Drop the VLM/text prefix. None: a tensor we do not export (vision tower, rotary buffers)."""
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return None if rest.startswith("visual.") else rest
    if name == "lm_head.weight":
        return name
    return None


def _split_qwen3_next(cfg: ModelConfig, shapes: dict, loaders: dict) -> None:
    """Qwen3-Next fused projections → Qwen3.5 layout (docs/qwen35-model.md): rows are grouped per
    key head g as [q_g | k_g | v_g (r·Dv) | z_g (r·Dv)] and [b_g (r) | a_g (r)]."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r, dv = cfg.linear_num_value_heads // hk, cfg.linear_value_head_dim
    for i in cfg.linear_layers:
        a = f"layers.{i}.linear_attn."
        if a + "in_proj_qkvz.weight" not in loaders:
            continue
        qkvz, ba = loaders.pop(a + "in_proj_qkvz.weight"), loaders.pop(a + "in_proj_ba.weight")
        shapes.pop(a + "in_proj_qkvz.weight"), shapes.pop(a + "in_proj_ba.weight")

        def grouped(load, sizes):
            w = load()
            return w.reshape(hk, sum(sizes), w.shape[-1]), np.cumsum([0] + sizes)

        def qkv(load=qkvz):
            w, o = grouped(load, [dk, dk, r * dv, r * dv])
            return np.concatenate([w[:, o[j]:o[j + 1]].reshape(-1, w.shape[-1]) for j in range(3)])

        def z(load=qkvz):
            w, o = grouped(load, [dk, dk, r * dv, r * dv])
            return w[:, o[3]:o[4]].reshape(-1, w.shape[-1])

        def b(load=ba):
            w, _ = grouped(load, [r, r])
            return w[:, :r].reshape(-1, w.shape[-1])

        def a_(load=ba):
            w, _ = grouped(load, [r, r])
            return w[:, r:].reshape(-1, w.shape[-1])

        H = cfg.hidden_size
        for name, fn, rows in (("in_proj_qkv", qkv, cfg.conv_dim), ("in_proj_z", z, hk * r * dv),
                               ("in_proj_b", b, hk * r), ("in_proj_a", a_, hk * r)):
            loaders[a + name + ".weight"], shapes[a + name + ".weight"] = fn, (rows, H)


def read_config_json(path: Path, what: str, kind: str) -> dict:
    """config.json of a checkpoint directory, or a one-line error naming `what` (e.g. "model path")."""
    check_names(path, what)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{what} {path} is not a directory; pass {kind} directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists() and not cfg_file.is_symlink():
        raise UserError(f"{path} has no config.json; pass {kind} directory")
    return read_json(cfg_file, CONFIG_BYTES, "config.json", _FIX)


def _refuse_unused_layers(cfg: ModelConfig, shapes: dict) -> None:
    """Weights of layers the config does not have: a config.json that declares fewer layers than
    the checkpoint holds would export a smaller model without a word."""
    numbers = {n.split(".")[1] for n in shapes if n.startswith("layers.")}
    extra = sorted(int(i) for i in numbers if i.isdigit() and int(i) >= cfg.num_layers)
    if extra:
        raise UserError(f"the checkpoint holds weights of layer {extra[0]} (layers {extra[0]}..{extra[-1]}), but its "
                        f"config.json declares {cfg.num_layers} layers; fix num_hidden_layers/layer_types in config.json")


def read_checkpoint(path) -> Checkpoint:
    path = Path(path)
    raw = read_config_json(path, "model path", "a Hugging Face checkpoint")
    check_side_files(path)
    cfg = parse_config(path, raw)

    shapes, loaders, mtp, dtypes, by_name = {}, {}, [], set(), {}
    mtp_shapes, mtp_loaders = {}, {}
    for f in _weight_files(path):
        st = SafetensorsFile(f)
        for name in st.names():
            if name.startswith("mtp."):
                mtp.append(name)
                mtp_shapes[name] = st.shape(name)
                mtp_loaders[name] = (lambda st=st, name=name: st.load(name))
                continue
            canon = _canonical(name)
            if canon is None:
                continue
            shapes[canon] = st.shape(name)
            dtypes.add(st.dtype(name))
            by_name[canon] = st.dtype(name)
            loaders[canon] = (lambda st=st, name=name: st.load(name))
    check_float_tensors(by_name)
    _refuse_unused_layers(cfg, shapes)
    if raw.get("model_type") == "qwen3_next":
        _split_qwen3_next(cfg, shapes, loaders)

    for name, want in expected_shapes(cfg).items():
        if name not in shapes:
            hint = " (config says tie_word_embeddings=false)" if name == "lm_head.weight" else ""
            raise UserError(f"tensor {name} is missing from the checkpoint{hint}")
        if tuple(shapes[name]) != want:
            raise UserError(f"tensor {name} has shape {tuple(shapes[name])}, the config implies {want}")
    return Checkpoint(path=path, model_type=raw["model_type"], config=cfg, raw_config=raw, shapes=shapes,
                      loaders=loaders, source_dtype=",".join(sorted(dtypes)), mtp_tensors=sorted(mtp),
                      mtp_shapes=mtp_shapes, mtp_loaders=mtp_loaders)
