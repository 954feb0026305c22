"""export(): checkpoint directory → output directory (graphs, weights, tokenizer, manifest).

Everything is written into a marked hidden sibling directory and renamed into place at the end,
so a failure leaves nothing half-written and a killed export's leftovers are removed by the next
one; what may be replaced is decided by export/out_dir.py (never the source, never a directory
that is not an export).
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from hybrid_npu import chat_files
from hybrid_npu.config import LINEAR, ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import TOKENIZER_BYTES, read_text
from hybrid_npu.format import (DRAFTER_DIR, EAGLE3_KIND, MTP_DIR, MTP_KIND, STORAGE_DTYPES as DTYPES)


from .checkpoint import TOKENIZER_FILES, Checkpoint, read_checkpoint, text_config
from .npu.context_binaries import compile_contexts
from .drafters.eagle3 import read_drafter, write_drafter
from .drafters.vocab import added_token_ids, choose_draft_vocab, draft_vocab_size, token_counts, trim_hints
from .drafters.mtp import read_mtp, trim_head, write_mtp
from hybrid_npu import integrity
from hybrid_npu.format import FORMAT
from hybrid_npu.manifest import (Calibration, DrafterManifest, Graph, Manifest, NpuEntry, NpuWeights, Tile, Tokenizer,
                                 Weights)

from .value_infos import value_infos
from .out_dir import check_output, finish_partial, make_partial, os_error_line, remove_stale_partials
from hybrid_npu.kernels.attention_tile import BULK_TILES, emit_attention_tile
from hybrid_npu.kernels.graph import GraphBuilder

from .npu.parts import cut_at_attention, htp_itemsize, plan_parts
from .options import ExportOptions, ExportPlan
from .npu.qdq import quantize_parts, read_calibration
from .step_graph import Kind, StepSpec, build_step_graph
from .weights import WeightPlan

WEIGHTS_FILE = "weights.bin"


def graph_specs(chunk: int, verify: int, kv_cache: str = "fp32") -> dict[str, StepSpec]:
    """prefill (chain, C tokens), decode (1 token), verify (a token tree of `verify` nodes:
    logits, commit tensors and taps for every node, for speculative decoding).
    decode and the any-N "cpu" graph are written in ORT's fused CPU kernels (step_graph.KINDS,
    graph_ops.CpuOps; measured in docs/performance.md); prefill and verify stay in plain HTP-safe ops,
    so a prefill graph can still run whole on the NPU (runtime/npu_sessions.py). Every graph reads
    the past K/V in the export's cache dtype, kv_cache."""
    specs = {"prefill": StepSpec(Kind.PREFILL, chunk, kv_cache=kv_cache), "decode": StepSpec(Kind.DECODE, 1, kv_cache=kv_cache),
             "verify": StepSpec(Kind.VERIFY, verify, kv_cache=kv_cache)}
    if chunk > 1:  # the CPU runs prefill chunks and decode tokens through this one: one prepacked copy
        specs["cpu"] = StepSpec(Kind.ANY_N, chunk, kv_cache=kv_cache)
    # the CPU verifies through a graph sized to the draft (a 3-token chain need not pay for 32 nodes);
    # the NPU keeps the static `verify`
    specs["cpu_verify"] = StepSpec(Kind.SIZED_VERIFY, verify, tree_sizes=verify_sizes(verify), kv_cache=kv_cache)
    return specs


def verify_sizes(verify: int) -> tuple[int, ...]:
    """Tree sizes the CPU verify graph has cores for: every one from 2 to 8 (the chains a drafter's
    depth makes, and small trees), then powers of two below `verify`, and `verify`. A call of any
    other count is padded up to the next inside the graph."""
    return tuple(sorted({m for m in range(2, 9) if m < verify}
                        | {1 << j for j in range(4, verify.bit_length()) if 1 << j < verify} | {verify}))


def state_layout(cfg: ModelConfig) -> list[dict]:
    k = cfg.linear_conv_kernel_dim
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            layers.append({"layer": i, "kind": kind, "tensors": {
                "conv_state": [cfg.conv_dim, k - 1],
                "recurrent_state": [cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim]}})
        else:
            layers.append({"layer": i, "kind": kind, "tensors": {
                "key": [cfg.num_key_value_heads, "tokens", cfg.head_dim],
                "value": [cfg.num_key_value_heads, "tokens", cfg.head_dim]}})
    return layers


def export(src, out, options: ExportOptions | None = None, *, force: bool = False,
           progress: Callable[[str], None] | None = None, check: Callable[[Path, dict], None] | None = None,
           warn: Callable[[str], None] | None = None, **fields) -> dict:
    """Export the checkpoint in src into out, as `options` say (export/options.py; or give its
    fields as keywords: export(src, out, chunk=8, weights="int4")).
    profile (name or TOML path): also write that device's NPU graph parts and, when the QNN
    HTP backend is here (it is on x86_64 as an emulator), its precompiled context binaries.
    weights int8/int4: every linear layer block-quantised for the CPU (export/quantize.py); dtype
    then applies to what stays float. The drafters' weights follow the target's, or drafter_weights
    (float | int8 | int4: they only propose, so the output is the target's either way). With an NPU profile the NPU parts
    are quantised too: npu_quant "qdq" (default; w8a16/w4a16 calibrated on the text file
    `calibration`, export/npu/qdq.py) or "nbits" (the CPU's MatMulNBits weights, uncalibrated).
    max_context: refused (the NPU prefill reads any context in tiles; the memory plan bounds it).
    drafter "mtp": the checkpoint's own MTP head (`mtp.*`) drafts (export/drafters/mtp.py), in mtp/;
    a directory: an EAGLE-3 drafter, in drafter/. mtp (a directory whose safetensors hold `mtp.*`
    trained for this target): an MTP drafter too, beside the EAGLE-3 one (which stays the default).
    check(dir, manifest): runs on the finished export before it is moved into place (parity);
    whatever it raises leaves nothing written. warn(msg): what the export accepts but the user
    should know (default: a line on stderr)."""
    if options is not None and fields:
        raise TypeError("give export() an ExportOptions or its fields as keywords, not both")
    plan = (options or ExportOptions(**fields)).resolve()
    src, out = Path(src), Path(out)
    say = progress or (lambda msg: None)
    warn = warn or (lambda msg: print(f"hybrid-npu: warning: {msg}", file=sys.stderr, flush=True))
    ck = read_checkpoint(src)
    check_tokenizer(ck.path, warn, ck.config.vocab_size)
    if chat_files.chat_template(ck.path)[0] is None:
        warn(f"{ck.path} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): "
             "npu-chat and npu-serve will refuse to chat with this export; copy the model's template into the "
             "checkpoint and export again (npu-summarize --raw and token ids still work)")
    calib = read_calibration(plan.options.calibration, ck.path / "tokenizer.json") if plan.npu_quant == "qdq" else None
    if plan.npu_quant == "nbits":
        _check_nbits_widths(ck.config, plan.quant.block_size)
    dck = read_drafter(plan.eagle3, ck.config, lambda: ck.load("embed_tokens.weight")) if plan.eagle3 else None
    mck = read_mtp(ck, plan.mtp) if plan.wants_mtp else None
    n_draft = draft_vocab_size(ck.config.vocab_size, plan.options.mtp_vocab) if mck is not None else None
    if n_draft is not None:
        mck = trim_head(mck, mtp_draft_ids(ck, plan.options, n_draft))
    hint = trim_hints(ck.config.vocab_size, plan.options.mtp_vocab, plan.options.mtp_vocab_text) if mck else None
    if hint:
        warn(hint)
    check_output(ck.path, out, force)
    capacity, note = npu_capacity(plan.profile, plan.options.max_context, plan.chunk, ck.config)
    if capacity is not None:
        plan = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, attention_capacity=capacity))
    say(f"read {src}: {ck.model_type}, {ck.config.num_layers} layers, {len(ck.shapes)} tensors ({ck.source_dtype})")
    if note:
        say(note)
    remove_stale_partials(out, say)
    try:
        tmp = make_partial(out)
    except OSError as e:
        raise UserError(os_error_line(e, out)) from None
    try:
        manifest = _write_export(ck, tmp, plan, say, calib, final_tap=mck is not None)
        shipped: dict[str, DrafterManifest] = {}
        if mck is not None:
            say(f"exporting the MTP drafter (mtp.* of {mck.source}, reading the residual after layer "
                f"{ck.config.num_layers - 1}" + ("" if n_draft is None else
                                                 f"; drafting {n_draft:,} of its {ck.config.vocab_size:,} tokens")
                + ")")
            shipped[MTP_KIND] = dataclasses.replace(write_mtp(mck, tmp / MTP_DIR, plan.dtype, plan.drafter_quant),
                                                    dir=MTP_DIR)
        if dck is not None:
            say(f"exporting the EAGLE-3 drafter ({dck.config.layout} layout, taps entering layers "
                f"{list(dck.target_tap_layers)})")
            shipped[EAGLE3_KIND] = dataclasses.replace(
                write_drafter(dck, tmp / DRAFTER_DIR, plan.dtype, plan.drafter_quant), dir=DRAFTER_DIR, kind=EAGLE3_KIND)
        if shipped:  # the default drafter (EAGLE-3 when both), and every drafter by kind
            manifest = dataclasses.replace(manifest, drafter=shipped.get(EAGLE3_KIND) or shipped[MTP_KIND],
                                           drafters={kind: entry.dir for kind, entry in shipped.items()})
        say("hashing the written files (integrity)")
        manifest = dataclasses.replace(manifest, integrity=integrity.record(tmp))
        manifest.write(tmp)
        if check is not None:
            say("checking parity against the source")
            check(tmp, manifest)
        if out.exists():
            check_output(ck.path, out, force)  # again: the user may have put a file there meanwhile
            shutil.rmtree(out)
        finish_partial(tmp)
        tmp.rename(out)
    except OSError as e:  # disk full, read-only filesystem, permissions: one line, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(os_error_line(e, out)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest.to_json()


def mtp_draft_ids(ck, options: ExportOptions, n: int):
    """The n target ids a trimmed MTP head drafts (--mtp-vocab N, --mtp-vocab-text FILE)."""
    tok = ck.path / "tokenizer.json"
    v = ck.config.vocab_size
    counts = None if options.mtp_vocab_text is None else token_counts(options.mtp_vocab_text, tok, v)
    return choose_draft_vocab(v, n, added_token_ids(tok) | set(ck.config.eos_token_ids), counts)


def check_tokenizer(src: Path, warn: Callable[[str], None], vocab_size: int | None = None) -> None:
    """A tokenizer.json that does not load, or that has ids the model has no row for, is refused now,
    not copied to fail in npu-chat; none at all is allowed (the API takes token ids) but said."""
    f = src / "tokenizer.json"
    if not f.exists():
        warn(f"{src} has no tokenizer.json: the export will take token ids only (npu-chat and npu-summarize "
             "need a tokenizer); copy the model's tokenizer.json into it and export again")
        return
    from tokenizers import Tokenizer

    text = read_text(f, TOKENIZER_BYTES, "tokenizer.json", "copy the model's tokenizer.json again")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise UserError(f"{f} does not load as a tokenizer ({str(e).splitlines()[0][:160]}); copy the model's "
                        "tokenizer.json again") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= vocab_size:
            raise UserError(f"{f} has token ids up to {top}, but the model's vocabulary has {vocab_size} rows "
                            "(config.json vocab_size): this tokenizer belongs to another model; copy the model's "
                            "own tokenizer.json")


def _check_nbits_widths(cfg: ModelConfig, block: int) -> None:
    """The HTP's MatMulNBits refuses "K must be divisible by block_size" (the CPU pads the last block)."""
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "GDN value width": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
              "attention width": cfg.num_attention_heads * cfg.head_dim}
    bad = {name: k for name, k in widths.items() if k % block}
    if bad:
        name, k = next(iter(bad.items()))
        raise UserError(f"--npu-quant nbits: the HTP's MatMulNBits needs every input width divisible by the block "
                        f"size, and {name} {k} is not divisible by {block}; pick a --block-size that divides it "
                        "or use --npu-quant qdq --calibration FILE")


def npu_capacity(prof, max_context: int | None, chunk: int, cfg: ModelConfig) -> tuple[int | None, str | None]:
    """(the NPU verify graph's K/V capacity T_max, a note) when the profile's attention_capacity passes
    the model's max_position_embeddings (whole chunks below it: no graph for positions the model does
    not have), else (None, None). The prefill reads any context in tiles; --max-context is refused."""
    if max_context is not None:
        raise UserError("--max-context is gone: the NPU prefill reads any context in attention tiles (the "
                        "profile's attention_tile), so only memory bounds the context; drop it (--max-context-memory "
                        "SIZE shows the largest context a memory size allows)")
    if prof is None or not prof.has_npu or prof.attention_capacity <= cfg.max_position_embeddings:
        return None, None
    t_max = max(cfg.max_position_embeddings // chunk * chunk, chunk)
    return t_max, (f"NPU verify K/V capacity {prof.attention_capacity} -> {t_max}: the model has "
                   f"{cfg.max_position_embeddings} positions")


def _quantize_npu_parts(cfg: ModelConfig, float_dir: Path, graphs_dir: Path, graphs: dict, npu_specs: dict,
                        part_suffixes: dict[str, list[str]], quant, calib: tuple[list[int], dict], say) -> NpuWeights:
    """The float NPU parts in float_dir -> their QDQ twins in graphs_dir (export/npu/qdq.py), calibrated
    per graph (prefill chunks, verify trees); float_dir is removed. Returns the manifest record."""
    ids, source = calib
    say(f"calibrating the NPU parts on {source['file']} ({source['tokens']} tokens)")
    for graph, spec in npu_specs.items():
        names = [graph + suffix for suffix in part_suffixes[graph]]
        qdq = quantize_parts(cfg, [float_dir / f"{nm}.onnx" for nm in names], [graphs_dir / f"{nm}.onnx" for nm in names],
                             ids, spec.n, spec.traits.tree, quant.bits, say, head_bits=quant.head_bits)
        for nm in names:
            graphs[nm] = dataclasses.replace(graphs[nm], nodes=len(onnx.load(str(graphs_dir / f"{nm}.onnx"),
                                                                             load_external_data=False).graph.node))
    shutil.rmtree(float_dir)
    return NpuWeights(**qdq, calibration=Calibration(**source))


def _write_tile_graph(cfg: ModelConfig, graphs_dir: Path, prof, chunk: int) -> Tile:
    """The NPU's attention tile (kernels/attention_tile.py) and its bulk form (BULK_TILES tiles a call):
    no weights, so one graph of each serves every layer; never more rows than the model has positions."""
    nkv = cfg.num_key_value_heads
    rows = min(prof.attention_tile, cfg.max_position_embeddings)
    bulk = min(BULK_TILES * rows, cfg.max_position_embeddings // rows * rows)
    entry = {}
    for key, name, n_rows in (("", f"attention_tile.{prof.name}", rows), ("bulk_", f"attention_bulk.{prof.name}", bulk)):
        if key and n_rows <= rows:
            break
        g = GraphBuilder(name)
        emit_attention_tile(g, n=chunk, group=cfg.num_attention_heads // nkv, nkv=nkv, hd=cfg.head_dim, tile=n_rows)
        model = g.model()
        onnx.save_model(model, graphs_dir / f"{name}.onnx")
        entry.update({f"{key}file": f"graphs/{name}.onnx", f"{key}rows": n_rows, f"{key}nodes": len(model.graph.node)})
    return Tile(**entry, n=chunk, inputs=tuple(value_infos(model.graph.input)),
                outputs=tuple(value_infos(model.graph.output)))


def _write_export(ck: Checkpoint, tmp: Path, plan: ExportPlan, say, calib: tuple[list[int], dict] | None = None,
                  final_tap: bool = False) -> Manifest:
    chunk, verify, dtype, prof, quant, npu_quant = (plan.chunk, plan.verify, plan.dtype, plan.profile, plan.quant,
                                                    plan.npu_quant)
    compile_context, max_context, kv_cache = plan.options.compile_context, plan.options.max_context, plan.options.kv_cache
    cfg = ck.config
    plan = WeightPlan(ck.load, DTYPES[dtype], quant)
    # QDQ parts start as fp32 graphs in the quantiser's layout, written aside and quantised into graphs/
    qdq = npu_quant == "qdq"
    npu_plan = WeightPlan(ck.load, np.float32, quantizable=True) if qdq else plan
    graphs_dir = tmp / "graphs"
    graphs_dir.mkdir()
    say(f"building graphs (chunk {chunk})")
    specs = graph_specs(chunk, verify, kv_cache)
    if final_tap:  # an MTP drafter reads the residual after the last layer from every graph
        specs = {name: dataclasses.replace(spec, final_tap=True) for name, spec in specs.items()}
    parts, npu_graphs = {}, []  # graph -> the NPU's (first, end, after_attention, to_attention) layer ranges
    if prof is not None and prof.has_npu:
        weight_parts = plan_parts(cfg, prof.part_weight_bytes, 1 if quant is not None else htp_itemsize(prof))
        npu_graphs = ["prefill"] + (["verify"] if prof.verify_device == "npu" else [])
        # prefill: cut again at every attention core, which runs on the host's tile calls between the
        # segments; the NPU verify keeps whole layers (its K/V capacity T_max, the CPU past it)
        parts = {"prefill": cut_at_attention(cfg, weight_parts),
                 "verify": [(a, b, False, False) for a, b in weight_parts]}
        for graph in npu_graphs:
            for k, (a, b, after, to) in enumerate(parts[graph]):
                # the NPU parts read fp32 K/V (runtime/pipeline.py widens the cache's rows for them, the
                # host's tile calls read the cache as it lies); their attention is the NPU's own
                specs[f"{graph}.{prof.name}.part{k}"] = dataclasses.replace(
                    specs[graph], first_layer=a, end_layer=b, npu=True, after_attention=after, to_attention=to,
                    kv_cache="fp32")
        say(f"profile {prof.name}: {len(weight_parts)} NPU part(s), layers {weight_parts}; prefill in "
            f"{len(parts['prefill'])} segments around the attention cores, attention in tiles of "
            f"{prof.attention_tile} rows")
    builders = {name: build_step_graph(cfg, npu_plan if spec.npu else plan, spec, name) for name, spec in specs.items()}
    say(f"writing weights ({plan.total_bytes() / 1e6:.1f} MB)")
    placements = plan.write(graphs_dir / WEIGHTS_FILE)
    qdq_dir = tmp / ".qdq-float"  # the float parts the quantiser starts from; removed once it is done
    if qdq:
        qdq_dir.mkdir()
        npu_placements = npu_plan.write(qdq_dir / WEIGHTS_FILE)
    graphs = {}
    for name, gb in builders.items():
        aside = qdq and specs[name].npu
        model = gb.model(npu_placements if aside else placements)
        path = (qdq_dir if aside else graphs_dir) / f"{name}.onnx"
        onnx.save_model(model, path)
        onnx.checker.check_model(str(path))
        sized = bool(specs[name].tree_sizes)
        graphs[name] = Graph(file=f"graphs/{name}.onnx", n=specs[name].n, nodes=len(model.graph.node),
                             sizes=tuple(specs[name].tree_sizes) if sized else None, any_count=True if sized else None,
                             inputs=tuple(value_infos(model.graph.input)), outputs=tuple(value_infos(model.graph.output)))
        if not aside:
            say(f"wrote {path.name}: {len(model.graph.node)} nodes")
    npu_weights = None
    if qdq:
        npu_weights = _quantize_npu_parts(cfg, qdq_dir, graphs_dir, graphs, {g: specs[g] for g in npu_graphs},
                                          {g: [f".{prof.name}.part{k}" for k in range(len(parts[g]))] for g in npu_graphs},
                                          quant, calib, say)
    npu = {}
    if parts:
        built = {}  # graph -> (its parts, their context binaries)
        for graph in npu_graphs:
            entries = tuple(dataclasses.replace(graphs.pop(f"{graph}.{prof.name}.part{k}"), layers=(a, b),
                                                **({"after_attention": after, "to_attention": to}
                                                   if graph == "prefill" else {}))
                            for k, (a, b, after, to) in enumerate(parts[graph]))
            built[graph] = (entries, compile_contexts(tmp, [p.file for p in entries], prof, specs[graph].n, say)
                            if compile_context else None)
        tile = _write_tile_graph(cfg, graphs_dir, prof, chunk)
        verify_parts, verify_context = built.get("verify", (None, None))
        npu[prof.name] = NpuEntry(
            attention_capacity=prof.attention_capacity, chunk=chunk, max_context=max_context, profile=prof.to_dict(),
            weights=npu_weights or (NpuWeights(method="nbits", **quant.to_manifest()) if quant else
                                    NpuWeights(method="float")),
            parts=built["prefill"][0], context=built["prefill"][1], verify_parts=verify_parts,
            verify_context=verify_context, tile=tile,
            tile_context=compile_contexts(tmp, tile.files, prof, chunk, say) if compile_context else None)
    tokenizer_files = []
    for f in TOKENIZER_FILES:
        if (ck.path / f).exists():
            shutil.copy2(ck.path / f, tmp / f)
            tokenizer_files.append(f)
    chat_template, template_file = chat_files.chat_template(tmp)
    _, stop_sources = chat_files.stop_token_ids(ck.path, ck.raw_config, text_config(ck.raw_config))
    manifest = Manifest(
        format=FORMAT,
        source={"path": str(ck.path.resolve()), "model_type": ck.model_type, "fingerprint": ck.fingerprint(),
                "dtype": ck.source_dtype, "mtp_tensors": ck.mtp_tensors},
        config=cfg.to_dict(), dtype=dtype, kv_cache=kv_cache, chunk=chunk, graphs=graphs, npu=npu,
        weights=Weights(file=f"graphs/{WEIGHTS_FILE}", bytes=(graphs_dir / WEIGHTS_FILE).stat().st_size,
                        params=plan.total_params(), **(quant.to_manifest() if quant else {"mode": "float"}),
                        prepacked_bytes=plan.prepacked_bytes() if quant else None),
        state={"layers": state_layout(cfg), "state_bytes": cfg.state_bytes(),
               "kv_bytes_per_token": cfg.kv_bytes_per_token(kv_cache), "tap_layers": list(cfg.tap_layers)},
        tokenizer=Tokenizer(files=tuple(tokenizer_files), chat_template=chat_template,
                            chat_template_file=template_file, stop_token_ids=tuple(cfg.eos_token_ids),
                            stop_token_sources=stop_sources),
        generation=chat_files.sampling_defaults(tmp))  # the chat defaults (generation_config.json)
    manifest.write(tmp)
    return manifest
