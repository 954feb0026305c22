"""Speculative decoding on the hybrid target is lossless: greedy output is token-identical to plain
greedy decoding whatever the drafter proposes, the committed state equals plain decoding of the
accepted tokens, and sampled output has exactly the plain sampling distribution."""

import dataclasses

import numpy as np
import pytest
from conftest import CHUNK

import fixtures
from sampled_check import check_first_two
import hybrid_npu
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime.generation import speculative_round, stream
from hybrid_npu.runtime.sampling import Sampler
from hybrid_npu.runtime.speculative import CHAIN_SHAPE, TREE_SHAPE


class RandomDrafter:
    """Random trees: almost nothing is accepted."""  # noqa: D401

    def __init__(self, vocab, seed=0, chain=False):
        self.vocab, self.rng, self.chain = vocab, np.random.default_rng(seed), chain

    def reset(self):
        pass

    def observe(self, tokens, taps):
        assert len(tokens) == len(taps) and taps.ndim == 2

    def grow(self, guess, top_k, depth, total_tokens):
        """A spine of `depth` best guesses, each with top_k - 1 random siblings (none for a chain):
        guess(path) gives the token the spine's next node should carry (None: random)."""
        tokens, parents, parent, path = [], [], -1, []
        for _ in range(depth):
            spine = None
            for c in range(1 if self.chain else top_k):
                if len(tokens) >= total_tokens:
                    return tokens, parents
                t = guess(path) if c == 0 else None
                tokens.append(int(self.rng.integers(0, self.vocab)) if t is None else t)
                parents.append(parent)
                spine = len(tokens) - 1 if c == 0 else spine
            parent, path = spine, path + [tokens[spine]]
        return tokens, parents

    def propose(self, root, top_k, depth, total_tokens):
        return self.grow(lambda path: None, top_k, depth, total_tokens)


class OracleDrafter(RandomDrafter):
    """Proposes the target's own greedy continuation on each first child (full-depth acceptance);
    with wrong_rate > 0 it is only partly right."""

    def __init__(self, vocab, engine, sequence, wrong_rate=0.0, seed=0, chain=False):
        super().__init__(vocab, seed, chain)
        self.engine, self.sequence, self.wrong_rate = engine, sequence, wrong_rate

    def propose(self, root, top_k, depth, total_tokens):
        pos = self.engine.state.position  # the root sits at this position
        assert self.sequence[pos] == root

        def guess(path):
            if self.rng.random() < self.wrong_rate or path != self.sequence[pos + 1: pos + 1 + len(path)]:
                return None
            i = pos + 1 + len(path)
            return self.sequence[i] if i < len(self.sequence) else None
        return self.grow(guess, top_k, depth, total_tokens)


PROMPT = [int(t) for t in np.random.default_rng(42).integers(0, 300, CHUNK + 5)]


def drafting_trees(engine):
    """The engine drafting top-4 trees, as where it verifies on the NPU (on the CPU its default is a
    chain, runtime/speculative.py): an accepted path then skips siblings."""
    engine.draft_shape = dict(TREE_SHAPE, total_tokens=engine.manifest.verify.n - 1)
    return engine


@pytest.fixture(scope="module")
def plain_greedy(text_tied):
    return hybrid_npu.load_engine(text_tied.out).generate(PROMPT, 256, stop_at_eos=False)


@pytest.mark.parametrize("kind", ["random", "oracle", "partial"])
@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_greedy_speculative_output_is_the_plain_output(text_tied, plain_greedy, kind, chain):
    engine = hybrid_npu.load_engine(text_tied.out)
    sequence = PROMPT + plain_greedy
    engine.drafter = {"random": RandomDrafter(320, chain=chain),
                      "oracle": OracleDrafter(320, engine, sequence, chain=chain),
                      "partial": OracleDrafter(320, engine, sequence, wrong_rate=0.3, chain=chain)}[kind]
    engine.adaptive = False  # a round every step: the acceptance bound must not hang on the policy's timings
    if not chain:
        drafting_trees(engine)
    assert (engine.draft_shape["top_k"] == 1) == chain
    out = engine.generate(PROMPT, 256, stop_at_eos=False)
    assert out == plain_greedy
    stats = engine.last_stats
    assert stats["rounds"] > 0 and stats["decode_tokens"] == 256
    if kind == "oracle":
        assert stats["acceptance_length"] >= 6.5  # the whole depth-6 spine, + the bonus token
    if kind == "random":
        assert stats["acceptance_length"] < 1.5
    print(f"\n{kind} {'chain' if chain else 'tree'}: acceptance length {stats['acceptance_length']:.2f}, "
          f"rounds {stats['rounds']}")


@pytest.mark.parametrize("any_count", [True, False], ids=["graph-pads", "host-pads"])
def test_a_chain_between_two_core_sizes_speculates_to_the_plain_output(text_tied, plain_greedy, any_count):
    """A 9-draft chain (10 nodes, between the CPU verify graph's cores for 8 and 16) is verified as
    10 nodes, padded inside the graph; an export made before its graph took any count pads it on
    the host to 16. Both give the plain output."""
    engine = hybrid_npu.load_engine(text_tied.out)
    if not any_count:
        sized = dataclasses.replace(engine.manifest.cpu_verify, any_count=None)
        engine.manifest = dataclasses.replace(engine.manifest, graphs={**engine.manifest.graphs, "cpu_verify": sized})
    assert 9 not in engine.manifest.cpu_verify.sizes
    engine.draft_shape = {"top_k": 1, "depth": 9, "total_tokens": 9}
    engine.drafter = OracleDrafter(320, engine, PROMPT + plain_greedy, wrong_rate=0.2, chain=True)
    engine.adaptive = False
    assert engine.verify_graph(9) == ("CPU", 10 if any_count else 16)
    assert engine.generate(PROMPT, 256, stop_at_eos=False) == plain_greedy
    assert engine.last_stats["rounds"] > 0 and engine.last_stats["acceptance_length"] > 2


def test_stream_yields_the_plain_tokens_and_a_closed_stream_keeps_its_context(text_tied, plain_greedy):
    """stream() is generate() token by token; closed inside a round, the round's tokens stay in the
    context and the next generation continues exactly where plain decoding would."""
    engine = drafting_trees(hybrid_npu.load_engine(text_tied.out))
    engine.drafter = OracleDrafter(320, engine, PROMPT + plain_greedy, wrong_rate=0.3, seed=5)
    engine.adaptive = False  # every step a round
    tokens = stream(engine.model, engine.context, PROMPT, Sampler(), 64, stop_at_eos=False)
    assert list(tokens) == plain_greedy[:64]
    assert tokens.response.stats["rounds"] > 0 and tokens.response.stats["decode_tokens"] == 64
    tokens = stream(engine.model, engine.context, PROMPT, Sampler(), 64, stop_at_eos=False)
    taken = [next(tokens) for _ in range(10)]
    tokens.close()
    kept = engine.context_ids()
    assert taken == plain_greedy[:10] and kept == (PROMPT + plain_greedy)[: len(kept)] and len(kept) >= len(PROMPT) + 10
    more = engine.generate([], 20, append=True, stop_at_eos=False)
    n = len(kept) - len(PROMPT)
    assert more == plain_greedy[n: n + 20]


def test_committed_state_equals_plain_decoding_of_the_accepted_tokens(text_tied, plain_greedy):
    spec = drafting_trees(hybrid_npu.load_engine(text_tied.out))
    spec.drafter = OracleDrafter(320, spec, PROMPT + plain_greedy, wrong_rate=0.3, seed=3)
    plain = hybrid_npu.load_engine(text_tied.out)
    spec.prefill_logits(PROMPT)
    plain.prefill_logits(PROMPT)
    root = plain_greedy[0]
    for _ in range(6):  # several rounds, each compared
        emitted = speculative_round(spec.model, spec.context, root, 100, False, Sampler())  # one greedy round
        for t in [root] + emitted[:-1]:
            plain.decode(t)
        root = emitted[-1]
        assert spec.state.position == plain.state.position and spec.state.tokens == plain.state.tokens
        for i in spec.state.gdn:  # the verify graph's plain ops and decode's fused CPU kernels (norms,
            # conv, softplus) round differently: measured up to 1.1e-5 after six rounds
            assert np.abs(spec.state.gdn[i].recurrent - plain.state.gdn[i].recurrent).max() <= 3e-5
            assert np.abs(spec.state.gdn[i].conv - plain.state.gdn[i].conv).max() <= 3e-5
        p = spec.state.position
        for i in spec.state.attention:  # K/V rows come straight from the graphs: fp32 rounding of a
            s, q = spec.state.attention[i], plain.state.attention[i]  # 32-token vs a 1-token product, relative
            for a, b in ((s.key[:, :p], q.key[:, :p]), (s.values(p), q.values(p))):  # to their scale
                assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())


# ---------------------------------------------------------------- sampling is distribution-exact

V = 12


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vocab")
    fixtures.write_text_checkpoint(root / "hf", seed=5, vocab_size=V, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    (root / "hf" / "tokenizer.json").unlink()  # its 300 ids do not fit 12 rows (refused at export); ids suffice here
    export(root / "hf", root / "out", chunk=CHUNK, verify=6)
    return root / "out"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.9)])
def test_sampled_speculative_tokens_have_the_plain_distribution(tiny_vocab, temperature, top_p):
    """First two generated tokens over 20,000 seeded runs against the exact plain joint distribution.

    The drafter's tree for each first token is drawn once (a drafter may be deterministic), so the
    verify pass runs once per first token and the 20,000 runs exercise the seeded verify."""
    engine = hybrid_npu.load_engine(tiny_vocab)
    logits0 = engine.prefill_logits([3, 7, 2, 9, 4])
    rng = RandomDrafter(V, seed=11).rng

    def draft(y, p2):
        # root's children: the target's likeliest token, a random one, its second likeliest (so rejection
        # chains through siblings), and a random grandchild under each
        likely = [int(t) for t in np.argsort(-p2)[:2]]
        return [likely[0], int(rng.integers(0, V)), likely[1]] + [int(t) for t in rng.integers(0, V, 2)], [-1, -1, -1, 0, 2]
    check_first_two(engine, logits0, temperature, top_p, draft)


def test_an_export_without_a_verify_graph_still_loads_and_says_how_to_speculate(text_tied, tmp_path):
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(text_tied.out, old)
    m = json.loads((old / "model.json").read_text())
    del m["graphs"]["verify"]  # as exported before speculative decoding existed
    (old / "model.json").write_text(json.dumps(m))
    engine = hybrid_npu.load_engine(old)
    assert engine.drafter is None and engine.generate(PROMPT, 4)
    with pytest.raises(hybrid_npu.errors.UserError, match="no tree-verify graph.*--drafter"):
        hybrid_npu.load_engine(old, drafter=RandomDrafter(320))


def test_an_export_without_a_recorded_shape_drafts_chains_where_the_cpu_verifies(text_tied, plain_greedy, tmp_path):
    """Each CPU verify node costs a row of every weight matmul, so the default there is a chain (a
    tree where the NPU verifies: tests/test_npu_verify.py); a shape the export records wins."""
    import json
    import shutil

    engine = hybrid_npu.load_engine(text_tied.out)
    assert (engine.manifest.drafter is None or engine.manifest.drafter.draft_shape is None) \
        and "npu_verify" not in engine.pipelines
    assert engine.draft_shape == CHAIN_SHAPE
    engine.drafter = OracleDrafter(320, engine, PROMPT + plain_greedy, seed=4)
    engine.adaptive = False
    assert engine.generate(PROMPT, 32, stop_at_eos=False) == plain_greedy[:32]
    assert engine.verify_graph(6) == ("CPU", 7)  # the root and one node a level
    assert engine.last_stats["acceptance_length"] > 5  # whole chains (the last round cut by the 32 tokens)
    recorded = tmp_path / "recorded"
    shutil.copytree(text_tied.out, recorded)
    m = json.loads((recorded / "model.json").read_text())
    m.setdefault("drafter", {})["draft_shape"] = {"top_k": 2, "depth": 3, "total_tokens": 6}
    (recorded / "model.json").write_text(json.dumps(m))
    assert hybrid_npu.load_engine(recorded).draft_shape == {"top_k": 2, "depth": 3, "total_tokens": 6}


def test_the_verify_session_opens_only_when_speculating(text_tied):
    """A quantised export's session holds its own packed weights: no verify session unless used."""
    engine = hybrid_npu.load_engine(text_tied.out)
    engine.generate(PROMPT, 4, speculative=False)
    assert "verify" not in engine.pipelines and {"prefill", "decode"} <= set(engine.pipelines)
    engine.drafter = RandomDrafter(320)
    engine.generate(PROMPT, 8, stop_at_eos=False)
    assert "verify" in engine.pipelines and engine.last_stats["rounds"] > 0


def test_conv_window_is_the_last_k_minus_1_inputs_after_a_path():
    """commit_path's conv state: the window [C, K-1] that the state and the path's inputs end with,
    for paths shorter and longer than the window (the definition: concatenate, keep the last K-1)."""
    from hybrid_npu.runtime.speculative import conv_window

    rng = np.random.default_rng(0)
    k, c = 4, 10
    conv = rng.standard_normal((c, k - 1)).astype(np.float32)
    pre = rng.standard_normal((6, c)).astype(np.float32)
    for length in range(1, 7):
        path = np.arange(length)
        want = np.concatenate([conv, pre[path].T], axis=1)[:, -(k - 1):]
        got = conv_window(conv, pre[path[-(k - 1):]], k)
        np.testing.assert_array_equal(got, want)
        assert got.flags.c_contiguous


def test_commit_path_writes_the_state_in_place_and_leaves_a_checkpoint_alone():
    """commit_path updates each GDN state in its own array (no fresh 1 MiB arrays a layer at 0.8B) to
    the value commit_state_ref gives in new arrays (the tests above hold that against the recurrence);
    a checkpoint taken before keeps the old state; a read-only state array is replaced, not written."""
    from hybrid_npu.kernels.delta_rule import commit_state_ref
    from hybrid_npu.runtime.turn_checkpoints import Checkpoint
    from hybrid_npu.runtime.speculative import commit_path

    state, out, tree, path, k = _random_round(1, with_attention=False)
    gdn = state.gdn
    gdn[2].recurrent.flags.writeable = False
    before = Checkpoint.take(state)
    arrays = {i: layer.recurrent for i, layer in gdn.items()}
    want = {i: commit_state_ref(before.recurrent[i], (out[f"commit_k.{i}"], out[f"commit_u.{i}"],
                                                      out[f"commit_g.{i}"]), path) for i in gdn}
    commit_path(state, out, tree, path, k)
    assert gdn[0].recurrent is arrays[0] and gdn[2].recurrent is not arrays[2]
    for i in gdn:
        np.testing.assert_allclose(gdn[i].recurrent, want[i], rtol=1e-6, atol=1e-6)
        assert gdn[i].recurrent.dtype == np.float32
    np.testing.assert_array_equal(arrays[2], before.recurrent[2])  # the read-only array untouched
    assert not np.allclose(before.recurrent[0], gdn[0].recurrent)  # the checkpoint kept its own copy
    assert state.position == 12 and state.tokens[-3:] == [5, 6, 8]
    before.restore(state)
    np.testing.assert_array_equal(gdn[0].recurrent, before.recurrent[0])


def test_a_chain_tree_feed_from_kept_rows_is_the_general_feed():
    """A chain's verify feed takes its structure and rotary rows from kept, read-only arrays; it must
    be the feed built from the tree's paths, bitwise, also where the chain crosses a rotary block."""
    from hybrid_npu.kernels.rope import ROPE_BLOCK
    from hybrid_npu.runtime.speculative import Tree, general_tree_feed, tree_feed

    engine = hybrid_npu.load_engine(hybrid_npu.default_model())
    engine.generate(list(range(5, 5 + ROPE_BLOCK - 10)), 1, temperature=0.0)
    cfg, state = engine.config, engine.state
    for n in (1, 2, 5, 15, 15):  # the second 15 from the kept arrays
        tree = Tree(list(range(10, 10 + n)), list(range(-1, n - 1)))
        fast, slow = tree_feed(cfg, state, tree), general_tree_feed(cfg, state, tree)
        assert fast.keys() == slow.keys()
        for key, want in slow.items():
            assert fast[key].dtype == want.dtype and np.array_equal(fast[key], want), (n, key)
        assert not fast["tree_mask"].flags.writeable and not fast["rope_cos"].flags.writeable
    branched = Tree([10, 11, 12, 13], [-1, 0, 0, 1])
    for key, want in general_tree_feed(cfg, state, branched).items():
        assert np.array_equal(tree_feed(cfg, state, branched)[key], want)


def _random_round(seed: int, with_attention: bool = True):
    """A state with two GDN layers (and an attention layer) and a verify's outputs for a 4-node tree."""
    from hybrid_npu.runtime.speculative import Tree
    from hybrid_npu.runtime.state import AttentionLayerState, GDNLayerState, State

    rng = np.random.default_rng(seed)
    n, hv, dk, dv, c, k, kv, hd = 4, 3, 5, 6, 7, 4, 2, 8
    gdn = {i: GDNLayerState(rng.standard_normal((c, k - 1)).astype(np.float32),
                            rng.standard_normal((hv, dk, dv)).astype(np.float32)) for i in (0, 2)}
    attention = {1: AttentionLayerState(np.zeros((kv, 16, hd), np.float32), np.zeros((kv, hd, 16), np.float32))}
    state = State(gdn, attention if with_attention else {}, position=9, tokens=list(range(9)))
    out = {}
    for i in gdn:
        out.update({f"commit_k.{i}": rng.standard_normal((n, hv, dk)).astype(np.float32),
                    f"commit_u.{i}": rng.standard_normal((n, hv, dv)).astype(np.float32),
                    f"commit_g.{i}": -np.abs(rng.standard_normal((n, hv))).cumsum(0).astype(np.float32),
                    f"pre_conv.{i}": rng.standard_normal((n, c)).astype(np.float32)})
    out.update({"new_key.1": rng.standard_normal((kv, n, hd)).astype(np.float32),
                "new_value.1": rng.standard_normal((kv, n, hd)).astype(np.float32)})
    return state, out, Tree([5, 6, 7, 8], [-1, 0, 1, 1]), [0, 1, 3], k


def _same_state(a, b):
    assert a.position == b.position and a.tokens == b.tokens
    for i in a.gdn:
        np.testing.assert_array_equal(a.gdn[i].recurrent, b.gdn[i].recurrent)
        np.testing.assert_array_equal(a.gdn[i].conv, b.gdn[i].conv)
    for i in a.attention:
        np.testing.assert_array_equal(a.attention[i].key, b.attention[i].key)
        np.testing.assert_array_equal(a.attention[i].value, b.attention[i].value)


def test_a_commit_beside_the_drafter_leaves_the_state_commit_path_leaves():
    """commit_beside on a worker thread: the state after it is bit for bit commit_path's, the work
    ran on the calling thread, and it returns only once the commit is done; an error in the work
    still leaves the whole commit done, and an error in the commit reaches the caller."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from hybrid_npu.runtime.speculative import commit_beside, commit_path

    worker = ThreadPoolExecutor(1)
    want, out, tree, path, k = _random_round(3)
    commit_path(want, out, tree, path, k)
    state = _random_round(3)[0]
    ran = []
    commit_beside(worker, state, out, tree, path, k, lambda: ran.append(threading.current_thread()))
    assert ran == [threading.main_thread()]
    _same_state(state, want)

    state = _random_round(3)[0]
    def failing():
        raise RuntimeError("drafter failed")
    with pytest.raises(RuntimeError, match="drafter failed"):
        commit_beside(worker, state, out, tree, path, k, failing)
    _same_state(state, want)

    state = _random_round(3)[0]
    broken = dict(out)
    del broken["commit_u.2"]
    ran.clear()
    with pytest.raises(KeyError):
        commit_beside(worker, state, broken, tree, path, k, lambda: ran.append(1))
    assert ran == [1]
    state = _random_round(3)[0]
    commit_beside(None, state, out, tree, path, k, lambda: ran.append(2))  # no worker: one after the other
    assert ran == [1, 2]
    _same_state(state, want)
    worker.shutdown()


def test_rounds_committing_on_a_worker_thread_speculate_to_the_plain_output(text_tied, plain_greedy, monkeypatch):
    """The tiny model's states are below the size where a round commits beside the drafter; with
    that bound at 0 every round does, and greedy output is still the plain output."""
    import hybrid_npu.runtime.model as model_module

    engine = hybrid_npu.load_engine(text_tied.out)
    assert engine.commit_worker() is None  # the tiny model commits inline
    monkeypatch.setattr(model_module, "COMMIT_BESIDE_MIN_BYTES", 0)
    engine.drafter = OracleDrafter(320, engine, PROMPT + plain_greedy, wrong_rate=0.3, chain=True)
    engine.adaptive = False
    assert engine.generate(PROMPT, 256, stop_at_eos=False) == plain_greedy
    assert engine.last_stats["rounds"] > 0 and engine._commit_worker is not None
