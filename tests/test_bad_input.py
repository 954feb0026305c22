"""Every bad input ends in one line naming the problem, exit code 2, no traceback, and nothing
half-written in the output directory."""
import json
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import fixtures
import hybrid_npu
from hybrid_npu.errors import UserError


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hybrid_npu.export.cli", *map(str, args)], cwd=Path(args[0]).parent,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or (lines[0].startswith("usage:") and len(lines) <= 3), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


@pytest.fixture()
def ckpt(tmp_path):
    fixtures.write_text_checkpoint(tmp_path / "hf", seed=0)
    return tmp_path / "hf"


def test_missing_path(tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(run_cli(tmp_path / "nope", out), "does not exist")
    assert_nothing_written(out)


def test_no_config(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert_one_line_error(run_cli(tmp_path / "empty", out), "no config.json")
    assert_nothing_written(out)


def test_unsupported_model_type(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "'llama'", "qwen3_5", "qwen3_5_text", "qwen3_next")
    assert_nothing_written(tmp_path / "out")


def _rewrite_weights(ckpt, edit):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor(ckpt, tmp_path):
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.3.linear_attn.A_log"))
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "layers.3.linear_attn.A_log", "missing")
    assert_nothing_written(tmp_path / "out")


def test_wrong_shape_names_both_shapes(ckpt, tmp_path):
    def edit(t):
        t["model.layers.2.self_attn.k_proj.weight"] = np.zeros((40, 48), np.float32)
    _rewrite_weights(ckpt, edit)
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "layers.2.self_attn.k_proj.weight", "(40, 48)", "(48, 48)")
    assert_nothing_written(tmp_path / "out")


def test_truncated_weights(ckpt, tmp_path):
    fixtures.corrupt_truncate(ckpt / "model.safetensors", 1000)
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "truncated")
    assert_nothing_written(tmp_path / "out")


def test_pickle_only_refused(tmp_path):
    fixtures.write_pickle_only_checkpoint(tmp_path / "pkl")
    assert_one_line_error(run_cli(tmp_path / "pkl", tmp_path / "out"), "pickle", "safetensors")
    assert_nothing_written(tmp_path / "out")


def test_qwen3_next_moe_refused(tmp_path):
    fixtures.write_qwen3_next_checkpoint(tmp_path / "moe", moe=True)
    assert_one_line_error(run_cli(tmp_path / "moe", tmp_path / "out"), "MoE", "not supported yet")
    assert_nothing_written(tmp_path / "out")


def test_foreign_output_dir_refused_even_with_force(ckpt, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for flags in ([], ["--force"]):  # --force replaces only damaged exports (tests/test_faults_export.py)
        assert_one_line_error(run_cli(ckpt, out, "--chunk", 4, *flags), "not a hybrid-npu export")
        assert (out / "notes.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"
    assert run_cli(ckpt, fresh, "--chunk", 4, "--quiet").returncode == 0
    again = run_cli(ckpt, fresh, "--chunk", 4, "--quiet")  # our own export: replaced without --force
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("flags,needle", [(["--chunk", "1"], "--chunk"), (["--dtype", "bf16"], "--dtype"),
                                          (["--bogus"], "--bogus")])
def test_bad_flags(ckpt, tmp_path, flags, needle):
    assert_one_line_error(run_cli(ckpt, tmp_path / "out", *flags), needle)
    assert_nothing_written(tmp_path / "out")


def test_runtime_refuses_a_non_export(tmp_path, ckpt):
    with pytest.raises(UserError, match="not a hybrid-npu export.*export-hybrid"):
        hybrid_npu.load_engine(ckpt)


def test_runtime_refuses_out_of_vocab_ids(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.prefill_logits([1, 2, 10**6])
    with pytest.raises(UserError, match="empty prompt"):
        engine.prefill_logits([])
