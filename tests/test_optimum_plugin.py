"""`optimum-cli export hybrid-npu`: registered through the optimum.commands.register namespace this
package installs, and the same export as export-hybrid's (skipped without the optimum extra)."""
import shutil
import subprocess
import sysconfig

import numpy as np
import pytest
import torch

import hybrid_npu

pytest.importorskip("optimum.commands.base", reason="needs the optimum extra: pip install 'hybrid-npu[optimum]'")


def optimum_cli(*args):
    exe = shutil.which("optimum-cli", path=sysconfig.get_path("scripts"))
    assert exe, "optimum installs the optimum-cli script"
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_export_help_lists_hybrid_npu():
    proc = optimum_cli("export", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "hybrid-npu" in proc.stdout
    flags = optimum_cli("export", "hybrid-npu", "--help")
    assert flags.returncode == 0 and "--max-context" in flags.stdout and "--no-parity" in flags.stdout


def test_optimum_cli_export_loads_and_generates(text_tied, tmp_path):
    out = tmp_path / "out"
    # the fp32 cache: held to transformers at the fp32 bound (the fp16 default: tests/test_kv_cache.py)
    proc = optimum_cli("export", "hybrid-npu", text_tied.src, out, "--chunk", "8", "--kv-cache", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "exported 6 layers" in proc.stdout and proc.stdout.splitlines()[-1].startswith("parity: ok")
    engine = hybrid_npu.load_engine(out)
    ids = [5, 17, 42, 99, 3, 250, 7, 11, 64]
    with torch.no_grad():
        want = text_tied.ref(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() <= 1e-4
    assert engine.generate(ids, 16) == hybrid_npu.load_engine(text_tied.out).generate(ids, 16)  # = export-hybrid's


def test_bad_input_is_one_line_exit_2(tmp_path):
    proc = optimum_cli("export", "hybrid-npu", tmp_path / "missing", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"optimum-cli export hybrid-npu: error: model path {tmp_path / 'missing'} does not exist"
