"""The closing parity check of an export (export-hybrid runs it unless --no-parity), numpy and ONNX
Runtime only, no torch:

1. weights: one source tensor of every kind (q_proj, A_log, conv1d, norms, ...) re-read from the
   checkpoint and compared with the bytes weights.bin holds for it: bitwise equal to the source
   cast to the stored dtype (exact for fp32, fp16 rounding for fp16). Quantised matrices are
   skipped with a count (their bound is the quantiser's to test).
2. graphs: the prefill graph over K tokens against K calls of the decode graph from the same
   empty state: last logits finite and within LOGITS_ATOL, and the state they leave within
   STATE_ATOL (two code paths, one model). Both tolerances scale with the largest magnitude
   compared when it exceeds 1: fp32 rounding is relative, and trained logits reach tens.
   Quantised weights: relative L2 distance within QUANTISED_REL instead (see there why).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from hybrid_npu.config import ModelConfig
from hybrid_npu.manifest import Manifest
from hybrid_npu.runtime.for_export import Pipeline, State, chain_feed, commit_chain, cpu_session

from .checkpoint import expected_shapes, read_checkpoint

LOGITS_ATOL = 1e-3
STATE_ATOL = 1e-3
# Quantised exports: MatMulNBits at accuracy_level 4 also rounds its input rows to int8 per block,
# and its one-row (decode) and many-row (prefill) kernels round them differently (measured 3e-4
# relative at a random Qwen3.5-0.8B's first MLP down projection). Every layer amplifies that: the
# random 0.8B at int4 ends 5.5% apart in logits and 7% in the last GDN state (relative L2) while
# float exports agree to 1e-6. A wiring fault (state hand-off, masks, conv shift) is off by O(1),
# so quantised exports are held to a relative bound instead of the float ones' absolute one.
QUANTISED_REL = 0.2
TOKENS = 5                   # prefill tokens compared with as many decode steps
MAX_REREAD = 1 << 26         # elements: larger tensors (a real embedding) are not re-read here


class ParityError(Exception):
    """The export disagrees with its source or with itself: a bug, not bad input (exit 1)."""


@dataclass
class ParityReport:
    tensors: int = 0
    casts: set[str] = field(default_factory=set)  # stored dtypes other than float32 among the compared
    max_abs_diff: float = 0.0      # stored weight against the fp32 source (0 for fp32 exports)
    quantised: int = 0
    too_big: int = 0
    tokens: int = 0                # prefill tokens compared with as many decode steps
    logits_diff: float = 0.0
    state_diff: float = 0.0
    logits_rel: float = 0.0        # relative L2 distances (the quantised exports' bound)
    state_rel: float = 0.0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        cast = "".join(f"after the {d} cast, " for d in sorted(self.casts))
        notes = [f"{self.tensors} source tensors equal weights.bin ({cast}max |diff| {self.max_abs_diff:.2g})"]
        if self.quantised:
            notes.append(f"{self.quantised} quantised not compared")
        if self.too_big:
            notes.append(f"{self.too_big} over {MAX_REREAD // 2**20}M elements not re-read")
        notes.append(f"prefill vs {self.tokens} decode steps: logits max |diff| {self.logits_diff:.2g}, "
                     f"state {self.state_diff:.2g}; relative L2 {self.logits_rel:.2g} and {self.state_rel:.2g}")
        head = "parity: ok" if not self.problems else f"parity: FAILED: {'; '.join(self.problems)}"
        return f"{head} ({', '.join(notes)})"


# ---------------------------------------------------------------- weights

def _stored_weights(graph: Path) -> dict[str, tuple[onnx.TensorProto, Path]]:
    model = onnx.load(str(graph), load_external_data=False)
    return {t.name: (t, graph.parent) for t in model.graph.initializer}


def _read(tensor: onnx.TensorProto, base: Path) -> np.ndarray:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(info["length"]) // dtype.itemsize
    return np.fromfile(base / info["location"], dtype=dtype, count=count,
                       offset=int(info.get("offset", 0))).reshape(tuple(tensor.dims))


def _one_per_kind(names: list[str]) -> list[str]:
    """One tensor of each kind (the name with its layer index removed), spread over the layers."""
    kinds: dict[str, list[str]] = {}
    for n in sorted(names, key=lambda s: [int(p) if p.isdigit() else p for p in s.split(".")]):
        kinds.setdefault(re.sub(r"^layers\.\d+\.", "layers.*.", n), []).append(n)
    return [group[(i * 7) % len(group)] for i, group in enumerate(kinds.values())]


def _rows_at(matrix: np.ndarray, block: np.ndarray) -> int | None:
    """Row offset at which `block` sits inside the fused `matrix` (a concatenation along axis 0)."""
    for r in np.flatnonzero((matrix == block[0]).all(axis=1)):
        if r + len(block) <= len(matrix) and np.array_equal(matrix[r: r + len(block)], block):
            return int(r)
    return None


def _find_stored(name: str, source: np.ndarray, stored: dict) -> tuple[str, np.ndarray | None]:
    """('ok' | 'quantised' | 'missing', the stored copy of `source`): by name for vectors and
    tables, `.kc` for conv kernels, else the fused matrix of the same module holding its rows."""
    if name in stored:
        return "ok", _read(*stored[name])
    if name + ".kc" in stored:  # [K, C] conv kernel of a [C, 1, K] source
        return "ok", _read(*stored[name + ".kc"]).T.reshape(source.shape)
    module = name.rsplit(".", 2)[0] + "." if name.count(".") >= 2 else name.split(".")[0]
    siblings = [(n, t) for n, t in stored.items() if n.startswith(module)]
    for _, (t, base) in siblings:
        if len(t.dims) == 2 and source.ndim == 2 and t.dims[1] == source.shape[1] and t.dims[0] >= source.shape[0]:
            matrix = _read(t, base)
            if matrix.dtype.kind == "f":
                r = _rows_at(matrix, source.astype(matrix.dtype))
                if r is not None:
                    return "ok", matrix[r: r + source.shape[0]]
    if any(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).kind in "iu" for _, (t, _) in siblings):
        return "quantised", None
    return "missing", None


def check_weights(export_dir: Path, manifest: Manifest, report: ParityReport) -> None:
    ck = read_checkpoint(Path(manifest.source_path))
    stored = _stored_weights(export_dir / manifest.decode.file)
    for name in _one_per_kind(list(expected_shapes(ck.config))):  # not a tied checkpoint's spare lm_head
        if int(np.prod(ck.shapes[name])) > MAX_REREAD:
            report.too_big += 1
            continue
        source = ck.load(name).astype(np.float32)
        status, copy = _find_stored(name, source, stored)
        if status == "quantised":
            report.quantised += 1
            continue
        if status == "missing":
            report.problems.append(f"source tensor {name} is not in weights.bin")
            continue
        if not np.isfinite(copy).all():
            report.problems.append(f"{name} is not finite in weights.bin (out of the {copy.dtype} range?)")
        elif not np.array_equal(copy, source.astype(copy.dtype)):
            bad = float(np.abs(copy.astype(np.float32) - source).max())
            report.problems.append(f"{name} differs from the source in weights.bin (max |diff| {bad:.3g})")
        report.tensors += 1
        if copy.dtype != np.float32:
            report.casts.add(str(copy.dtype))
        report.max_abs_diff = max(report.max_abs_diff, float(np.abs(copy.astype(np.float32) - source).max()))


# ---------------------------------------------------------------- graphs

def _advance(pipe: Pipeline, cfg: ModelConfig, state: State, ids: list[int], n: int) -> np.ndarray:
    out = pipe.run(chain_feed(cfg, state, ids, n))
    commit_chain(state, out, ids)
    return out["logits"][0]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def _state_diff(a: State, b: State) -> tuple[float, float, float]:
    """(largest |a - b| over every state tensor, largest |b|, largest relative L2 distance)."""
    pairs = [(a.gdn[i].conv, b.gdn[i].conv) for i in a.gdn] + [(a.gdn[i].recurrent, b.gdn[i].recurrent) for i in a.gdn]
    p = a.position
    pairs += [(a.attention[i].key[:, :p], b.attention[i].key[:, :p]) for i in a.attention]
    pairs += [(a.attention[i].values(p), b.attention[i].values(p)) for i in a.attention]
    return (max(float(np.abs(x - y).max()) for x, y in pairs),
            max(float(np.abs(y).max()) for _, y in pairs),
            max(_relative(x, y) for x, y in pairs))


def check_graphs(export_dir: Path, manifest: Manifest, report: ParityReport) -> None:
    """The same tokens chunked through prefill and stepped through decode must agree; where the
    export has the any-N CPU graph (what the engine runs on the CPU), also through it both ways."""
    _check_pair(export_dir, manifest, report, manifest.prefill.file, manifest.decode.file, "")
    if manifest.cpu is not None and not report.problems:
        _check_pair(export_dir, manifest, report, manifest.cpu.file, manifest.cpu.file, "cpu graph: ")


def _check_pair(export_dir: Path, manifest: Manifest, report: ParityReport, chunk_file: str, step_file: str,
                label: str) -> None:
    cfg = manifest.model_config
    k = report.tokens = min(TOKENS, manifest.prefill.n)
    ids = [(1 + 7919 * i) % cfg.vocab_size for i in range(k)]  # fixed, spread over the vocabulary
    kv_cache = manifest.kv_cache  # the graphs' past K/V dtype
    chunked, stepped = State.fresh(cfg, kv_cache=kv_cache), State.fresh(cfg, kv_cache=kv_cache)
    chunk_pipe = Pipeline([cpu_session(export_dir / chunk_file, manifest.weights)], "CPU")
    prefill_logits = _advance(chunk_pipe, cfg, chunked, ids, manifest.prefill.n)
    decode = chunk_pipe if step_file == chunk_file else \
        Pipeline([cpu_session(export_dir / step_file, manifest.weights)], "CPU")
    for t in ids:
        decode_logits = _advance(decode, cfg, stepped, [t], 1)
    if not (np.isfinite(prefill_logits).all() and np.isfinite(decode_logits).all()):
        report.problems.append(f"{label}logits are not finite")
        return
    logits_diff = float(np.abs(prefill_logits - decode_logits).max())
    logits_rel = _relative(prefill_logits, decode_logits)
    state_diff, state_scale, state_rel = _state_diff(chunked, stepped)
    # the report keeps the worse of the pairs
    report.logits_diff, report.logits_rel = max(report.logits_diff, logits_diff), max(report.logits_rel, logits_rel)
    report.state_diff, report.state_rel = max(report.state_diff, state_diff), max(report.state_rel, state_rel)
    if manifest.weights.mode != "float":
        if logits_rel > QUANTISED_REL:
            report.problems.append(f"{label}prefill and decode logits are {logits_rel:.3g} apart (relative L2 "
                                   f"> {QUANTISED_REL})")
        if state_rel > QUANTISED_REL:
            report.problems.append(f"{label}prefill and decode leave states {state_rel:.3g} apart (relative L2 "
                                   f"> {QUANTISED_REL})")
        return
    logits_tol = LOGITS_ATOL * max(1.0, float(np.abs(decode_logits).max()))
    state_tol = STATE_ATOL * max(1.0, state_scale)
    if logits_diff > logits_tol:
        report.problems.append(f"{label}prefill and decode logits differ by {logits_diff:.3g} (> {logits_tol:.3g})")
    if state_diff > state_tol:
        report.problems.append(f"{label}prefill and decode leave states {state_diff:.3g} apart (> {state_tol:.3g})")


def check_parity(export_dir, manifest: Manifest | dict) -> ParityReport:
    """Both checks on an export directory (finished or still being written); never raises on a
    mismatch: the report's `problems` say what disagrees. manifest: its record (or model.json as parsed)."""
    manifest = Manifest.of(manifest, Path(export_dir))
    report = ParityReport()
    check_weights(Path(export_dir), manifest, report)
    check_graphs(Path(export_dir), manifest, report)
    return report
