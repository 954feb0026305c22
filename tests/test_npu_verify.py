"""Tree verify on the NPU (profile verify_device = "npu"): the verify graph, whole or cut into the
profile's parts with precompiled contexts, runs on the HTP emulator (CPU fallback disabled) and
speculative greedy output stays the plain CPU greedy output."""
import numpy as np
import pytest
from conftest import CHUNK
from test_npu_export import derived_profile
from test_speculative import OracleDrafter

import hybrid_npu
from hybrid_npu.export.exporter import export

pytest.importorskip("onnxruntime_qnn", reason="the NPU path needs the qnn extra")

PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 300, 2 * CHUNK + 3)]
NEW = 40


@pytest.fixture(scope="module")
def plain(text_tied):
    return hybrid_npu.load_engine(text_tied.out).generate(PROMPT, NEW, stop_at_eos=False)


def speculate_on_npu(export_dir, profile, plain):
    engine = hybrid_npu.load_engine(export_dir, profile=profile, prefill="npu")
    assert "npu_verify" in engine.pipelines
    engine.drafter = OracleDrafter(320, engine, PROMPT + plain, wrong_rate=0.3, seed=1)
    out = engine.generate(PROMPT, NEW, stop_at_eos=False)
    return engine, out


def test_whole_verify_graph_on_the_htp_gives_the_plain_greedy_tokens(text_tied, htp_profile, tmp_path, plain):
    """The tiny export fits one part: its own verify graph is compiled for the HTP at load."""
    prof = derived_profile(htp_profile, tmp_path, "test-npu-verify", verify_device='"npu"')
    engine, out = speculate_on_npu(text_tied.out, prof, plain)
    stats = engine.last_stats
    assert stats["verify_device"] == "QNN/HTP" and stats["prefill_device"] == "QNN/HTP"
    assert stats["rounds"] > 0 and stats["acceptance_length"] > 1.5
    assert out == plain
    print(f"\nHTP verify: acceptance length {stats['acceptance_length']:.2f} over {stats['rounds']} rounds")


def test_a_seeded_sampled_reply_verified_on_the_htp_is_plain_sampling(text_tied, htp_profile, tmp_path):
    """A seed pins a sampled reply whatever device verifies (docs/reproducibility.md): rounds verified
    on the HTP emit plain sampling's tokens, drafts right or wrong."""
    prof = derived_profile(htp_profile, tmp_path, "test-npu-verify-sampled", verify_device='"npu"')
    engine = hybrid_npu.load_engine(text_tied.out, profile=prof, prefill="npu")
    settings = dict(temperature=0.8, top_p=0.95, seed=3, stop_at_eos=False)
    want = engine.generate(PROMPT, NEW, speculative=False, **settings)
    engine.drafter = OracleDrafter(320, engine, PROMPT + want, wrong_rate=0.3, seed=1)
    engine.adaptive = False
    assert engine.generate(PROMPT, NEW, **settings) == want
    assert engine.last_stats["verify_device"] == "QNN/HTP" and engine.last_stats["acceptance_length"] > 1.5


def test_verify_parts_and_contexts_on_the_htp_give_the_plain_greedy_tokens(text_tied, htp_profile,
                                                                           tmp_path, plain):
    prof = derived_profile(htp_profile, tmp_path, "test-verify-parts", verify_device='"npu"',
                           part_weight_bytes=150_000, verify_tree_size=16)
    out_dir = tmp_path / "export"
    manifest = export(text_tied.src, out_dir, chunk=CHUNK, profile=prof)
    entry = manifest["npu"]["test-verify-parts"]
    # verify: the weight parts; prefill: those cut again at the attention cores (docs/long-context.md)
    assert len(entry["parts"]) > len(entry["verify_parts"]) >= 2
    assert entry["verify_context"] and len(entry["verify_context"]["files"]) == len(entry["verify_parts"])
    engine, out = speculate_on_npu(out_dir, prof, plain)
    assert engine.pipelines["npu_verify"].from_context  # the precompiled binaries, not a compile at load
    assert engine.last_stats["verify_device"] == "QNN/HTP"
    assert out == plain


def test_a_context_beyond_the_npu_capacity_verifies_on_the_cpu(text_tied, htp_profile, tmp_path):
    """T_max rows are all the NPU graph reads: past them, rounds go to the CPU verify graph."""
    prof = derived_profile(htp_profile, tmp_path, "test-npu-verify-cap", verify_device='"npu"')
    cpu_plain = hybrid_npu.load_engine(text_tied.out).generate(PROMPT, 100, stop_at_eos=False)
    engine = hybrid_npu.load_engine(text_tied.out, profile=prof, prefill="npu")
    engine.drafter = OracleDrafter(320, engine, PROMPT + cpu_plain, wrong_rate=0.3, seed=2)
    engine.adaptive = False  # a round every step: where rounds run is the question, not whether they pay
    static = engine.manifest.verify.n
    assert engine.verify_graph(1) == ("QNN/HTP", static)  # an empty context fits the NPU's T_max
    assert engine.draft_shape["top_k"] == 4  # the NPU's static N: a tree's extra nodes cost nothing there
    out = engine.generate(PROMPT, 100, stop_at_eos=False)  # 19 + 100 tokens > T_max 96
    assert out == cpu_plain
    assert engine.last_stats["verify_device"] == "CPU"
    # past T_max a round is the CPU's, through its graph sized to the draft, not the NPU's N
    sizes, shape = list(engine.manifest.cpu_verify.sizes), engine.draft_shape
    holds = 1 + min(shape["total_tokens"], shape["top_k"])  # a one-level tree, as many nodes as it has
    assert engine.manifest.cpu_verify.any_count and sizes[-1] == static
    assert engine.verify_graph(1) == ("CPU", holds) and holds < static


LONG = 72  # >= 64 new tokens


class WrongAhead(OracleDrafter):
    """Right drafts in the rounds; every look-ahead (a chain deeper than any round's) wrong, or failing."""

    def __init__(self, *args, fail=False, **kw):
        super().__init__(*args, **kw)
        self.fail = fail

    def propose(self, root, top_k, depth, total_tokens):
        tokens, parents = super().propose(root, top_k, depth, total_tokens)
        if depth > self.engine.draft_shape["depth"]:
            if self.fail:
                raise RuntimeError("look-ahead failed")
            tokens = [(t + 1) % 320 for t in tokens]
        return tokens, parents


def drafters(engine, seq):
    """(drafter, look-aheads kept, look-aheads dropped): always right; partly right; every look-ahead
    wrong; every look-ahead failing."""
    return ((OracleDrafter(320, engine, seq, seed=1), True, False),
            (OracleDrafter(320, engine, seq, wrong_rate=0.3, seed=2), True, True),
            (WrongAhead(320, engine, seq, seed=3), False, True),
            (WrongAhead(320, engine, seq, seed=4, fail=True), False, True))


def test_the_drafter_running_ahead_of_the_htp_keeps_and_drops_drafts_and_the_output_is_plain(text_tied, htp_profile,
                                                                                           tmp_path):
    """Greedy rounds verified on the HTP with the look-ahead give plain decoding's tokens over 72 new
    tokens (T_max 96: the NPU verifies while the context and its 32-node tree fit, then the CPU), with
    look-aheads kept, dropped and failed: a dropped or failed one leaves the next round drafting as
    it would without."""
    prof = derived_profile(htp_profile, tmp_path, "test-npu-ahead", verify_device='"npu"')
    engine = hybrid_npu.load_engine(text_tied.out, profile=prof, prefill="npu")
    # plain decoding after the same (NPU) prefill
    want = engine.generate(PROMPT, LONG, stop_at_eos=False, speculative=False)
    engine.adaptive, engine.look_ahead = False, "npu"
    for drafter, kept, dropped in drafters(engine, PROMPT + want):
        engine.drafter = drafter
        out = engine.generate(PROMPT, LONG, stop_at_eos=False)
        stats = engine.last_stats
        assert out == want, type(drafter).__name__
        assert (stats["ahead_kept"] > 0) == kept and (stats["ahead_dropped"] > 0) == dropped, stats


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_the_drafter_running_ahead_with_the_cpu_standing_in_for_the_npu_is_plain(text_tied, sampled):
    """The same structure with the CPU verifying on the verify thread (look_ahead = "always"): greedy
    and seeded-sampled replies of 72 tokens are plain decoding's, look-aheads kept, dropped and failed.
    (Seeded rounds verified on the HTP emulator leave plain CPU sampling at fp16 near-ties with or
    without the look-ahead, so the sampled check runs here.)"""
    settings = dict(temperature=0.8, top_p=0.95, seed=5) if sampled else {}
    engine = hybrid_npu.load_engine(text_tied.out)
    want = engine.generate(PROMPT, LONG, stop_at_eos=False, speculative=False, **settings)
    engine.adaptive, engine.look_ahead = False, "always"
    for drafter, kept, dropped in drafters(engine, PROMPT + want):
        engine.drafter = drafter
        out = engine.generate(PROMPT, LONG, stop_at_eos=False, **settings)
        stats = engine.last_stats
        assert out == want, type(drafter).__name__
        assert (stats["ahead_kept"] > 0) == kept and (stats["ahead_dropped"] > 0) == dropped, stats


def test_no_look_ahead_where_the_cpu_verifies(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    want = engine.generate(PROMPT, 24, stop_at_eos=False, speculative=False)
    engine.drafter = OracleDrafter(320, engine, PROMPT + want, seed=1)
    engine.adaptive, engine.look_ahead = False, "npu"
    assert engine.generate(PROMPT, 24, stop_at_eos=False) == want
    assert engine.last_stats["ahead_kept"] == engine.last_stats["ahead_dropped"] == 0 and engine._verify_worker is None
