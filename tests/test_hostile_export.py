"""Hostile checkpoints and output folders for export-hybrid (issue 52): every one refused by the
real CLI in one line with exit 2, no traceback, under a memory and time bound (tests/hostile.py),
with the user's files where they were."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import fixtures
from hostile import assert_refused, error_lines, run_bounded

EXPORT = ["-m", "hybrid_npu.export.cli"]


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile") / "hf"
    fixtures.write_text_checkpoint(d, seed=0)
    return d


@pytest.fixture()
def ckpt(base_ckpt, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(base_ckpt, d)
    return d


def export(src, out, *flags, **kw):
    return run_bounded([*EXPORT, src, out, "--chunk", 4, *flags], cwd=Path(src).parent, **kw)


def tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def dev_zero() -> str:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    return "/dev/zero"


def fifo(path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _weights(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def rewrite_header(ckpt: Path, edit) -> None:
    """Edit the safetensors header of the checkpoint's weights in place (data bytes unchanged)."""
    f = _weights(ckpt)
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    assert len(raw) == n, "the edit must not grow the header"
    f.write_bytes(data[:8] + raw + data[8 + n:])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


# ---- 10 and 12: the checkpoint's files -----------------------------------------------------------
def _config_dev_zero(ckpt):
    (ckpt / "config.json").unlink()
    os.symlink(dev_zero(), ckpt / "config.json")
    return "not a regular file"


def _config_fifo(ckpt):
    fifo(ckpt / "config.json")
    return "not a regular file"


def _tokenizer_dev_zero(ckpt):
    (ckpt / "tokenizer.json").unlink()
    os.symlink(dev_zero(), ckpt / "tokenizer.json")
    return "tokenizer.json"


def _tokenizer_fifo(ckpt):
    fifo(ckpt / "tokenizer_config.json")
    return "tokenizer_config.json"


def _config_deep(ckpt):
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return "nests too deeply"


def _config_deep_value(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = json.loads('{"a": ' * 200 + "1" + "}" * 200)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return "nests deeper than"


def _header_non_dict_entry(ckpt):
    rewrite_header(ckpt, lambda h: h.update({_first_tensor(h): [1, 2]}))
    return "damaged header entry"


def _header_negative_offset(ckpt):
    def edit(h):
        e = h[_first_tensor(h)]
        e["data_offsets"] = [-64, e["data_offsets"][1]]
    rewrite_header(ckpt, edit)
    return "data_offsets"


def _header_is_a_list(ckpt):
    f = _weights(ckpt)
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    f.write_bytes(data[:8] + b"[]" + b" " * (n - 2) + data[8 + n:])
    return "not a JSON object"


def _header_length_huge(ckpt):
    f = _weights(ckpt)
    with open(f, "r+b") as fh:
        fh.write(struct.pack("<Q", 1 << 62))
    return "header length out of range"


def _index_is_a_list(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[1, 2, 3]")
    return "not a valid safetensors index"


def _index_points_outside(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    return "not a valid safetensors index"


def _fewer_layers_than_weights(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    cfg["layer_types"] = cfg["layer_types"][:4]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return "declares 4 layers"


CHECKPOINTS = {
    "config.json -> /dev/zero": _config_dev_zero,
    "config.json a FIFO": _config_fifo,
    "tokenizer.json -> /dev/zero": _tokenizer_dev_zero,
    "tokenizer_config.json a FIFO": _tokenizer_fifo,
    "config.json nested 100k deep": _config_deep,
    "config.json value nested 200 deep": _config_deep_value,
    "safetensors entry not a dict": _header_non_dict_entry,
    "safetensors negative offset": _header_negative_offset,
    "safetensors header a list": _header_is_a_list,
    "safetensors header length 2^62": _header_length_huge,
    "index file a list": _index_is_a_list,
    "index naming a file outside": _index_points_outside,
    "config with fewer layers than the weights": _fewer_layers_than_weights,
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_hostile_checkpoint_is_refused(ckpt, tmp_path, name):
    needle = CHECKPOINTS[name](ckpt)
    assert_refused(export(ckpt, tmp_path / "out"), needle)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    src = tmp_path / "hf"
    fixtures.write_text_checkpoint(src, seed=0, vocab_size=fixtures.TOKENIZER_VOCAB_SIZE - 20, pad_token_id=0)
    assert_refused(export(src, tmp_path / "out"), "tokenizer.json", "vocabulary has")


# ---- 9 and 12: what an existing output folder holds -----------------------------------------------
def _fake_export(out: Path, manifest) -> None:
    (out / "graphs").mkdir(parents=True)
    (out / "graphs" / "cpu.onnx").write_bytes(b"graph")
    (out / "model.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))


VALID = {"format": "hybrid-npu/2", "integrity": {"algorithm": "sha256", "files": {"graphs/cpu.onnx": {}}}}


@pytest.mark.parametrize("flags", [[], ["--force"]], ids=["plain", "force"])
def test_reexport_refuses_a_folder_holding_a_saved_chat(ckpt, tmp_path, flags):
    out = tmp_path / "out"
    _fake_export(out, VALID)
    (out / "chat.state").write_bytes(b"the user's conversation")
    before = tree(out)
    assert_refused(export(ckpt, out, *flags), "chat.state", "did not write")
    assert tree(out) == before


def test_force_refuses_a_damaged_export_holding_other_files(ckpt, tmp_path):
    out = tmp_path / "out"
    _fake_export(out, "{ damaged")
    (out / "notes.txt").write_text("mine")
    (out / "graphs" / "mine.onnx").write_bytes(b"kept")  # under graphs/, but an integrity list cannot vouch
    before = tree(out)
    assert_refused(export(ckpt, out, "--force"), "notes.txt")
    assert tree(out) == before


def test_output_whose_model_json_is_a_list(ckpt, tmp_path):
    out = tmp_path / "out"
    _fake_export(out, "[]")
    before = tree(out)
    assert_refused(export(ckpt, out), "damaged or older", "--force")
    assert tree(out) == before


def test_output_whose_model_json_is_dev_zero(ckpt, tmp_path):
    out = tmp_path / "out"
    _fake_export(out, "{}")
    (out / "model.json").unlink()
    os.symlink(dev_zero(), out / "model.json")
    assert_refused(export(ckpt, out, "--force"), "model.json")
    assert (out / "graphs" / "cpu.onnx").read_bytes() == b"graph"


@pytest.mark.slow
def test_reexport_over_a_real_export_keeps_what_the_user_put_there(ckpt, tmp_path):
    out = tmp_path / "out"
    first = export(ckpt, out, "--quiet", "--no-parity", rss_mb=3000)
    assert first.rc == 0, first.err
    (out / "chat.state").write_bytes(b"saved chat")
    assert_refused(export(ckpt, out, "--no-parity", rss_mb=3000), "chat.state")
    assert (out / "chat.state").read_bytes() == b"saved chat"
    (out / "chat.state").unlink()
    again = export(ckpt, out, "--quiet", "--no-parity", rss_mb=3000)  # only its own files: replaced
    assert again.rc == 0, again.err


# ---- 13: said at export, and children that end with their parent ---------------------------------
@pytest.mark.slow
def test_a_checkpoint_without_a_chat_template_is_said_at_export(ckpt, tmp_path):
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    run = export(ckpt, tmp_path / "out", "--quiet", "--no-parity", rss_mb=3000)
    assert run.rc == 0, run.err
    warnings = [line for line in error_lines(run.err) if "warning" in line]
    assert len(warnings) == 1 and "no chat template" in warnings[0], run.err


def test_a_child_ends_with_its_parent():
    """export/npu/check.py's compile worker watches the export that started it (hybrid_npu.orphan):
    a parent killed outright leaves no compiler behind. A stand-in parent and child show it."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        import psutil

        started = int(psutil.Process(parent.pid).create_time() * 1000)
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; from hybrid_npu.orphan import "
                                  "exit_with_parent; exit_with_parent(sys.argv[1]); print('up', flush=True); "
                                  "time.sleep(600)", f"{parent.pid}:{started}"], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "up"
        assert child.poll() is None  # runs while its parent does
        parent.kill()
        parent.wait()
        try:
            code = child.wait(timeout=60)  # a hang guard: it polls every 0.5 s
        except subprocess.TimeoutExpired:
            child.kill()
            raise AssertionError("the child outlived its parent")
        assert code == 3
    finally:
        parent.kill()


def test_the_compile_worker_is_told_its_parent(monkeypatch):
    import hybrid_npu
    import psutil
    from hybrid_npu.export.npu import check as npu_check

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        raise subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(npu_check.subprocess, "run", fake_run)
    npu_check.compile_on_npu(hybrid_npu.default_model() / "graphs" / "decode.onnx", {}, timeout=1)
    cmd = seen["cmd"]
    pid, started = cmd[cmd.index("--parent") + 1].split(":")
    me = psutil.Process()
    assert int(pid) == me.pid and abs(int(started) - me.create_time() * 1000) < 1000
