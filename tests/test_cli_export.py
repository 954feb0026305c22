"""The same parity through the command line: export-hybrid SRC OUT, then the Python API."""
import shutil
import subprocess
import sysconfig

import numpy as np
import torch

import fixtures
import hybrid_npu


def test_export_hybrid_cli_then_api(tmp_path):
    ref = fixtures.write_release_checkpoint(tmp_path / "hf", seed=9, tie=True, with_mtp=True)
    exe = shutil.which("export-hybrid", path=sysconfig.get_path("scripts"))
    assert exe, "the console script is installed with the package"
    proc = subprocess.run([exe, tmp_path / "hf", tmp_path / "out", "--chunk", "16"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "exported 6 layers" in proc.stdout
    engine = hybrid_npu.load(tmp_path / "out")
    text = "The quick brown fox"
    ids = engine.tokenizer.encode(text).ids
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() <= 1e-4
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    ours = engine.generate(ids, 20)  # stops at eos like transformers' generate
    assert ours == hf
    assert set(engine.last_stats) >= {"prefill_tokens", "prefill_tokens_per_s", "decode_tokens", "decode_tokens_per_s",
                                      "ttft_s", "prefill_device", "decode_device"}
