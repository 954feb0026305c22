"""The NPU prefill with attention in tiles (docs/long-context.md), on onnxruntime-qnn's x86_64 HTP
emulator with CPU fallback off: a prompt of >= 8 tiles and longer than the profile's T_max prefills
on the HTP only, within fp16 tolerance of the CPU path and of transformers, and continues greedily
exactly as a CPU-only run; planted massive activations stay within their bound; bad input is one
line naming the fix."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import CHUNK
from outlier_fixtures import PLANTED, outlier_prompt, write_outlier_checkpoint
from test_npu_export import derived_profile

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.kernels.attention_tile import BULK_TILES
from hybrid_npu.profiles.loader import load_profile

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")

MAX_REL = 0.05  # relative max logit error of an fp16 HTP prefill (tests/test_npu_outliers.py)


@pytest.fixture(scope="module")
def tiled(text_tied, htp_profile, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiled") / "export"
    export(text_tied.src, out, chunk=CHUNK, profile=htp_profile, compile_context=False)
    return out


def rel_max_error(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def test_a_prompt_past_t_max_of_eight_tiles_prefills_only_on_the_htp(tiled, text_tied, htp_profile):
    prof = load_profile(htp_profile)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, 8 * prof.attention_tile + 5)]
    assert len(ids) > prof.attention_capacity  # the old T_max design sent the rest to the CPU
    engine = hybrid_npu.load_engine(tiled, profile=htp_profile, prefill="npu")
    logits = engine.prefill_logits(ids)
    assert engine.last_stats["prefill_device"] == "QNN/HTP"  # every chunk: the devices of all chunks joined
    tiles = engine.pipelines["npu_prefill"].tiled
    n_attn = len(engine.config.full_layers)
    b, bulk = prof.attention_tile, BULK_TILES * prof.attention_tile  # whole bulk tiles before the chunk, then tiles
    want_calls = sum(n_attn * (pos // bulk + -(-(pos + CHUNK - pos // bulk * bulk) // b)) for pos in range(0, len(ids), CHUNK))
    assert tiles.calls == want_calls
    cpu = hybrid_npu.load_engine(text_tied.out)
    want_cpu = cpu.prefill_logits(ids)
    with torch.no_grad():
        want_hf = text_tied.ref(torch.tensor([ids])).logits[0, -1].double().numpy()
    err_cpu, err_hf = rel_max_error(logits, want_cpu), rel_max_error(logits, want_hf)
    print(f"\n{len(ids)} tokens, {tiles.calls} tile calls of {prof.attention_tile} rows: rel max logit error "
          f"{err_cpu:.2e} vs the CPU, {err_hf:.2e} vs transformers")
    assert err_cpu <= MAX_REL and err_hf <= MAX_REL
    npu_tokens = engine.generate(ids, 16, stop_at_eos=False)
    assert engine.last_stats["prefill_device"] == "QNN/HTP"
    assert npu_tokens == cpu.generate(ids, 16, stop_at_eos=False)


def test_massive_activations_stay_within_their_bound_in_tiles(htp_profile, tmp_path):
    """Residual channels planted at 300 to 20,000 (tests/outlier_fixtures.py) over a prompt of 4 tiles."""
    model = write_outlier_checkpoint(tmp_path / "hf")
    export(tmp_path / "hf", tmp_path / "export", chunk=CHUNK, profile=htp_profile, compile_context=False)
    prompt = outlier_prompt(4 * load_profile(htp_profile).attention_tile + 3)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    assert max(float(h.abs().max()) for h in out.hidden_states) >= max(abs(m) for _, m in PLANTED)
    engine = hybrid_npu.load_engine(tmp_path / "export", profile=htp_profile, prefill="npu")
    logits = engine.prefill_logits(prompt)
    assert engine.last_stats["prefill_device"] == "QNN/HTP"
    err = rel_max_error(logits, out.logits[0, -1].double().numpy())
    print(f"\ntiled NPU prefill, residual channels up to {max(abs(m) for _, m in PLANTED):g}: rel max logit "
          f"error {err:.2e}")
    assert err <= MAX_REL


def test_an_export_without_tiles_names_the_fix(tiled, htp_profile, tmp_path):
    other = tmp_path / "old"
    shutil.copytree(tiled, other)
    m = json.loads((other / "model.json").read_text())
    name = load_profile(htp_profile).name
    del m["npu"][name]["tile"]
    (other / "model.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match=rf"not attention tiles; re-export with: export-hybrid SOURCE .* --profile {name}"):
        hybrid_npu.load_engine(other, profile=htp_profile)


def test_a_tile_size_the_graphs_cannot_use_names_the_fix(tiled, htp_profile, tmp_path):
    name = load_profile(htp_profile).name
    other = derived_profile(htp_profile, tmp_path, name, attention_tile=32)
    with pytest.raises(UserError, match=r"built for attention_tile = 16, but profile .* says 32; set attention_tile = 16"):
        hybrid_npu.load_engine(tiled, profile=other)


def test_a_profile_without_a_tile_size_names_the_fix(htp_profile, tmp_path):
    text = re.sub(r"(?m)^attention_tile\s*=.*\n(\s+#.*\n)*", "", open(htp_profile).read())
    path = tmp_path / "no-tile.toml"
    path.write_text(text.replace('name = "test-htp"', 'name = "no-tile"'))
    with pytest.raises(UserError, match=r"missing key 'attention_tile' in \[shapes\]; add it, e\.g\. attention_tile = 2048"):
        load_profile(path)


def test_npu_summarize_names_the_htp_in_its_progress_line(tiled, htp_profile, tmp_path):
    """A document past the profile's T_max (96), every chunk on the HTP: the progress line and the
    closing stats say so."""
    from test_summarize_cli import run

    doc = tmp_path / "doc.txt"
    doc.write_text("The fox runs into the forest and the owl watches it go. " * 10, encoding="utf-8")
    proc = run(doc, "--model", tiled, "--profile", htp_profile, "--prefill", "npu", "--max-new-tokens", 4,
               "--no-speculative")
    assert proc.returncode == 0, proc.stderr
    assert "prefill on QNN/HTP" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    n = int(re.search(r"prefill (\d+) tokens on QNN/HTP ", proc.stderr).group(1))
    assert n > load_profile(htp_profile).attention_capacity
