"""npu-bench calibrate: measured thresholds written into a user profile."""
import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from conftest import CHUNK

import hybrid_npu
from hybrid_npu.format import MANIFEST
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime.npu_bench import calibrate


def test_calibrate_measures_both_sides_and_writes_the_threshold(text_tied, htp_profile, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_qnn")
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path))
    result = calibrate(str(text_tied.out), htp_profile, [CHUNK, 4 * CHUNK], decode_steps=4)
    assert len(result["cpu_prefill_tokens_per_s"]) == 2 and all(r > 0 for r in result["cpu_prefill_tokens_per_s"])
    assert all(r > 0 for r in result["npu_prefill_tokens_per_s"]) and result["cpu_decode_tokens_per_s"] > 0
    written = load_profile("test-htp")
    assert written.source.parent == tmp_path
    assert written.npu_prefill_min_tokens == result["npu_prefill_min_tokens"]
    cpu, npu = result["cpu_prefill_tokens_per_s"], result["npu_prefill_tokens_per_s"]
    if all(n < c for n, c in zip(npu, cpu)):  # the emulator is far slower than the CPU
        assert written.npu_prefill_min_tokens > written.attention_capacity


def test_calibrate_without_an_npu_measures_the_cpu_only(text_tied, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path))
    result = calibrate(str(text_tied.out), "cpu", [CHUNK], decode_steps=2)
    assert "has no NPU" in result["notice"] and result["npu_prefill_tokens_per_s"] is None
    assert not list(tmp_path.iterdir())


def test_npu_bench_cli_bad_lengths_is_one_line_exit_2(text_tied):
    exe = shutil.which("npu-bench", path=sysconfig.get_path("scripts"))
    proc = subprocess.run([exe, "calibrate", "--profile", "cpu", "--model", text_tied.out, "--lengths", "x,1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--lengths" in proc.stderr


def test_npu_bench_without_model_measures_the_embedded_model(tmp_path):
    """As npu-chat and npu-summarize, npu-bench opens the embedded model when no --model is given."""
    exe = shutil.which("npu-bench", path=sysconfig.get_path("scripts"))
    proc = subprocess.run([exe, "calibrate", "--profile", "cpu", "--lengths", "16", "--no-write", "--json"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYBRID_NPU_PROFILE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["model"] == str(hybrid_npu.default_model()) and result["cpu_decode_tokens_per_s"] > 0


def test_calibrate_writes_the_verify_device_per_tree_size_and_the_engine_follows(text_tied, htp_profile, tmp_path,
                                                                                monkeypatch):
    """Verify is timed on the CPU at every tree size of the export and on the NPU (here the emulator,
    which says so) at its static N; the profile it writes is what the engine's rounds then follow."""
    pytest.importorskip("onnxruntime_qnn")
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path))
    result = calibrate(str(text_tied.out), htp_profile, [CHUNK], decode_steps=2)
    graphs = json.loads((Path(text_tied.out) / MANIFEST).read_text())["graphs"]
    n = graphs["verify"]["n"]
    assert [v["size"] for v in result["verify"]] == graphs["cpu_verify"]["sizes"]
    assert all(v["cpu_us"] > 0 and v["npu_us"] > 0 for v in result["verify"])
    assert all(v["device"] == ("npu" if v["npu_us"] < v["cpu_us"] else "cpu") for v in result["verify"])
    assert "emulator" in result["verify_notice"]
    written = load_profile("test-htp")
    assert [e[0] for e in written.verify_by_size] == graphs["cpu_verify"]["sizes"]
    engine = hybrid_npu.load_engine(text_tied.out, profile="test-htp")
    for depth in range(1, engine.draft_shape["depth"] + 1):
        device, nodes = engine.verify_graph(depth)
        k = engine.draft_shape["top_k"]
        real = 1 + min(engine.draft_shape["total_tokens"], k + (depth - 1) * k * k)
        cpu_size = next(m for m in graphs["cpu_verify"]["sizes"] + [n] if m >= real)
        want = written.verify_device_for(cpu_size)
        assert (device, nodes) == (("QNN/HTP", n) if want == "npu" else ("CPU", cpu_size))


def test_rounds_verify_where_the_measured_profile_says_per_size(text_tied, htp_profile, tmp_path, monkeypatch):
    """A profile measured to verify small trees on the CPU and larger ones on the NPU: rounds of each
    size run where it says, and both give the plain greedy tokens."""
    pytest.importorskip("onnxruntime_qnn")
    from test_speculative import OracleDrafter

    from hybrid_npu.profiles.loader import write_user_profile
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path))
    graphs = json.loads((Path(text_tied.out) / MANIFEST).read_text())["graphs"]
    sizes = graphs["cpu_verify"]["sizes"]
    rows = tuple((m, "cpu" if m == 2 else "npu", 1000, 500) for m in sizes)
    write_user_profile(load_profile(htp_profile), verify_by_size=rows)
    prompt = [5, 9, 13, 21, 34, 55, 89, 144]
    plain = hybrid_npu.load_engine(text_tied.out).generate(prompt, 24, stop_at_eos=False)
    engine = hybrid_npu.load_engine(text_tied.out, profile="test-htp")
    assert "npu_verify" in engine.pipelines
    engine.adaptive = False
    for depth, device in ((1, "CPU"), (4, "QNN/HTP")):
        engine.draft_shape = {"top_k": 1, "depth": depth, "total_tokens": depth}
        engine.drafter = OracleDrafter(320, engine, prompt + plain, wrong_rate=0.3, seed=depth)
        assert engine.verify_graph(depth)[0] == device
        assert engine.generate(prompt, 24, stop_at_eos=False) == plain
        assert engine.last_stats["verify_device"] == device and engine.last_stats["rounds"] > 0


def test_npu_bench_with_damaged_measured_costs_says_so_in_one_line_and_runs(text_tied, tmp_path):
    """A hand-damaged [verify] table is no reason to stop: one line names it and the re-measure
    command, and the seed's verify device decides."""
    text = load_profile("cpu").source.read_text(encoding="utf-8")
    text += '\n[verify]\nsizes = [4, 16]\ndevices = ["cpu"]\ncpu_us = [1, 2]\nnpu_us = [0, 0]\n'
    path = tmp_path / "cpu.toml"
    path.write_text(text, encoding="utf-8")
    exe = shutil.which("npu-bench", path=sysconfig.get_path("scripts"))
    proc = subprocess.run([exe, "calibrate", "--profile", str(path), "--model", text_tied.out, "--lengths", "16",
                           "--no-write", "--json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYBRID_NPU_PROFILE_DIR": str(tmp_path / "user")})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "[verify]" in line]
    assert len(lines) == 1 and "damaged" in lines[0] and "npu-bench calibrate --profile cpu" in lines[0]
    assert json.loads(proc.stdout)["verify"][0]["device"] == "cpu"
