"""The same parity through the command line: export-hybrid SRC OUT, then the Python API; the
closing table, the parity check and --max-context."""
import json
import re
import shutil
import subprocess
import sysconfig

import numpy as np
import onnx
import pytest
import torch

import fixtures
import hybrid_npu
from hybrid_npu.export.exporter import export
from hybrid_npu.export.parity import check_parity
from hybrid_npu.format import DEFAULT_KV_CACHE
from hybrid_npu.cli_common import byte_size, human_bytes as human


def test_export_hybrid_cli_then_api(tmp_path):
    ref = fixtures.write_release_checkpoint(tmp_path / "hf", seed=9, tie=True, with_mtp=True)
    exe = shutil.which("export-hybrid", path=sysconfig.get_path("scripts"))
    assert exe, "the console script is installed with the package"
    # the fp32 cache: held to transformers at the fp32 bound (the fp16 default: tests/test_kv_cache.py)
    proc = subprocess.run([exe, tmp_path / "hf", tmp_path / "out", "--chunk", "16", "--kv-cache", "fp32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "exported 6 layers" in proc.stdout
    engine = hybrid_npu.load_engine(tmp_path / "out")
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


# ---------------------------------------------------------------- the closing table, parity, --max-context

def run_export(*args):
    exe = shutil.which("export-hybrid", path=sysconfig.get_path("scripts"))
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_summary_table_and_parity_line(text_tied, tmp_path):
    out = tmp_path / "out"
    proc = run_export(text_tied.src, out, "--chunk", "8", "--max-context-memory", "24M")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "model.json").read_text())
    lines = proc.stdout.splitlines()
    # progress on stderr, one line per stage; stdout is the table then the parity line
    assert not any(line.startswith("[") for line in lines)
    for stage in ("read ", "building graphs", "writing weights", "wrote decode.onnx", "checking parity"):
        assert stage in proc.stderr, stage
    for g in list(manifest["graphs"].values()) + [manifest["weights"]]:
        row = next(line for line in lines if line.split()[0:1] == [g["file"]])
        assert human((out / g["file"]).stat().st_size) in row
    assert f"{manifest['weights']['params']:,} params" in proc.stdout
    assert f"{manifest['state']['kv_bytes_per_token']:,} B per token" in proc.stdout
    assert manifest["kv_cache"] == DEFAULT_KV_CACHE
    # the context the runtime plans for this export in this budget, as hybrid_npu.load plans it
    fits = hybrid_npu.load_engine(out, memory=24 * 2**20).memory_report()["max_context"]
    assert f"max context  {fits:,} tokens in 24.0 MiB" in proc.stdout
    m = re.fullmatch(r"parity: ok \((\d+) source tensors equal weights.bin \(max \|diff\| (\S+)\), prefill vs 5 "
                     r"decode steps: logits max \|diff\| (\S+), state (\S+); relative L2 (\S+) and (\S+)\)",
                     lines[-1])
    assert m, lines[-1]
    assert int(m.group(1)) >= 20 and float(m.group(2)) == 0.0  # fp32: bitwise
    # the NPU-shaped prefill graph attends to a chunk's own rows unrounded, the CPU decode to them as
    # the fp16 cache holds them (kernels/attention.emit_as_cached): apart by fp16's rounding, 2^-11
    assert float(m.group(3)) <= 1e-2 and float(m.group(4)) <= 1e-2
    quiet = run_export(text_tied.src, tmp_path / "quiet", "--chunk", "8", "--quiet", "--no-parity")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert "parity:" not in quiet.stdout and "exported 6 layers" in quiet.stdout


def test_parity_catches_a_changed_weight_and_nan_logits(text_tied, tmp_path):
    out = shutil.copytree(text_tied.out, tmp_path / "copy")
    manifest = json.loads((out / "model.json").read_text())
    assert not check_parity(out, manifest).problems
    model = onnx.load(str(out / "graphs/decode.onnx"), load_external_data=False)
    where = {t.name: {e.key: int(e.value) for e in t.external_data if e.key != "location"} for t in model.graph.initializer}
    weights = out / manifest["weights"]["file"]
    data = np.fromfile(weights, np.uint8)
    embed = where["embed_tokens.weight"]
    data[embed["offset"]: embed["offset"] + embed["length"]].view(np.float32)[123] += 0.5  # one changed weight:
    data.tofile(weights)  # the graphs still agree with each other, not with the source
    report = check_parity(out, manifest)
    assert any("embed_tokens.weight differs" in p for p in report.problems), report.problems
    assert report.line().startswith("parity: FAILED")
    norm = where["norm.weight"]
    data[norm["offset"]: norm["offset"] + norm["length"]].view(np.float32)[:] = np.nan
    data.tofile(weights)
    assert "logits are not finite" in check_parity(out, manifest).problems


def test_failed_parity_exits_1_and_writes_nothing(text_tied, tmp_path, monkeypatch, capsys):
    from hybrid_npu.export import cli, parity

    def broken(export_dir, manifest):
        report = parity.ParityReport()
        report.problems.append("prefill and decode logits differ by 0.5 (> 0.001)")
        return report
    monkeypatch.setattr(parity, "check_parity", broken)
    out = tmp_path / "out"
    assert cli.main([str(text_tied.src), str(out), "--chunk", "8", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parity: FAILED: prefill and decode logits differ" in err[0], err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize("flags,needles", [
    (["--max-context", "64"], ["--max-context is gone", "attention tiles", "--max-context-memory SIZE"]),
    (["--max-context-memory", "lots"], ["--max-context-memory: 'lots'", "8G"]),
    (["--max-context", "many"], ["--max-context", "invalid int"]),
])
def test_bad_max_context_flags(text_tied, tmp_path, flags, needles, capsys):
    from hybrid_npu.export import cli

    assert cli.main([str(text_tied.src), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert not (tmp_path / "out").exists()


def test_byte_size():
    assert byte_size("8G") == byte_size("8GiB") == 8 * 2**30
    assert byte_size("512m") == 512 * 2**20 and byte_size("1000") == 1000 and byte_size("1.5K") == 1536


def test_no_npu_graph_for_more_positions_than_the_model_has(text_tied, htp_profile, tmp_path):
    """A profile whose attention_capacity passes max_position_embeddings (65,536 here): the NPU verify
    graph's K/V capacity stops at the model's positions."""
    from test_npu_export import derived_profile

    prof = derived_profile(htp_profile, tmp_path, "test-htp", attention_capacity=70_000)
    manifest = export(text_tied.src, tmp_path / "out", chunk=8, profile=prof, compile_context=False)
    assert manifest["npu"]["test-htp"]["attention_capacity"] == 65_536


def test_every_export_flag_reaches_the_options():
    """export-hybrid's flags become one ExportOptions (export/options.py), field for field."""
    from hybrid_npu.export.cli import build_parser
    from hybrid_npu.export.options import ExportOptions

    args = build_parser().parse_args(
        ["src", "out", "--profile", "snapdragon-x-elite", "--no-compile", "--chunk", "64", "--dtype", "fp16",
         "--weights", "int4", "--block-size", "64", "--asymmetric", "--head-bits", "4", "--calibration", "c.txt",
         "--npu-quant", "qdq", "--drafter", "mtp", "--verify", "16", "--max-context", "4096"])
    assert ExportOptions.from_args(args) == ExportOptions(
        chunk=64, dtype="fp16", profile="snapdragon-x-elite", compile_context=False, verify=16, drafter="mtp",
        weights="int4", block_size=64, asymmetric=True, head_bits=4, max_context=4096, npu_quant="qdq",
        calibration="c.txt")
    plan = ExportOptions.from_args(args).resolve()
    assert (plan.chunk, plan.verify, plan.quant.bits, plan.npu_quant, plan.own_mtp, plan.eagle3) == \
        (64, 16, 4, "qdq", True, None)
    with pytest.raises(TypeError):
        export("src", "out", ExportOptions(), chunk=8)
