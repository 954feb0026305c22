"""The memory plan, block-grown K/V, refusal beyond the plan, and conversations that append."""
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import CHUNK

import fixtures
import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export


@pytest.fixture(scope="module")
def kv_heavy(tmp_path_factory):
    """K/V per token nearer a real model's (3 full-attention layers, 4 KV heads of 128: 12 KiB;
    Qwen3.5-0.8B has 24 KiB), so K/V growth stands above allocator noise (the ~20 MB of heap that
    the per-chunk attention scratch leaves behind)."""
    root = tmp_path_factory.mktemp("kv_heavy")
    fixtures.write_text_checkpoint(root / "hf", seed=3, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                                   layer_types=["linear_attention", "full_attention"] * 3)
    export(root / "hf", root / "out", chunk=128)
    return root / "out"


def test_kv_and_state_bytes_match_transformers_cache(text_tied):
    """The memory plan's per-token K/V bytes and fixed state bytes, against what transformers' own
    cache holds after a forward (fp32 model): K/V bytes grow by exactly kv_bytes_per_token per token;
    the state is its recurrent matrices plus K-1 of the K conv columns HF keeps (we keep K-1)."""
    import torch
    engine = hybrid_npu.load_engine(text_tied.out)
    report = engine.memory_report()
    model = text_tied.ref.float().eval()

    def cache_after(t):
        with torch.no_grad():
            return model(torch.arange(1, t + 1)[None], use_cache=True).past_key_values

    def kv_bytes(cache):
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if hasattr(layer, "keys")
                   and layer.keys is not None)

    a, b = cache_after(5), cache_after(12)
    assert report["kv_bytes_per_token"] == (kv_bytes(b) - kv_bytes(a)) / 7
    gdn = [layer for layer in b.layers if hasattr(layer, "recurrent_states")]
    assert len(gdn) == len(engine.config.linear_layers) > 0
    state = 0
    for layer in gdn:  # transformers keeps one state per layer under key 0
        conv, rec = layer.conv_states[0], layer.recurrent_states[0]
        assert rec.dtype == torch.float32
        state += rec.nbytes + conv.nbytes // conv.shape[-1] * (conv.shape[-1] - 1)
    assert report["state_bytes"] == state
    assert (text_tied.out / "graphs" / "weights.bin").stat().st_size < report["weights_bytes"]  # + the packed copy
    assert report["max_context"] == model.config.max_position_embeddings and report["context_tokens"] == 0


INGEST = """
import ctypes, json, sys
import numpy as np, psutil, hybrid_npu
# glibc keeps freed blocks in per-thread heaps (ORT's worker threads each get one): trim them so
# RSS counts memory in use, not the allocator's cache of transient attention scratch
trim = lambda: ctypes.CDLL("libc.so.6").malloc_trim(0)
engine = hybrid_npu.load_engine(sys.argv[1])
ids = [int(t) for t in np.random.default_rng(0).integers(0, 300, 16_384)]
engine.prefill_logits(ids[:4096])
trim()
rss_4k = psutil.Process().memory_info().rss
engine.prefill(ids[4096:])
trim()
rss_16k = psutil.Process().memory_info().rss
print(json.dumps({"growth": rss_16k - rss_4k, "kv": engine.memory_report()["kv_bytes_per_token"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="trims glibc's heaps to read RSS")
def test_resident_memory_grows_by_the_kv_bytes_only(kv_heavy):
    """In a fresh process (a test process's heap history would blur the numbers)."""
    proc = subprocess.run([sys.executable, "-c", INGEST, str(kv_heavy)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    analytic = (16_384 - 4096) * r["kv"]
    print(f"\nRSS 4k -> 16k tokens: +{r['growth'] / 1e6:.1f} MB, analytic K/V {analytic / 1e6:.1f} MB "
          f"({r['growth'] / analytic:.2f}x)")
    assert r["growth"] <= 1.2 * analytic


def test_a_small_float_export_prepacks_and_the_plan_charges_its_copies(text_tied, monkeypatch):
    """A float export under PREPACK_FLOAT_BELOW_BYTES prepacks its weights in each CPU session (MLAS
    otherwise packs each matrix again every call of more than one row) and the memory plan charges an
    fp32 copy of its parameters per session; over it, sessions share the mapped weights.bin unpacked
    and the plan charges the file once. Both give the same logits."""
    from hybrid_npu.runtime import memory, pipeline

    manifest = json.loads((text_tied.out / "model.json").read_text())
    file, params = (text_tied.out / "graphs" / "weights.bin").stat().st_size, manifest["weights"]["params"]

    def prepacking(engine):
        options = engine.pipelines["decode"].sessions[0].get_session_options()
        try:
            return options.get_session_config_entry("session.disable_prepacking") != "1"
        except RuntimeError:  # not set: ORT's default, prepacking
            return True

    ids = [int(t) for t in np.random.default_rng(4).integers(0, 300, CHUNK + 3)]
    small = hybrid_npu.load_engine(text_tied.out)
    assert prepacking(small) and small.memory_report()["weights_bytes"] == file + 4 * params
    monkeypatch.setattr(memory, "PREPACK_FLOAT_BELOW_BYTES", file)  # the same export, now "large"
    large = hybrid_npu.load_engine(text_tied.out)
    assert not prepacking(large) and large.memory_report()["weights_bytes"] == file
    assert not memory.prepacks(manifest["weights"]) and pipeline.prepacks is memory.prepacks
    np.testing.assert_allclose(small.prefill_logits(ids), large.prefill_logits(ids), atol=1e-5, rtol=0)
    np.testing.assert_allclose(small.step("decode", [7]), large.step("decode", [7]), atol=1e-5, rtol=0)


def test_a_context_beyond_the_plan_is_refused_before_any_work(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out, memory=1)  # a budget nothing fits in
    assert engine.memory_report()["max_context"] == 0
    with pytest.raises(UserError, match="memory plan allows 0"):
        engine.prefill_logits([1, 2, 3])
    assert engine.state.position == 0
    weights = engine.memory_report()["weights_bytes"]
    kv = engine.memory_report()["kv_bytes_per_token"]
    small = hybrid_npu.load_engine(text_tied.out, memory=weights + engine.memory_report()["state_bytes"]
                          + engine.memory_report()["checkpoint_bytes"] + 50 * kv)
    limit = small.memory_report()["max_context"]
    assert limit == 50  # the plan charges a context token its K/V rows, nothing more
    small.prefill_logits(list(range(limit)))
    with pytest.raises(UserError, match=f"needs {limit + 1} tokens of context"):
        small.prefill([5])
    assert small.state.position == limit


def test_appending_a_turn_equals_one_fresh_pass(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    first = [int(t) for t in np.random.default_rng(1).integers(0, 300, CHUNK + 2)]
    second = [int(t) for t in np.random.default_rng(2).integers(0, 300, 5)]
    reply = engine.generate(first, 6, stop_at_eos=False)
    cont = engine.generate(second, 6, stop_at_eos=False, append=True)
    assert engine.last_stats["prefill_tokens"] == len(second) + 1  # only the new part (+ the reply's last token)
    fresh = hybrid_npu.load_engine(text_tied.out).generate(first + reply + second, 6, stop_at_eos=False)
    assert cont == fresh


def test_progress_callback_reports_every_chunk(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    seen = []
    engine.generate(list(range(3 * CHUNK + 1)), 1, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(CHUNK, 3 * CHUNK + 1), (2 * CHUNK, 3 * CHUNK + 1), (3 * CHUNK, 3 * CHUNK + 1),
                    (3 * CHUNK + 1, 3 * CHUNK + 1)]


def test_kv_growth_is_amortised_and_bounded():
    """State's and the drafters' K/V grow by one rule (state.grown_capacity): every need fits, the
    slack stays within 1/8 plus a block, and growing token by token to 100k rows copies the buffer
    O(log n) times, not once per block."""
    from hybrid_npu.runtime.state import KV_BLOCK, grown_capacity

    for block in (1, KV_BLOCK):
        cap, copies = 64, 0
        for need in range(1, 100_001):
            if need > cap:
                cap, copies = grown_capacity(need, cap, block), copies + 1
                assert need <= cap and cap % block == 0
                assert cap <= need + need // 8 + block + 1
        assert copies <= 64, copies  # log_{9/8}(100000 / 64) = 62.4; a per-block rule would copy ~390 times
