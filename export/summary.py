"""The table export-hybrid prints at the end: every graph file and its size on disk, NPU placement
of the NPU parts, weights, fixed state, K/V per token and the largest context a memory budget
holds (the runtime's own memory plan, runtime/memory.py).

NPU placement is shown only where export already proved it: a part whose QNN context binary was
compiled had CPU fallback disabled, so all its nodes are on the HTP. Without a compile (no QNN
here, or --no-compile) the table says how to check; it never compiles just to fill a column.
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.cli_common import human_bytes as human
from hybrid_npu.config import ModelConfig
from hybrid_npu.format import MTP_KIND
from hybrid_npu.manifest import Manifest, Weights
from hybrid_npu.runtime.for_export import (DEFAULT_MAX_CHECKPOINTS, MARGIN_BYTES, cpu_graph, plan_memory,
                                          resident_weight_bytes)

def _tree_size(path: Path) -> tuple[int, int]:
    files = [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), len(files)


def _file_rows(out: Path, manifest: Manifest) -> list[tuple[str, int, str]]:
    """(file, bytes on disk, NPU note) for every graph, the weights, context binaries, drafter."""
    rows = [(g.file, (out / g.file).stat().st_size, "") for g in manifest.graphs.values()]
    for name, npu in manifest.npu.items():
        for part in npu.parts:
            n = part.nodes
            note = (f"NPU: {n}/{n} nodes on HTP (context compiled, CPU fallback off)" if npu.context else
                    f"NPU: placement not checked (export-hybrid --check-npu {out} --profile {name})")
            rows.append((part.file, (out / part.file).stat().st_size, note))
        for part in npu.verify_parts or ():
            rows.append((part.file, (out / part.file).stat().st_size, "NPU verify part"))
        for part in npu.parts + (npu.verify_parts or ()):  # QDQ parts carry their own weights
            data = out / (part.file + ".data")
            if data.exists():
                rows.append((data.relative_to(out).as_posix(), data.stat().st_size, "its QDQ weights"))
    rows.append((manifest.weights.file, (out / manifest.weights.file).stat().st_size, ""))
    for name in manifest.npu:
        ctx_dir = out / "ctx" / name
        if ctx_dir.is_dir():
            size, count = _tree_size(ctx_dir)
            rows.append((f"ctx/{name}/ ({count} files)", size, "QNN context binaries"))
    for kind, d in manifest.drafter_dirs.items():
        size, count = _tree_size(out / d)
        rows.append((f"{d}/ ({count} files)", size, "MTP drafter" if kind == MTP_KIND else "EAGLE-3 drafter"))
    return rows


_DTYPE_NAMES = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}


def weights_note(cfg: ModelConfig, w: Weights, dtype: str) -> tuple[int, str]:
    """(the model's parameter count, how its weights are stored). A quantised export stores the
    embedding table (fp16, only gathered) and, for a tied model, an int-N copy of it as the lm_head
    (export/weights.py): the weights file holds both, the model has the table's parameters once."""
    mode = w.mode
    if mode == "float":
        return w.params, dtype
    embedding = _DTYPE_NAMES.get(w.embedding_dtype or "float16", w.embedding_dtype)
    head = f"int{w.head_bits or 8} lm_head" + (" (a copy of the tied embedding)" if cfg.tie_word_embeddings else "")
    params = w.params - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    return params, f"{mode} linear layers, {head}, {embedding} embedding, {dtype} rest"


def summary_lines(out, manifest: Manifest | dict, memory_budget: int | None = None) -> list[str]:
    """memory_budget: bytes for weights + state + K/V (default: available memory now minus the
    runtime's 1 GiB margin, as hybrid_npu.load plans it)."""
    out = Path(out)
    manifest = Manifest.of(manifest, out)
    cfg = manifest.model_config
    gdn = cfg.layer_types.count("linear_attention")
    lines = [f"exported {cfg.num_layers} layers ({gdn} GDN) to {out}"]
    rows = _file_rows(out, manifest)
    width = max(len(f) for f, _, _ in rows)
    lines += [f"  {f:<{width}}  {human(size):>10}  {note}".rstrip() for f, size, note in rows]
    total, _ = _tree_size(out)
    w = manifest.weights
    params, kind = weights_note(cfg, w, manifest.dtype)
    sessions = len({cpu_graph(manifest.graphs, step) for step in ("prefill", "decode")})  # the engine's at load
    kv_cache = manifest.kv_cache
    plan = plan_memory(cfg, resident_weight_bytes(w, cpu_sessions=sessions), kv_cache, memory_budget,
                       DEFAULT_MAX_CHECKPOINTS)
    where = "--max-context-memory" if memory_budget else f"available now minus {MARGIN_BYTES >> 30} GiB"
    per_token = plan.kv_bytes_per_token
    free = plan.budget_bytes - plan.weights_bytes - plan.state_bytes - plan.checkpoint_bytes
    fits = max(free, 0) // per_token if per_token else None
    if fits is not None and fits < cfg.max_position_embeddings:
        context = (f"{fits:,} tokens in {human(plan.budget_bytes)} ({where}): weights + state + "
                   "K/V per token")
    else:
        held = f"; {human(plan.budget_bytes)} ({where}) would hold {fits:,}" if fits is not None else ""
        context = f"{cfg.max_position_embeddings:,} tokens (the model's max_position_embeddings{held})"
    facts = [("on disk", human(total)),
             ("weights", f"{human(w.bytes)} ({params:,} params, {kind})"),
             ("state", f"{human(cfg.state_bytes())} fixed ({gdn} GDN layers)"),
             ("K/V", f"{cfg.kv_bytes_per_token(kv_cache):,} B per token ({kv_cache}, {len(cfg.full_layers)} attention layers)"),
             ("max context", context)]
    for name, npu in manifest.npu.items():
        tile = npu.tile
        reads = (f"attention in tiles of {tile.rows:,} rows (any context)" if tile else
                 f"T_max {npu.attention_capacity:,} tokens")
        facts.append((f"NPU {name}", f"{len(npu.parts)} prefill part(s), {reads}, chunk {npu.chunk}"))
        q = npu.weights
        if q is not None and q.method == "qdq":
            c = q.calibration
            facts.append(("NPU weights", f"QDQ w{q.weights[3:]}a16 ({q.weights} per channel, {q.activations} "
                                         f"activations), calibrated on {c.file} ({c.tokens:,} tokens)"))
        elif q is not None and q.method == "nbits":
            facts.append(("NPU weights", f"MatMulNBits {q.mode} (the CPU graphs' weights), fp16 activations"))
    if manifest.drafter is not None:
        facts.append(("drafter", f"{manifest.drafter.dir}/: speculation on by default"))
    key_width = max(len(k) for k, _ in facts)
    lines += [f"{k:<{key_width}}  {v}" for k, v in facts]
    return lines
