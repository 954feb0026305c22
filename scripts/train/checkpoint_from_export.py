"""Rebuild the source checkpoints of a float export from the export itself: the target as a
transformers-loadable Qwen3.5 checkpoint and the EAGLE-3 drafter in the layout
scripts/train/train_drafter.py writes (so `export(..., drafter=DIR)` takes it again).

    python scripts/train/checkpoint_from_export.py EXPORT_DIR OUT_DIR     # writes OUT_DIR/target, OUT_DIR/drafter

Written for the embedded default model, whose training checkpoints are gone. The exporter's weight
transforms (export/weights.py: stacked projections, the conv weight transposed, casts) are not
inverted one by one: the export's own graph builders run over a checkpoint whose every element
holds its own index, so each stored array says which source element every one of its entries came
from, and the stored values are scattered back there. Any later transform the builders add is
inverted with no change here. Each source element must be found at least once, and wherever it
is stored more than once (the drafter's copy of the target's embedding) with the same value.
Norm offsets (Qwen3.5's zero-centred 1 + w) live in the graphs, not in the stored weights, so the
weights come back as the checkpoint held them, rounded to the export's storage (fp16 matrices).
Quantised exports cannot be inverted (their blocks are lossy): refused. A float target beside a
quantised drafter (`--drafter-weights int8`, as the embedded model ships)
gives its target only. The embedded model's float drafter is the fp16 drafter/ of the package before
that change (git: the parent of the commit that made it int8); this script rebuilds both from it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx

from hybrid_npu.config import ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.export.checkpoint import expected_shapes as target_shapes
from hybrid_npu.export.drafters.eagle3 import (DrafterCheckpoint, DrafterConfig, build_drafter_graphs,
                                       expected_shapes as drafter_shapes)
from hybrid_npu.export.exporter import graph_specs
from hybrid_npu.export.step_graph import build_step_graph
from hybrid_npu.export.weights import WeightPlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
EXACT_IDS = 1 << 24  # indices ride through the builders' float32 casts (vectors, conv): exact below 2^24
NP_OF = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def stored_arrays(graph_files: list[Path]) -> dict[str, np.ndarray]:
    """Every external initializer of these graphs, read from its weights file (name -> array)."""
    out = {}
    for f in graph_files:
        model = onnx.load(str(f), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL or t.name in out:
                continue
            info = {e.key: e.value for e in t.external_data}
            dtype = NP_OF.get(t.data_type)
            if dtype is None:
                raise UserError(f"{f.name}: weight {t.name} is stored as ONNX type {t.data_type}, not float: "
                                "a quantised export cannot be turned back into a checkpoint")
            with open(f.parent / info["location"], "rb") as w:
                w.seek(int(info["offset"]))
                raw = w.read(int(info["length"]))
            out[t.name] = np.frombuffer(raw, dtype).reshape(tuple(t.dims))
    return out


def invert(shapes: dict[str, tuple[int, ...]], build, stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Source tensors (float32) from the stored arrays. build(plan) fills `plan` as the exporter does,
    reading the checkpoint through plan.load."""
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += int(np.prod(shape))
    if total >= EXACT_IDS:
        raise UserError(f"{total} source elements: this inversion handles models under {EXACT_IDS} parameters")

    def ids(name):
        return np.arange(offsets[name], offsets[name] + int(np.prod(shapes[name])), dtype=np.float64).reshape(
            shapes[name])

    plan = WeightPlan(ids, np.float64)
    build(plan)
    flat = np.full(total, np.nan, np.float32)
    for name, entry in plan.entries.items():
        if name not in stored:
            raise UserError(f"the export does not store {name}, which its graphs read")
        where = np.asarray(entry.make()).astype(np.int64).ravel()
        values = stored[name].astype(np.float32).ravel()
        seen = ~np.isnan(flat[where])
        if not np.array_equal(flat[where][seen], values[seen]):
            raise UserError(f"{name}: a source element stored twice with two values; not an export of one checkpoint")
        flat[where] = values
    missing = [n for n in shapes if np.isnan(flat[offsets[n]:offsets[n] + int(np.prod(shapes[n]))]).any()]
    if missing:
        raise UserError(f"source tensor {missing[0]} is not (wholly) in the export")
    return {n: flat[offsets[n]:offsets[n] + int(np.prod(s))].reshape(s).copy() for n, s in shapes.items()}


def target_tensors(export_dir: Path, manifest: dict) -> dict[str, np.ndarray]:
    cfg = ModelConfig.from_dict(manifest["config"])
    graphs = manifest["graphs"]
    verify = graphs["verify"]["n"] if "verify" in graphs else 32
    specs = graph_specs(manifest["chunk"], verify)

    def build(plan):
        for name in graphs:
            build_step_graph(cfg, plan, specs[name], name)

    stored = stored_arrays([export_dir / g["file"] for g in graphs.values()])
    return invert(target_shapes(cfg), build, stored)


def drafter_tensors(export_dir: Path, manifest: dict, target_cfg: ModelConfig) -> tuple[dict, DrafterConfig, np.ndarray]:
    ddir = export_dir / manifest["drafter"]["dir"]
    dman = json.loads((ddir / "drafter.json").read_text())
    c = dict(dman["config"])
    c["tap_layers"] = tuple(c["tap_layers"])
    dcfg = DrafterConfig(**c)
    shapes = drafter_shapes(dcfg)
    from safetensors.numpy import load_file

    d2t = load_file(str(ddir / dman["vocab"]["file"]))[dman["vocab"]["tensor"]]

    def build(plan):
        ck = DrafterCheckpoint(path=ddir, config=dcfg, raw_config={}, target_tap_layers=tuple(target_cfg.tap_layers),
                               shapes=shapes, loaders={n: (lambda n=n: plan.load(n)) for n in shapes},
                               draft_to_target=d2t)
        build_drafter_graphs(ck, plan)

    stored = stored_arrays([ddir / g["file"] for g in dman["graphs"].values()])
    return invert(shapes, build, stored), dcfg, d2t


def write_target(export_dir: Path, manifest: dict, tensors: dict, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    from train_target import model_config

    tok = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    cfg = model_config(manifest["config"]["vocab_size"], tok)
    model = Qwen3_5ForCausalLM(cfg).float()
    state = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): torch.from_numpy(a)
             for n, a in tensors.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"the rebuilt tensors do not fit Qwen3_5ForCausalLM: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    gen = json.loads((export_dir / "generation_config.json").read_text())
    gen.pop("transformers_version", None)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(**gen)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(export_dir / f, out / f)


def write_drafter(tensors: dict, dcfg: DrafterConfig, d2t: np.ndarray, target_embed: np.ndarray, out: Path) -> None:
    import torch

    from eagle3_model import DraftShape, Drafter, save_checkpoint

    shape = DraftShape(hidden_size=dcfg.hidden_size, num_attention_heads=dcfg.num_attention_heads,
                       num_key_value_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim,
                       intermediate_size=dcfg.intermediate_size, vocab_size=dcfg.vocab_size,
                       draft_vocab_size=dcfg.draft_vocab_size, target_hidden_size=dcfg.target_hidden_size,
                       n_taps=len(dcfg.tap_layers), rms_norm_eps=dcfg.rms_norm_eps, rope_theta=dcfg.rope_theta)
    if dcfg.embedding != "target" or not np.array_equal(tensors["embed_tokens.weight"], target_embed):
        raise UserError("the drafter's embedding is not the target's; train_drafter.py's layout shares it")
    drafter = Drafter(shape, torch.from_numpy(target_embed))
    state = {n: torch.from_numpy(a) for n, a in tensors.items() if n != "embed_tokens.weight"}
    drafter.load_state_dict(state, strict=True)
    save_checkpoint(drafter, d2t, dcfg.tap_layers, out)


def rebuild(export_dir, out_dir) -> tuple[Path, Path | None]:
    """EXPORT_DIR -> OUT_DIR/target (and OUT_DIR/drafter when the export has one)."""
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    manifest = json.loads((export_dir / "model.json").read_text())
    if manifest["weights"].get("mode", "float") != "float":
        raise UserError(f"{export_dir} has {manifest['weights']['mode']} weights: a quantised export cannot be "
                        "turned back into a checkpoint")
    training = {}
    if (export_dir / "training.json").exists():
        training = json.loads((export_dir / "training.json").read_text())
    note = {"rebuilt_from": str(export_dir), "by": "scripts/train/checkpoint_from_export.py",
            "storage": manifest["dtype"], "source_fingerprint": manifest["source"]["fingerprint"]}
    tensors = target_tensors(export_dir, manifest)
    target = out_dir / "target"
    target.mkdir(parents=True, exist_ok=True)
    write_target(export_dir, manifest, tensors, target)
    if "target" in training:  # build_embedded_model.py carries the training record into the package
        (target / "train_log.json").write_text(json.dumps(training["target"]) + "\n")
    (target / "rebuilt.json").write_text(json.dumps(note, indent=1) + "\n")
    if "drafter" not in manifest:
        return target, None
    if (manifest["drafter"].get("weights") or {}).get("quant"):
        print(f"checkpoint_from_export: {manifest['drafter']['dir']}/ has "
              f"{manifest['drafter']['weights']['quant']['mode']} weights, which cannot be turned back into a "
              "checkpoint: the target only", file=sys.stderr)
        return target, None
    dtensors, dcfg, d2t = drafter_tensors(export_dir, manifest, ModelConfig.from_dict(manifest["config"]))
    drafter = out_dir / "drafter"
    write_drafter(dtensors, dcfg, d2t, tensors["embed_tokens.weight"], drafter)
    if "drafter" in training:
        (drafter / "train_log.json").write_text(json.dumps(training["drafter"]) + "\n")
    (drafter / "rebuilt.json").write_text(json.dumps(note, indent=1) + "\n")
    return target, drafter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    try:
        target, drafter = rebuild(args.export_dir, args.out_dir)
    except UserError as e:
        print(f"checkpoint_from_export: error: {e}", file=sys.stderr)
        return 2
    print(f"target: {target}" + (f"\ndrafter: {drafter}" if drafter else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
