"""scripts/train/checkpoint_from_export.py turns the shipped embedded export back into its source
checkpoints: transformers' Qwen3.5 on the rebuilt target gives the shipped graphs' logits, and
exporting the rebuilt target again stores exactly the shipped bytes for every weight. The shipped
drafter is int8 (left out of the rebuild); a float drafter's round trip is held on a test export."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import hybrid_npu
from hybrid_npu.config import ModelConfig
from hybrid_npu.export.checkpoint import read_checkpoint
from hybrid_npu.export.drafters.eagle3 import build_drafter_graphs, read_drafter
from hybrid_npu.export.exporter import graph_specs
from hybrid_npu.export.step_graph import build_step_graph
from hybrid_npu.export.weights import WeightPlan

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train" / "checkpoint_from_export.py"
PROMPT = "def read_first_line(path):\n    \"\"\"Return the first line of a text file.\"\"\"\n"


def _script():
    spec = importlib.util.spec_from_file_location("checkpoint_from_export", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("rebuilt")
    mod = _script()
    target, drafter = mod.rebuild(hybrid_npu.default_model(), out)
    return mod, target, drafter


def test_transformers_on_the_rebuilt_target_gives_the_shipped_graphs_logits(rebuilt):
    import torch
    from transformers import AutoModelForCausalLM

    _, target, _ = rebuilt
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1)
    ids = engine.tokenizer.encode(PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    for n in (len(ids) // 2, len(ids)):  # two prefix lengths: positions inside and at the end
        ours = engine.prefill_logits(ids[:n])
        assert np.abs(ours - ref[n - 1]).max() <= 1e-3, np.abs(ours - ref[n - 1]).max()
        assert ours.argmax() == ref[n - 1].argmax()


def test_exporting_the_rebuilt_target_again_stores_the_shipped_bytes(rebuilt):
    mod, target, drafter = rebuilt
    root = hybrid_npu.default_model()
    manifest = json.loads((root / "model.json").read_text())
    ck = read_checkpoint(target)
    assert ck.config == ModelConfig.from_dict(manifest["config"])
    plan = WeightPlan(ck.load, np.float16)  # what export(dtype="fp16") plans
    specs = graph_specs(manifest["chunk"], manifest["graphs"]["verify"]["n"])
    for name in manifest["graphs"]:
        build_step_graph(ck.config, plan, specs[name], name)
    shipped = mod.stored_arrays([root / g["file"] for g in manifest["graphs"].values()])
    assert set(plan.entries) == set(shipped)
    for name, entry in plan.entries.items():
        made = np.ascontiguousarray(entry.make(), dtype=entry.dtype)
        assert made.tobytes() == shipped[name].tobytes(), name

    assert drafter is None  # the shipped drafter is int8 (--drafter-weights): no checkpoint to rebuild


def test_a_quantised_drafter_is_left_out_of_the_rebuild_in_one_line(rebuilt, capsys, tmp_path):
    mod, _, _ = rebuilt
    manifest = json.loads((hybrid_npu.default_model() / "model.json").read_text())
    assert manifest["drafter"]["weights"]["quant"]["bits"] == 8
    target, drafter = mod.rebuild(hybrid_npu.default_model(), tmp_path)
    err = capsys.readouterr().err
    assert drafter is None and not (tmp_path / "drafter").exists() and (target / "config.json").exists()
    said = [line for line in err.splitlines() if line.startswith("checkpoint_from_export:")]  # (transformers' bars too)
    assert len(said) == 1 and "int8 weights" in said[0], err


def test_a_float_drafter_rebuilt_and_exported_again_stores_the_same_bytes(text_tied, tmp_path):
    import drafter_fixtures
    from conftest import CHUNK
    from hybrid_npu.export.exporter import export

    src = drafter_fixtures.write_eagle3(tmp_path / "eagle3", drafter_fixtures.drafter_weights(seed=1, hidden_size=48,
                                                                                              embed=False), hidden_size=48)
    export(text_tied.src, tmp_path / "export", chunk=CHUNK, dtype="fp16", drafter=src)
    mod = _script()
    root = tmp_path / "export"
    manifest = json.loads((root / "model.json").read_text())
    ck = read_checkpoint(text_tied.src)  # (the script's target rebuild is written for the embedded model's config)
    dtensors, dcfg, d2t = mod.drafter_tensors(root, manifest, ck.config)
    drafter = tmp_path / "rebuilt" / "drafter"
    embed = ck.load("embed_tokens.weight").astype(np.float16).astype(np.float32)  # as the fp16 export stores it
    mod.write_drafter(dtensors, dcfg, d2t, embed, drafter)
    dck = read_drafter(drafter, ck.config, lambda: embed)
    dplan = WeightPlan(dck.load, np.float16)
    build_drafter_graphs(dck, dplan)
    dman = json.loads((root / "drafter" / "drafter.json").read_text())
    dshipped = mod.stored_arrays([root / "drafter" / g["file"] for g in dman["graphs"].values()])
    assert set(dplan.entries) == set(dshipped)
    for name, entry in dplan.entries.items():
        assert np.ascontiguousarray(entry.make(), dtype=entry.dtype).tobytes() == dshipped[name].tobytes(), name
    from safetensors.numpy import load_file
    assert np.array_equal(dck.draft_to_target, load_file(str(root / "drafter" / "vocab.safetensors"))["draft_to_target"])
    assert dck.config.tap_layers == tuple(dman["config"]["tap_layers"])
