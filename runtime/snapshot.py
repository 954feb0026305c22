"""Save a conversation's State to one file and resume it later, exactly.

Why this is cheap: a Gated DeltaNet layer's state does not grow with the context. Each GDN layer
holds conv_dim * (K-1) * 4 + Hv * Dk * Dv * 4 bytes (conv window + fp32 delta-rule matrix), and
each full-attention layer what its K/V cache holds per token in use (K and V rows [0, position),
2 * nKV * hd * 2 bytes in fp16; the unused capacity is not written). For Qwen3.5-0.8B that is
18 x 1.07 MiB = 19.3 MiB of GDN state plus 12 KiB per token (fp16) for its 6 attention layers, so
a 4k-token conversation saves in about 67 MiB and restores without re-running the prompt.

The file is plain safetensors (never pickle): tensors `gdn.{i}.conv`, `gdn.{i}.recurrent`,
`attention.{i}.key`, `attention.{i}.value` ([nKV, position, hd], in the K/V cache's dtype: fp32,
fp16, or int8 with `attention.{i}.key_scale` / `.value_scale` [nKV, position]; any of them loads
into any cache) and `tokens` (int64
[position]), and each turn checkpoint's GDN copies `checkpoint.{j}.gdn.{i}.conv` / `.recurrent`
(its K/V are the first rows of the saved ones); the metadata holds `format`, `model` (the export's
manifest hash), `position`, `checkpoints` (their positions, JSON) and `checksum` (sha256 over every
tensor's name, dtype, shape and bytes in sorted name order, then every other metadata entry's key
and value: a chat's messages and the checkpoint positions ride in the same file and the same
checksum, so a snapshot is one atomic unit). Files of format 1 (no checkpoints) still load. A save goes to a uniquely named temporary file in the
same directory, then os.replace (atomic_io.py), so an interrupted, failed or concurrent save never
leaves half a file, or one saver's messages with another's state, under the final name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from hybrid_npu.config import ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.format import KV_CACHES, LEGACY_KV_CACHE
from hybrid_npu.safe_files import open_regular, safetensors_header

from .atomic_io import write_atomically
from .turn_checkpoints import Checkpoint
from .state import State


FORMAT = "hybrid-npu-state/2"
READABLE_FORMATS = ("hybrid-npu-state/1", FORMAT)  # 1: before turn checkpoints
RESERVED_KEYS = ("format", "model", "position", "checksum", "checkpoints")  # the rest of the metadata is the caller's


def _canonical(a: np.ndarray) -> np.ndarray:
    """C-contiguous and little-endian: the bytes safetensors stores and the checksum covers."""
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def checksum(tensors: dict[str, np.ndarray], extra: dict[str, str] | None = None) -> str:
    """sha256 over name, dtype, shape and bytes of every tensor, in sorted name order, then over
    each extra metadata key and value (none: the same value as snapshots without extras)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = _canonical(tensors[name])
        h.update(f"{name}\0{a.dtype.name}\0{list(a.shape)}\0".encode())
        h.update(a.reshape(-1).view(np.uint8))  # a flat byte view: no copy, zero-size safe
    for key in sorted(extra or {}):
        h.update(f"meta\0{key}\0{extra[key]}\0".encode())
    return h.hexdigest()


def _tensors(state: State, checkpoints) -> dict[str, np.ndarray]:
    pos = state.position
    out: dict[str, np.ndarray] = {}
    for i, layer in state.gdn.items():
        out[f"gdn.{i}.conv"] = _canonical(np.asarray(layer.conv, np.float32))
        out[f"gdn.{i}.recurrent"] = _canonical(np.asarray(layer.recurrent, np.float32))
    for j, checkpoint in enumerate(checkpoints):
        for i in state.gdn:
            out[f"checkpoint.{j}.gdn.{i}.conv"] = _canonical(np.asarray(checkpoint.conv[i], np.float32))
            out[f"checkpoint.{j}.gdn.{i}.recurrent"] = _canonical(np.asarray(checkpoint.recurrent[i], np.float32))
    for i, layer in state.attention.items():  # in the cache's own dtype: a snapshot holds what the cache holds
        keys, values, k_scale, v_scale = layer.rows(pos)
        out[f"attention.{i}.key"], out[f"attention.{i}.value"] = _canonical(keys), _canonical(values)  # rows, as keys
        if k_scale is not None:
            out[f"attention.{i}.key_scale"], out[f"attention.{i}.value_scale"] = _canonical(k_scale), _canonical(v_scale)
    out["tokens"] = _canonical(np.asarray(state.tokens, np.int64).reshape(-1))
    return out


def hashed_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """The metadata the checksum covers: all but what identifies the file (and the checksum)."""
    return {k: v for k, v in metadata.items() if k not in ("format", "model", "position", "checksum")}


def _metadata(state: State, model_hash: str, tensors: dict[str, np.ndarray], extra: dict[str, str],
              positions: list[int]) -> dict:
    clash = set(extra) & set(RESERVED_KEYS)
    if clash:
        raise ValueError(f"metadata keys {sorted(clash)} are the snapshot's own")
    extra = {**{str(k): str(v) for k, v in extra.items()}, "checkpoints": json.dumps(positions)}
    return {**extra, "format": FORMAT, "model": str(model_hash), "position": str(state.position),
            "checksum": checksum(tensors, extra)}


def save_state(state: State, path, model_hash: str, extra: dict[str, str] | None = None, checkpoints=()) -> None:
    """Write `state` and its turn checkpoints to `path` (one safetensors file), atomically. `extra`:
    more metadata (str -> str) kept in the same file under the same checksum, e.g. a chat's messages."""
    path = Path(path)
    if len(state.tokens) != state.position:
        raise UserError(f"cannot save state: it holds {len(state.tokens)} token ids for position {state.position}; "
                        f"save a state the engine produced")
    checkpoints = [c for c in checkpoints if c.position <= state.position]
    tensors = _tensors(state, checkpoints)
    metadata = _metadata(state, model_hash, tensors, dict(extra or {}), [c.position for c in checkpoints])
    write_atomically(path, lambda tmp: _write_safetensors(tensors, tmp, metadata), "state")


def _write_safetensors(tensors: dict[str, np.ndarray], file: Path, metadata: dict[str, str]) -> None:
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(file), metadata=metadata)
    except SafetensorError as e:  # its I/O errors carry "os error N": hand them on as the OSError they are
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from None


def _expected_shapes(cfg: ModelConfig, position: int, n_checkpoints: int) -> dict[str, tuple[int, ...]]:
    k = cfg.linear_conv_kernel_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix in ["", *(f"checkpoint.{j}." for j in range(n_checkpoints))]:
        for i in cfg.linear_layers:
            shapes[f"{prefix}gdn.{i}.conv"] = (cfg.conv_dim, k - 1)
            shapes[f"{prefix}gdn.{i}.recurrent"] = (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                    cfg.linear_value_head_dim)
    for i in cfg.full_layers:
        for name in ("key", "value"):
            shapes[f"attention.{i}.{name}"] = (cfg.num_key_value_heads, position, cfg.head_dim)
    shapes["tokens"] = (position,)
    return shapes


HEADER_BYTES = 64 << 20  # the header holds the chat's messages too: a long conversation's text
_DTYPES = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8"), "F16": np.dtype("<f2"), "I8": np.dtype("i1")}
# K/V rows: any cache dtype's (read_snapshot converts them into the engine's)
_ROW_TAGS = tuple(tag for tag, dtype in _DTYPES.items() if dtype in {np.dtype(d) for d in KV_CACHES.values()})


def _check_header(path: Path, header: dict, cfg: ModelConfig, model_hash: str,
                  max_position: int | None) -> dict[str, str]:
    """Every tensor's name, dtype and shape against this model and the memory plan, from the
    header alone, so no tensor is read (or allocated) that the model could not take. Returns the
    metadata; `header` keeps the tensors' entries."""
    metadata = header.pop("__metadata__", None) or {}
    _check_identity(path, metadata, model_hash)
    try:
        position = int(metadata.get("position", ""))
        if position < 0:
            raise ValueError
    except ValueError:
        raise UserError(f"cannot load state {path}: bad position {str(metadata.get('position'))[:40]!r} in its "
                        "metadata; save the state again") from None
    if max_position is not None and position > max_position:
        raise UserError(f"cannot load state {path}: it holds {position} tokens of context, the memory plan allows "
                        f"{max_position}; give the model more memory (--memory) or load a shorter conversation")
    positions = _checkpoint_positions(path, metadata, position)
    expected = _expected_shapes(cfg, position, len(positions))
    int8_rows = any(n.startswith("attention.") and isinstance(v, dict) and v.get("dtype") == "I8"
                    for n, v in header.items())
    if int8_rows:  # an int8 cache's rows come with a scale each
        expected.update({f"attention.{i}.{name}_scale": (cfg.num_key_value_heads, position)
                         for i in cfg.full_layers for name in ("key", "value")})
    foreign_first = sorted(set(header) - set(expected)) + sorted(expected)  # a stranger's tensor: the clearer sign
    for name in foreign_first:
        if name not in header:
            raise UserError(f"cannot load state {path}: tensor {name} is missing (this model expects shape "
                            f"{list(expected[name])}); load it with the model it was saved from")
        info = header[name]
        if name not in expected:
            raise UserError(f"cannot load state {path}: tensor {name[:60]} has no place in this model "
                            f"(expected none); load it with the model it was saved from")
        want_dtype = "I64" if name == "tokens" else "F32"
        if name.startswith("attention.") and not name.endswith("_scale") and info["dtype"] in _ROW_TAGS \
                and (info["dtype"] == "I8") == int8_rows:
            want_dtype = info["dtype"]
        if tuple(info["shape"]) != expected[name] or info["dtype"] != want_dtype:
            raise UserError(f"cannot load state {path}: tensor {name} is {str(info['dtype'])[:8]} "
                            f"{info['shape'][:6]}, this model expects {_DTYPES[want_dtype].name} "
                            f"{list(expected[name])}; load it with the model it was saved from")
        span = info["data_offsets"][1] - info["data_offsets"][0]
        if span != int(np.prod(expected[name], dtype=np.int64)) * _DTYPES[want_dtype].itemsize:
            raise UserError(f"cannot load state {path}: tensor {name}'s data is {span} bytes, not its shape's; "
                            "save the state again")
    return metadata


def _check_identity(path: Path, metadata: dict, model_hash: str) -> None:
    fmt = metadata.get("format")
    if fmt not in READABLE_FORMATS:
        what = f"format {fmt[:40]!r}" if fmt is not None else "no hybrid-npu format tag"
        raise UserError(f"cannot load state {path}: {what}, expected {FORMAT!r}; "
                        f"load a snapshot written by save_state of this hybrid-npu version")
    saved_model = metadata.get("model", "")
    if saved_model != model_hash:
        raise UserError(f"cannot load state {path}: this snapshot belongs to another model ({saved_model[:12]}…, "
                        f"this one is {model_hash[:12]}…); load it with the model it was saved from")


def _read(path: Path, cfg: ModelConfig, model_hash: str,
          max_position: int | None) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """One open of one file (what a concurrent save replaces is all seen or not at all): the header
    is checked first (_check_header), then each tensor is read into an array of the checked size."""
    fix = "save the state again"
    try:
        with open_regular(path, "the state", fix) as f:
            size = os.fstat(f.fileno()).st_size
            header, start = safetensors_header(f, size, HEADER_BYTES, f"cannot load state {path}", fix)
            metadata = _check_header(path, header, cfg, model_hash, max_position)
            tensors = {}
            for name, info in header.items():
                arr = np.empty(info["shape"], _DTYPES[info["dtype"]])
                f.seek(start + info["data_offsets"][0])
                if arr.nbytes and f.readinto(memoryview(arr.reshape(-1)).cast("B")) != arr.nbytes:
                    raise UserError(f"cannot load state {path}: not a readable safetensors file (truncated "
                                    f"or damaged); {fix}")
                tensors[name] = arr
    except OSError as e:
        raise UserError(f"cannot load state {path}: {e.strerror or e}; check the file is readable") from None
    return metadata, tensors


def load_state(path, cfg: ModelConfig, model_hash: str, capacity: int, max_position: int | None = None,
               kv_cache: str = LEGACY_KV_CACHE) -> State:
    """Read a snapshot saved by save_state for the model `model_hash`; refuses anything else."""
    return read_snapshot(path, cfg, model_hash, capacity, max_position, kv_cache)[0]


def _checkpoint_positions(path: Path, metadata: dict, position: int) -> list[int]:
    try:
        positions = json.loads(metadata.get("checkpoints", "[]"))
        if not (isinstance(positions, list) and all(type(p) is int and 0 <= p <= position for p in positions)):
            raise ValueError
    except ValueError:
        raise UserError(f"cannot load state {path}: bad checkpoints {metadata.get('checkpoints')!r} in its metadata; "
                        "save the state again") from None
    return positions


def read_snapshot(path, cfg: ModelConfig, model_hash: str, capacity: int,
                  max_position: int | None = None,
                  kv_cache: str = LEGACY_KV_CACHE) -> tuple[State, dict[str, str], list[Checkpoint]]:
    """The State (its K/V in the cache dtype kv_cache), the extra metadata (save_state's `extra`)
    and the turn checkpoints of one snapshot, from one read of one file: what a concurrent save
    replaces is either all seen or not at all. max_position: the most context the memory plan
    allows (a longer snapshot is refused before its tensors are read). The saved K/V may be in any
    cache dtype (fp32, as every snapshot before the option, fp16, int8 with scales): rows are
    converted on the way in."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UserError(f"cannot load state {path}: it is a directory; give the file save_state wrote")
        if not path.is_file():
            raise UserError(f"cannot load state {path}: no such file; give the path save_state wrote")
    except OSError as e:  # e.g. a name too long for the filesystem
        raise UserError(f"cannot load state {str(path)[:60]}…: {e.strerror or e}; give the path save_state wrote") from None
    metadata, tensors = _read(path, cfg, model_hash, max_position)
    extra = {k: v for k, v in metadata.items() if k not in RESERVED_KEYS}
    if metadata.get("checksum") != checksum(tensors, hashed_metadata(metadata)):
        raise UserError(f"cannot load state {path}: altered or damaged: checksum mismatch; "
                        f"save the state again or use an intact copy")
    # _read checked every tensor's name, dtype and shape, and the metadata, against this model
    position = int(metadata["position"])
    positions = _checkpoint_positions(path, metadata, position)
    int8_rows = any(t.dtype == np.int8 for name, t in tensors.items() if name.startswith("attention."))

    state = State.fresh(cfg, capacity, kv_cache)
    state.ensure_capacity(position)
    for i, layer in state.gdn.items():
        layer.conv[...] = tensors[f"gdn.{i}.conv"]
        layer.recurrent[...] = tensors[f"gdn.{i}.recurrent"]
    for i, layer in state.attention.items():
        keys, values = tensors[f"attention.{i}.key"], tensors[f"attention.{i}.value"]
        scales = (tensors[f"attention.{i}.key_scale"], tensors[f"attention.{i}.value_scale"]) if int8_rows else None
        if scales is not None and layer.key_scale is None:  # int8 rows into a float cache: widened
            keys, values, scales = keys * scales[0][..., None], values * scales[1][..., None], None
        layer.write(0, keys, values, scales)
    state.position = position
    state.tokens = [int(t) for t in tensors["tokens"]]
    checkpoints = [Checkpoint(p, {i: tensors[f"checkpoint.{j}.gdn.{i}.conv"] for i in state.gdn},
                              {i: tensors[f"checkpoint.{j}.gdn.{i}.recurrent"] for i in state.gdn})
                   for j, p in enumerate(positions)]
    return state, extra, checkpoints
