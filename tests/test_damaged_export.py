"""A damaged or lying export is refused at load in one line (UserError; CLIs exit 2), before it
produces text: truncated/empty/flipped weights, model.json that is not JSON, lacks its config or
contradicts the graphs, a tokenizer that does not load."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu import integrity


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_NPU_CACHE", str(tmp_path / "cache"))  # verified-file cache of this test only


@pytest.fixture()
def export_copy(text_tied, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(text_tied.out, out)
    return out


def edit_manifest(out: Path, edit) -> None:
    m = json.loads((out / "model.json").read_text())
    edit(m)
    (out / "model.json").write_text(json.dumps(m))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def weights(out: Path) -> Path:
    return out / "graphs" / "weights.bin"


def _truncate(out):
    os.truncate(weights(out), weights(out).stat().st_size // 2)


def _empty(out):
    os.truncate(weights(out), 0)


def _not_json(out):
    (out / "model.json").write_text('{"format": "hybrid-npu/2", ')


def _no_config(out):
    edit_manifest(out, lambda m: m.pop("config"))


def _config_missing_key(out):
    edit_manifest(out, lambda m: m["config"].pop("hidden_size"))


def _config_zero_heads(out):
    edit_manifest(out, lambda m: m["config"].update(num_key_value_heads=0))


def _lying_vocab(out):
    edit_manifest(out, lambda m: m["config"].update(vocab_size=m["config"]["vocab_size"] + 16))


def _lying_kv_heads(out):
    edit_manifest(out, lambda m: m["config"].update(num_key_value_heads=1))


def _lying_layers(out):
    edit_manifest(out, lambda m: m["config"].update(layer_types=m["config"]["layer_types"][:-1]))


def _lying_hidden(out):
    edit_manifest(out, lambda m: m["config"].update(hidden_size=m["config"]["hidden_size"] * 2))


def _lying_chunk(out):
    edit_manifest(out, lambda m: m.update(chunk=m["chunk"] * 2))


def _broken_tokenizer(out):
    """In an export without hashes (with them, the size check names the file first)."""
    (out / "tokenizer.json").write_text('{"model": ')
    edit_manifest(out, lambda m: m.pop("integrity"))


def _flipped_tokenizer(out):
    flip_byte(out / "tokenizer.json", 10)


DAMAGE = {  # damage -> a phrase the one-line error must contain
    "truncated weights": (_truncate, "truncated or damaged"),
    "empty weights": (_empty, "is 0 bytes"),
    "model.json not JSON": (_not_json, "not valid JSON"),
    "no config": (_no_config, "no valid 'config'"),
    "config missing key": (_config_missing_key, "not a model config"),
    "zero kv heads": (_config_zero_heads, "num_key_value_heads"),
    "vocab contradicts graphs": (_lying_vocab, "vocab_size"),
    "kv heads contradict graphs": (_lying_kv_heads, "contradicts"),
    "layers contradict graphs": (_lying_layers, "contradicts"),
    "hidden size contradicts graphs": (_lying_hidden, "hidden_size"),
    "chunk contradicts graphs": (_lying_chunk, "chunk"),
    "broken tokenizer": (_broken_tokenizer, "tokenizer.json does not load"),
    "flipped tokenizer": (_flipped_tokenizer, "tokenizer.json does not match the sha256"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_load_refuses_in_one_line(export_copy, kind):
    damage, needle = DAMAGE[kind]
    damage(export_copy)
    with pytest.raises(UserError) as e:
        hybrid_npu.load_engine(export_copy)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_flipped_weight_bytes_are_caught_before_any_text(export_copy, text_tied):
    ref = hybrid_npu.load_engine(text_tied.out).prefill_logits([1, 2, 3])
    flip_byte(weights(export_copy), weights(export_copy).stat().st_size // 2)
    # the hash is what catches it: with the check bypassed the same export loads and answers differently
    m = json.loads((export_copy / "model.json").read_text())
    unchecked = export_copy.parent / "unchecked"
    shutil.copytree(export_copy, unchecked)
    edit_manifest(unchecked, lambda m: m.pop("integrity"))
    assert not np.allclose(hybrid_npu.load_engine(unchecked).prefill_logits([1, 2, 3]), ref)
    with pytest.raises(UserError, match="does not match the sha256.*damaged"):
        hybrid_npu.load_engine(export_copy)
    assert m["integrity"]["files"]["graphs/weights.bin"]["bytes"] == weights(export_copy).stat().st_size


def test_hash_is_checked_once_then_again_after_any_write(export_copy, monkeypatch):
    calls = []
    real = integrity.file_hash
    monkeypatch.setattr(integrity, "file_hash", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    hybrid_npu.load_engine(export_copy)
    assert "weights.bin" in calls  # first load of these files: hashed
    calls.clear()
    hybrid_npu.load_engine(export_copy)
    assert calls == []  # unchanged since: the cache vouches for them
    st = weights(export_copy).stat()
    flip_byte(weights(export_copy), 100)
    os.utime(weights(export_copy), ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back
    with pytest.raises(UserError, match="does not match"):
        hybrid_npu.load_engine(export_copy)


def test_verify_always_ignores_the_cache(export_copy, monkeypatch):
    hybrid_npu.load_engine(export_copy)
    monkeypatch.setenv("HYBRID_NPU_VERIFY", "always")
    calls = []
    real = integrity.file_hash
    monkeypatch.setattr(integrity, "file_hash", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    hybrid_npu.load_engine(export_copy)
    assert "weights.bin" in calls


def test_export_without_hashes_still_loads_and_answers_the_same(export_copy, text_tied):
    """Exports from before integrity hashes (the manifest has no "integrity"): loaded, size-checked."""
    edit_manifest(export_copy, lambda m: m.pop("integrity"))
    ref = hybrid_npu.load_engine(text_tied.out).prefill_logits([5, 6, 7])
    assert np.array_equal(hybrid_npu.load_engine(export_copy).prefill_logits([5, 6, 7]), ref)
    _truncate(export_copy)
    with pytest.raises(UserError, match="truncated or damaged"):
        hybrid_npu.load_engine(export_copy)


def test_a_missing_file_is_named(export_copy):
    (export_copy / "graphs" / "decode.onnx").unlink()
    with pytest.raises(UserError, match="decode.onnx is missing"):
        hybrid_npu.load_engine(export_copy)


def _cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=300)  # HYBRID_NPU_CACHE: inherited from private_cache


@pytest.mark.parametrize("kind", ["truncated weights", "model.json not JSON", "broken tokenizer"])
def test_clis_exit_2_in_one_line(export_copy, tmp_path, kind):
    DAMAGE[kind][0](export_copy)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document about nothing in particular.\n")
    for proc in (_cli("hybrid_npu.runtime.chat.cli", "--prompt", "hi", export_copy),
                 _cli("hybrid_npu.runtime.summarize_cli", doc, "--quiet", "--model", export_copy)):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert DAMAGE[kind][1] in proc.stderr


def test_damaged_drafter_manifest_is_one_line(tmp_path):
    """The embedded model carries a drafter: its drafter.json damaged (and re-hashed, so only the
    reader can object) is refused in one line, not a traceback."""
    out = shutil.copytree(hybrid_npu.DEFAULT_MODEL, tmp_path / "model")
    dj = out / "drafter" / "drafter.json"
    m = json.loads(dj.read_text())
    m.pop("config")
    dj.write_text(json.dumps(m))
    manifest = json.loads((out / "model.json").read_text())
    manifest["integrity"] = integrity.record(out)
    (out / "model.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="drafter .* does not load") as e:
        hybrid_npu.load_engine(out)
    assert "\n" not in str(e.value)
