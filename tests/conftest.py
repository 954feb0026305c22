"""Shared, session-scoped fixtures: tiny checkpoints (built with transformers, offline) and their
exports. Building is cheap (< 1 s each) but exports are reused across test files."""
import atexit
import os
import shutil
import tempfile

import pytest

# the integrity check's record of verified files goes to a scratch folder, not the user's cache
if "HYBRID_NPU_CACHE" not in os.environ:
    os.environ["HYBRID_NPU_CACHE"] = tempfile.mkdtemp(prefix="hybrid-npu-cache-")
    atexit.register(shutil.rmtree, os.environ["HYBRID_NPU_CACHE"], ignore_errors=True)  # not one left per run

import fixtures  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny reference models: one thread is as fast and immune to a busy second core

from hybrid_npu.export.exporter import export  # noqa: E402

CHUNK = 8  # small C so prompts of C-1, C, 3C+7 and 10C tokens stay fast


class Built:
    def __init__(self, src, out, ref):
        self.src, self.out, self.ref = src, out, ref


def _build(tmp_path_factory, name, writer, **kw):
    root = tmp_path_factory.mktemp(name)
    ref = writer(root / "hf", **kw)
    # the fp32 K/V cache: these fixtures hold the graphs to transformers at fp32 tolerance; the fp16
    # default and int8 are held to it in tests/test_kv_cache.py
    export(root / "hf", root / "export", chunk=CHUNK, kv_cache="fp32")
    return Built(root / "hf", root / "export", ref)


def pytest_configure(config):
    config.addinivalue_line("markers", "verify_in_background: rounds wait for nothing; a fresh engine "
                            "decodes plainly while its verify session is still opening (the product's behaviour)")


@pytest.fixture(autouse=True)
def _verify_session_opened_before_rounds(request, monkeypatch):
    """A fresh engine decodes plainly until its prefetched verify session is open (generation.py);
    tests that check speculation right after a load would otherwise depend on how fast the
    session opens. They wait for it instead, as the engine once did; tests marked
    verify_in_background see the real behaviour."""
    if request.node.get_closest_marker("verify_in_background") is None:
        from hybrid_npu.runtime.lazy_pipelines import LazyPipelines
        monkeypatch.setattr(LazyPipelines, "ready", lambda self, name: True)


@pytest.fixture(scope="session")
def text_tied(tmp_path_factory):
    return _build(tmp_path_factory, "text_tied", fixtures.write_text_checkpoint, seed=1, tie=True)


@pytest.fixture(scope="session")
def text_untied(tmp_path_factory):
    return _build(tmp_path_factory, "text_untied", fixtures.write_text_checkpoint, seed=2, tie=False)


@pytest.fixture(scope="session")
def release_tied(tmp_path_factory):
    return _build(tmp_path_factory, "release_tied", fixtures.write_release_checkpoint, seed=3, tie=True,
                  with_mtp=True, sharded=True)


@pytest.fixture(scope="session")
def release_untied(tmp_path_factory):
    return _build(tmp_path_factory, "release_untied", fixtures.write_release_checkpoint, seed=4, tie=False,
                  with_mtp=True)


@pytest.fixture(scope="session")
def qwen3_next(tmp_path_factory):
    return _build(tmp_path_factory, "qwen3_next", fixtures.write_qwen3_next_checkpoint, seed=5)


@pytest.fixture(scope="session")
def htp_profile(tmp_path_factory):
    """The X Elite profile sized for the emulator: T_max 96 (the tiny prompts fit the NPU verify), attention
    tiles of 16 rows (a 128-token prompt is 8 tiles), finalization mode 1 (compiles 2-8x faster,
    docs/htp-traps.md). A user profile file, as users write them."""
    import re

    from hybrid_npu.profiles.loader import load_profile

    text = load_profile("snapdragon-x-elite").source.read_text()
    for key, value in (("name", '"test-htp"'), ("attention_capacity", "96"), ("graph_finalization", "1"),
                       ("prefill_chunk", str(CHUNK)), ("attention_tile", "16")):
        text = re.sub(rf"(?m)^{key}\s*=\s*\S+", f"{key} = {value}", text)
    path = tmp_path_factory.mktemp("profiles") / "test-htp.toml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- the released Qwen3.5 chat stack
class Release:
    def __init__(self, src, out, ref, cache):
        self.src, self.out, self.ref, self.cache = src, out, ref, cache

    def hf_tokenizer(self):
        return hf_tokenizer(self.src)


def hf_tokenizer(src):
    """transformers' tokenizer for a Qwen3.5 checkpoint: its AutoTokenizer maps model_type qwen3_5 to
    Qwen3_5Tokenizer whatever tokenizer_class the release's tokenizer_config.json names (it says
    Qwen2Tokenizer, whose split pattern differs on combining marks); our text-only fixture says
    qwen3_5_text, so name the class."""
    from transformers import Qwen3_5Tokenizer
    return Qwen3_5Tokenizer.from_pretrained(src)


@pytest.fixture(scope="session")
def release(tmp_path_factory):
    """No generation_config.json (as the 0.8B/2B releases may ship): eos comes from the other files."""
    from qwen35_release import write_real_vocab_checkpoint

    root = tmp_path_factory.mktemp("qwen35_release")
    ref = write_real_vocab_checkpoint(root / "hf", root / "tok-cache", seed=11)
    # the fp32 K/V cache: these fixtures hold the graphs to transformers at fp32 tolerance; the fp16
    # default and int8 are held to it in tests/test_kv_cache.py
    export(root / "hf", root / "export", chunk=CHUNK, kv_cache="fp32")
    return Release(root / "hf", root / "export", ref, root / "tok-cache")


def assert_speculation_accounts_for(stats: dict, n_tokens: int, rounds_at_least: int = 1) -> None:
    """A speculative generation's stats add up: the first token comes from the prefill, each plain
    step gives one, each round gives its accepted drafts + one, so acceptance length x rounds is
    what the rounds emitted (independent counts: a wrong acceptance figure fails this).
    rounds_at_least=0 where a fresh process's verify session may still be opening (its reply then
    decodes plainly, generation.py): speculation was on, whether or not a round ran."""
    assert "rounds" in stats and "plain_steps" in stats, stats  # the speculative generation's stats
    assert stats["rounds"] >= rounds_at_least, stats
    emitted_by_rounds = n_tokens - 1 - stats.get("plain_steps", 0)
    assert abs(stats["acceptance_length"] * stats["rounds"] - emitted_by_rounds) < 1e-6, stats


# ---------------------------------------------------------------- test tiers (pyproject's markers)
# `npu`: runs ONNX Runtime's QNN HTP emulator (17-66 s a test): every test of a module that skips
# without onnxruntime-qnn, and every test that asks for it itself. `slow`: the soaks, by name.
SLOW_TESTS = {
    "test_no_memory_growth_over_200_requests",                     # test_serve.py: 200 requests
    "test_resident_memory_grows_by_the_kv_bytes_only",             # test_engine_memory.py: 4k-16k tokens
    "test_long_document_in_chunks",                                # test_summarize_cli.py: 20,000 tokens
    "test_sampled_speculative_tokens_have_the_plain_distribution", # test_speculative.py: 20,000 runs
}
NPU_TESTS = {"test_opening_an_npu_session_keeps_stdout_clean"}  # opens a QNN session in a child process
_NEEDS_QNN = 'importorskip("onnxruntime_qnn"'


def pytest_collection_modifyitems(config, items):
    import inspect

    npu_modules: dict = {}
    for item in items:
        module = item.module
        if module not in npu_modules:
            npu_modules[module] = any(line.startswith("pytest." + _NEEDS_QNN)
                                      for line in inspect.getsource(module).splitlines())
        function = getattr(item, "function", None)
        if npu_modules[module] or item.originalname in NPU_TESTS or (
                function is not None and _NEEDS_QNN in inspect.getsource(function)):
            item.add_marker(pytest.mark.npu)
        if item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
