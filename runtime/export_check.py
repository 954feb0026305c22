"""Refuse a damaged or self-contradicting export at load, in one line, before it produces text.

What an export could lie about and how it is caught here: model.json that is not JSON or lacks
the entries the runtime reads; a config that does not build a ModelConfig; graph files that are
missing; a manifest whose config disagrees with the graphs' own input and output shapes (state
sizes, layer count, vocabulary, hidden size, chunk). File contents are checked by
src/hybrid_npu/integrity.py (sizes always, hashes at first load).
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.config import FULL, LINEAR, ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.format import MANIFEST
from hybrid_npu.manifest import Manifest, load_manifest
from hybrid_npu.safe_files import inside, regular_size

from .state import KV_BLOCK, State
from .step_inputs import chain_feed

_STATE_PREFIXES = ("conv_state.", "recurrent_state.", "past_key.", "past_value.")  # (and past_key_scale. ...)
_CHAIN_GRAPHS = ("prefill", "decode", "cpu")  # the graphs fed by chain_feed (verify takes a tree)
MAX_STATE_BYTES = 1 << 36   # 64 GiB of fixed state: no model this runs comes near it


def _reexport(path: Path) -> str:
    return f"re-export it with: export-hybrid SOURCE {path}"


def read_manifest(path: Path) -> tuple[Manifest, ModelConfig]:
    """model.json (checked by hybrid_npu.manifest) and the ModelConfig it describes, or a UserError
    naming what is wrong."""
    mf = path / MANIFEST
    manifest = load_manifest(path)
    try:
        cfg = manifest.model_config
        _check_config(cfg)
        cfg.validate()
    except (TypeError, KeyError, ValueError) as e:
        raise UserError(f"{mf}: its config is not a model config ({e}); {_reexport(path)}") from None
    except UserError as e:
        raise UserError(f"{mf}: {e}; {_reexport(path)}") from None
    fix = f"the export is damaged or was edited: {_reexport(path)}"
    for name, g in manifest.graphs.items():
        f = inside(path, g.file, f"graph {name}'s file", fix)
        if f.exists() or f.is_symlink():  # ONNX Runtime would block on a FIFO (exports without hashes)
            regular_size(f, f"graph {name}'s file", fix)
    fixed = cfg.state_bytes() + cfg.kv_bytes_per_token() * KV_BLOCK  # what State.fresh allocates
    if fixed > MAX_STATE_BYTES:
        raise UserError(f"{mf}: its config asks for {fixed} bytes of state; {fix}")
    prefill = manifest.prefill.n
    if manifest.chunk != prefill:
        raise UserError(f"{mf}: chunk {manifest.chunk} contradicts the prefill graph's {prefill} tokens; "
                        f"{_reexport(path)}")
    for name, want in (("decode", 1), ("cpu", manifest.chunk)):
        got = manifest.graphs[name].n if name in manifest.graphs else want
        if got != want:
            raise UserError(f"{mf}: graph {name} takes {got} tokens, it must take {want}; {fix}")
    return manifest, cfg


def _check_config(cfg: ModelConfig) -> None:
    ints = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                         "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                         "linear_conv_kernel_dim", "max_position_embeddings")}
    for k, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    if not cfg.layer_types or not set(cfg.layer_types) <= {LINEAR, FULL}:
        raise ValueError(f"layer_types {list(cfg.layer_types)!r}")


def _dims(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


def check_chain_graph(path: Path, name: str, session, cfg: ModelConfig, n: int, kv_cache: str = "fp32") -> None:
    """The graph's declared inputs/outputs against what the manifest's config (and K/V cache dtype) feeds
    and expects."""
    if name not in _CHAIN_GRAPHS:
        return
    inputs = {i.name: _dims(i.shape) for i in session.get_inputs()}
    optional = {i.name for i in session.get_overridable_initializers()}

    def contradiction(what: str) -> UserError:
        return UserError(f"{path / MANIFEST} contradicts {name}'s graph: {what}; the export is damaged or was "
                         f"edited: {_reexport(path)}")

    # the numbers against the graph's own shapes before anything is allocated by them
    for k, want in _symbolic_shapes(cfg, n).items():
        got = inputs.get(k)
        if got is not None and (len(got) != len(want) or any(g is not None and w is not None and g != w
                                                             for g, w in zip(got, want))):
            raise contradiction(f"input {k} is {got} in the graph, {want} by the config")
    feed = chain_feed(cfg, State.fresh(cfg, KV_BLOCK, kv_cache), [0], n)

    units = {f"recurrent_scale.{i}" for i in cfg.linear_layers}  # Pipeline feeds these (state units)
    for k in inputs:
        if k not in feed and k not in optional and k not in units:
            raise contradiction(f"the graph takes {k}, which the manifest's config does not produce")
    for k, arr in feed.items():
        if k not in inputs:
            if k.startswith(_STATE_PREFIXES):
                raise contradiction(f"the config has state {k}, the graph does not take it")
            continue
        want = inputs[k]
        if len(want) != arr.ndim or any(w is not None and w != a for w, a in zip(want, arr.shape)):
            raise contradiction(f"input {k} is {want} in the graph, {list(arr.shape)} by the config")
    for o in session.get_outputs():
        d = _dims(o.shape)
        last = d[-1] if d else None
        if o.name == "logits" and last not in (None, cfg.vocab_size):
            raise contradiction(f"logits have {last} entries, the config's vocab_size is {cfg.vocab_size}")
        if o.name.startswith("tap.") and last not in (None, cfg.hidden_size):
            raise contradiction(f"{o.name} is {last} wide, the config's hidden_size is {cfg.hidden_size}")


def _symbolic_shapes(cfg: ModelConfig, n: int) -> dict[str, list]:
    """The shapes chain_feed gives a chain graph (None: free), computed without allocating them."""
    shapes: dict[str, list] = {"input_ids": [n], "token_valid": [n], "attn_mask": [n, None]}
    for i in cfg.linear_layers:
        shapes[f"conv_state.{i}"] = [cfg.conv_dim, cfg.linear_conv_kernel_dim - 1]
        shapes[f"recurrent_state.{i}"] = [cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim]
    for i in cfg.full_layers:
        shapes[f"past_key.{i}"] = [cfg.num_key_value_heads, None, cfg.head_dim]
        shapes[f"past_value.{i}"] = [cfg.num_key_value_heads, cfg.head_dim, None]
    return shapes


def damaged(path: Path, file: str, e: Exception) -> UserError:
    """ONNX Runtime (or a reader) refused a file the integrity check could not vouch for."""
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return UserError(f"{path / file} does not load ({first}); the export is damaged: {_reexport(path)}")

