"""Fault injection on export-hybrid: nothing a user owns is ever deleted, a killed export's
leftovers are cleaned by the next one, and every bad input or full/read-only disk is one line,
exit 2, no traceback, nothing half-written."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import fixtures


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hybrid_npu.export.cli", *map(str, args)],
                          cwd=cwd or Path(str(args[0])).parent, capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]  # progress
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def no_partials(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name]


def tree(root: Path) -> dict:
    """Every file under root and its bytes: what must survive a refused export untouched."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def ckpt(tmp_path):
    fixtures.write_text_checkpoint(tmp_path / "hf", seed=0)
    return tmp_path / "hf"


def edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


# ---- 1. --force never deletes the source or a directory that is not an export ----------------
def test_force_onto_a_folder_holding_the_source_deletes_nothing(tmp_path):
    proj = tmp_path / "proj"
    fixtures.write_text_checkpoint(proj / "tiny", seed=0)
    (proj / "notes.txt").write_text("the user's other work")
    before = tree(proj)
    for out in (proj, proj / "tiny"):  # contains the source; is the source
        assert_one_line_error(run_cli(proj / "tiny", out, "--chunk", 4, "--force"), "source checkpoint")
    assert tree(proj) == before and no_partials(tmp_path) and no_partials(proj)


def test_force_never_replaces_a_folder_inside_the_source(ckpt):
    (ckpt / "extra").mkdir()
    (ckpt / "extra" / "keep.txt").write_text("keep")
    before = tree(ckpt)
    assert_one_line_error(run_cli(ckpt, ckpt / "extra", "--chunk", 4, "--force"), "inside the source")
    assert tree(ckpt) == before
    for _ in range(2):  # a valid export kept inside the checkpoint is replaced as anywhere else
        ok = run_cli(ckpt, ckpt / "onnx", "--chunk", 4, "--quiet", "--no-parity")
        assert ok.returncode == 0, ok.stderr
    (ckpt / "onnx" / "model.json").write_text("damaged")
    assert_one_line_error(run_cli(ckpt, ckpt / "onnx", "--chunk", 4, "--force"), "inside the source")


def test_force_never_replaces_a_folder_that_is_not_an_export(ckpt, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for flags in ([], ["--force"]):
        assert_one_line_error(run_cli(ckpt, out, "--chunk", 4, *flags), "not a hybrid-npu export")
    assert tree(out) == {"notes.txt": b"mine"} and no_partials(tmp_path)


def test_a_damaged_export_is_replaced_only_with_force(ckpt, tmp_path):
    out = tmp_path / "out"
    assert run_cli(ckpt, out, "--chunk", 4, "--quiet", "--no-parity").returncode == 0
    again = run_cli(ckpt, out, "--chunk", 4, "--quiet", "--no-parity")  # a valid export: replaced as before
    assert again.returncode == 0, again.stderr
    (out / "model.json").write_text("{ damaged")
    assert_one_line_error(run_cli(ckpt, out, "--chunk", 4), "damaged or older", "--force")
    ok = run_cli(ckpt, out, "--chunk", 4, "--quiet", "--no-parity", "--force")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((out / "model.json").read_text())["format"] == "hybrid-npu/2"


# ---- 4. kill -9 mid-export: the next export removes the leftovers (only ours) -----------------
def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


def test_partial_left_by_kill_9_is_removed_by_the_next_export(ckpt, tmp_path):
    out = tmp_path / "out"
    foreign = tmp_path / ".out.partial-notours"  # the same name pattern without our marker: left alone
    foreign.mkdir()
    (foreign / "data.txt").write_text("someone else's")
    killed = None
    for _ in range(5):  # the tiny export is quick: kill it once its weights are on disk
        proc = subprocess.Popen([sys.executable, "-m", "hybrid_npu.export.cli", str(ckpt), str(out), "--chunk", "4"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            mine = [p for p in _partials(tmp_path, "out") if p != foreign and (p / "graphs" / "weights.bin").exists()]
            if mine:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = mine[0]
                break
            time.sleep(0.005)
        if killed is not None:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert killed is not None and killed.exists(), "could not catch the export mid-way"
    assert not out.exists()
    again = run_cli(ckpt, out, "--chunk", 4, "--no-parity")
    assert again.returncode == 0, again.stderr
    assert f"removed {killed.name}" in again.stderr and "killed" in again.stderr
    assert not killed.exists() and foreign.exists() and (foreign / "data.txt").read_text() == "someone else's"
    assert (out / "model.json").exists() and not (out / ".hybrid-npu-partial").exists()


def test_a_running_exports_partial_is_not_removed(ckpt, tmp_path):
    """A partial whose builder still runs (here: this test process) belongs to a live export."""
    from hybrid_npu.export.out_dir import make_partial, remove_stale_partials

    live = make_partial(tmp_path / "out")
    said = []
    assert remove_stale_partials(tmp_path / "out", said.append) == [] and live.exists() and not said


# ---- 6. export-hybrid: bad configs and bad disks are one line -----------------------------------
@pytest.mark.parametrize("changes,needle", [
    ({"hidden_size": None}, "hidden_size must be a positive integer, got null"),
    ({"hidden_size": "abc"}, 'hidden_size must be a positive integer, got "abc"'),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"num_hidden_layers": 0, "layer_types": []}, "num_hidden_layers must be a positive integer, got 0"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta must be a positive number"),
])
def test_bad_config_values(ckpt, tmp_path, changes, needle):
    edit_config(ckpt, **changes)
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), needle)
    assert not (tmp_path / "out").exists() and no_partials(tmp_path)


def test_config_that_is_a_json_list(ckpt, tmp_path):
    (ckpt / "config.json").write_text("[1, 2]")
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "config.json", "JSON object", "list")


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_side_config_that_is_not_json(ckpt, tmp_path, name):
    (ckpt / name).write_text("{not json")
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), name, "not valid JSON")


def test_chunk_is_bounded(ckpt, tmp_path):
    assert_one_line_error(run_cli(ckpt, tmp_path / "out", "--chunk", 100000), "--chunk 100000", "at most 4096")


def test_output_under_proc(ckpt):
    if not Path("/proc/self").exists():
        pytest.skip("no /proc on this platform")
    assert_one_line_error(run_cli(ckpt, "/proc/hybrid-npu-test/out", cwd=ckpt.parent), "cannot export to")


def _tmpfs(mount: Path, options: str):
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture()
def mounts():
    mounted = []
    yield mounted
    for m in mounted:
        subprocess.run(["umount", str(m)], capture_output=True)


def test_read_only_filesystem(ckpt, tmp_path, mounts):
    _tmpfs(tmp_path / "ro", "ro,size=1m")
    mounts.append(tmp_path / "ro")
    assert_one_line_error(run_cli(ckpt, tmp_path / "ro" / "out"), "cannot export to", "read-only")


def test_disk_full(ckpt, tmp_path, mounts):
    _tmpfs(tmp_path / "small", "size=256k")  # the tiny export needs ~1 MB
    mounts.append(tmp_path / "small")
    proc = run_cli(ckpt, tmp_path / "small" / "out", "--chunk", 4)
    assert_one_line_error(proc, "cannot export to", "No space left", "free some space")
    assert list((tmp_path / "small").iterdir()) == []  # the partial output is gone too


# ---- 7. what export-hybrid used to accept silently ---------------------------------------------
def test_integer_weight_tensor_refused(ckpt, tmp_path):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = (tensors[name] * 100).astype(np.int32)
    save_file(tensors, f, metadata={"format": "pt"})
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "layers.0.mlp.up_proj.weight", "I32", "floating point")


def test_broken_tokenizer_refused(ckpt, tmp_path):
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    assert_one_line_error(run_cli(ckpt, tmp_path / "out"), "tokenizer.json", "does not load as a tokenizer")
    assert not (tmp_path / "out").exists()


def test_no_tokenizer_warns(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    proc = run_cli(ckpt, tmp_path / "out", "--chunk", 4, "--quiet", "--no-parity")
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "no tokenizer.json" in proc.stderr and "token ids only" in proc.stderr


# ---- 12. --check-npu says what it compiles, graph by graph -------------------------------------
def test_check_npu_reports_progress_per_graph(text_tied, htp_profile, monkeypatch, capsys):
    """The compile itself is stubbed (the real one runs in test_npu_export.py on the emulator):
    what is checked here is that every graph gets a line on stderr before its compile starts."""
    from hybrid_npu.export import cli
    from hybrid_npu.export.npu import report as npu_report

    seen = []

    def fake_compile(graph, options, free_dims=None):
        seen.append((Path(graph).name, capsys.readouterr().err))  # what the user saw before this compile
        return {"graph": Path(graph).name, "nodes": 3, "on_htp": 3, "ok": True, "first_unsupported": None}

    monkeypatch.setattr(npu_report, "compile_on_npu", fake_compile)
    assert cli.main(["--check-npu", str(text_tied.out), "--profile", htp_profile]) == 0
    err = capsys.readouterr().err
    assert seen and all(f"compiling graphs/{name}" in before and "on the HTP" in before for name, before in seen)
    assert all(f"{name}: all on HTP" in err for name, _ in seen)
