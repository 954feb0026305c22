"""npu-bench calibrate: measured thresholds written into a user profile."""
import json
import os
import shutil
import subprocess
import sysconfig

import pytest
from conftest import CHUNK

import hybrid_npu
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime.calibrate import calibrate


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
