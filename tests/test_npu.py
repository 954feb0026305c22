"""The NPU path on onnxruntime-qnn's x86_64 HTP emulator: placement with CPU fallback disabled,
fp16 numerics of an NPU prefill handed to CPU decode, and the CPU fallback when there is no NPU."""
import sys

import numpy as np
import pytest
from conftest import CHUNK

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime import qnn

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")



@pytest.fixture(scope="module")
def npu_engine(text_tied, htp_profile):
    return hybrid_npu.load_engine(text_tied.out, profile=htp_profile, prefill="npu")


def test_prefill_runs_on_the_htp(npu_engine):
    ids = list(range(5, 5 + 2 * CHUNK + 3))
    npu_engine.generate(ids, 4)
    assert npu_engine.last_stats["prefill_device"] == "QNN/HTP"
    assert npu_engine.last_stats["decode_device"] == "CPU"


def test_npu_prefill_then_cpu_decode_agrees_with_cpu_only(text_tied, npu_engine):
    """8·C tokens prefilled on the HTP (fp16), then 64 greedy CPU decode steps teacher-forced on the
    CPU-only continuation: top-1 agrees at >= 99% of positions; no NaN/Inf anywhere in the state."""
    cpu = hybrid_npu.load_engine(text_tied.out)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, 8 * CHUNK)]
    want = cpu.generate(ids, 64, stop_at_eos=False)
    logits = npu_engine.prefill_logits(ids)
    assert npu_engine.prefill_devices == "QNN/HTP"
    for layer in npu_engine.state.gdn.values():
        assert np.isfinite(layer.recurrent).all() and np.isfinite(layer.conv).all()
    for layer in npu_engine.state.attention.values():
        assert np.isfinite(layer.key).all() and np.isfinite(layer.value).all()
    agree, worst = 0, 0.0
    ref_logits = cpu.prefill_logits(ids)
    for token in want:
        agree += int(np.argmax(logits) == token)
        worst = max(worst, float(np.abs(logits - ref_logits).max()))
        logits = npu_engine.decode(token)
        ref_logits = cpu.decode(token)
    print(f"\nHTP fp16 prefill -> CPU decode: top-1 agreement {agree}/64, largest logit difference {worst:.4f}")
    assert agree / len(want) >= 0.99


def test_the_first_npu_use_says_it_compiles_and_that_it_is_once(text_tied, htp_profile, capsys):
    """An export without context binaries compiles its NPU graphs on first use (minutes on a real
    NPU): one line on stderr says so before it starts, and a second prefill compiles nothing."""
    engine = hybrid_npu.load_engine(text_tied.out, profile=htp_profile, prefill="npu")
    for _ in range(2):
        engine.generate(list(range(5, 5 + CHUNK + 3)), 2)
        assert engine.last_stats["prefill_device"] == "QNN/HTP"
    notes = [line for line in capsys.readouterr().err.splitlines() if "compiling" in line]
    assert len(notes) == 1 and "no QNN context binaries" in notes[0] and "once per run" in notes[0], notes


def test_prefill_cpu_forces_the_cpu(text_tied, htp_profile):
    engine = hybrid_npu.load_engine(text_tied.out, profile=htp_profile, prefill="cpu")
    engine.generate([1, 2, 3], 2)
    assert engine.last_stats["prefill_device"] == "CPU" and "npu_prefill" not in engine.pipelines


def test_no_npu_falls_back_to_cpu_with_one_notice(text_tied, htp_profile, monkeypatch, capsys):
    """onnxruntime-qnn missing (as on Linux aarch64): one notice, then everything on the CPU."""
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # import now fails
    qnn.qnn_devices.cache_clear()
    try:
        engine = hybrid_npu.load_engine(text_tied.out, profile=htp_profile)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "onnxruntime-qnn is not installed" in err[0] and "CPU" in err[0], err
        assert engine.generate([1, 2, 3], 2) and engine.last_stats["prefill_device"] == "CPU"
        with pytest.raises(UserError, match="prefill='npu' but onnxruntime-qnn"):
            hybrid_npu.load_engine(text_tied.out, profile=htp_profile, prefill="npu")
    finally:
        qnn.qnn_devices.cache_clear()


def test_handoff_npu_prefill_cpu_decode_gives_the_cpu_only_greedy_tokens(text_tied, npu_engine):
    """The state moves from the HTP sessions to the CPU decode graph with no re-layout."""
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 300, 3 * CHUNK + 5)]
    cpu_tokens = hybrid_npu.load_engine(text_tied.out).generate(ids, 32, stop_at_eos=False)
    npu_tokens = npu_engine.generate(ids, 32, stop_at_eos=False)
    assert npu_engine.last_stats["prefill_device"] == "QNN/HTP"
    assert npu_tokens == cpu_tokens
