"""EAGLE-3 drafter: loading both layouts, ONNX vs a float64 torch reference, bad inputs, EAGLE-2 trees.

Spec: docs/eagle3-drafter.md, §1.5 (d2t), §1.6 (tree).
"""
import numpy as np
import pytest
import torch

import drafter_fixtures as dfx
import fixtures
from hybrid_npu.errors import UserError
from hybrid_npu.export.drafters.eagle3 import export_drafter, read_drafter
from hybrid_npu.runtime.drafters.eagle3 import Eagle3Drafter

TARGET = dfx.target_config()
TAPS = TARGET.tap_layers  # (2, 3, 3)


# ------------------------------------------------------------------------ torch reference (float64)
def _t(a):
    return torch.as_tensor(np.asarray(a), dtype=torch.float64)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    """Llama rotate-half RoPE over the whole head_dim; x [T, heads, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_fc(w, taps, order=TAPS, drafter_taps=TAPS, input_norm=False):
    """taps [T, 3H] in the target's order -> f [T, h]."""
    x = _t(taps)
    x = torch.cat([x[:, order.index(j) * dfx.H:(order.index(j) + 1) * dfx.H] for j in drafter_taps], -1)
    if input_norm:
        x = _rms(x, _t(w["input_norm.weight"]))
    return x @ _t(w["fc.weight"]).T


def ref_layer(w, f, ids, pos, allowed, nbr=False, qk_norm=False, normed_out=False, nh=4, nkv=2, hd=12):
    """One drafter step, docs/eagle3-drafter.md, full attention under `allowed` [T, T] -> logits [T, Vd], hidden [T, h]."""
    p = "midlayer."
    f = _t(f)
    e = _t(w["embed_tokens.weight"])[torch.as_tensor(ids)]
    fn = _rms(f, _t(w[p + "hidden_norm.weight"]))
    x = torch.cat([_rms(e, _t(w[p + "input_layernorm.weight"])), fn], -1)  # embedding first
    T = x.shape[0]
    q = (x @ _t(w[p + "self_attn.q_proj.weight"]).T).view(T, nh, hd)
    k = (x @ _t(w[p + "self_attn.k_proj.weight"]).T).view(T, nkv, hd)
    v = (x @ _t(w[p + "self_attn.v_proj.weight"]).T).view(T, nkv, hd)
    if qk_norm:
        q, k = _rms(q, _t(w[p + "self_attn.q_norm.weight"])), _rms(k, _t(w[p + "self_attn.k_norm.weight"]))
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    s = s.masked_fill(~torch.as_tensor(allowed)[None], float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", s, v).reshape(T, nh * hd) @ _t(w[p + "self_attn.o_proj.weight"]).T
    x = o + (fn if nbr else f)  # residual = un-normalised f (or hidden_norm(f): norm_before_residual)
    h = _rms(x, _t(w[p + "post_attention_layernorm.weight"]))
    x = x + (torch.nn.functional.silu(h @ _t(w[p + "mlp.gate_proj.weight"]).T) * (h @ _t(w[p + "mlp.up_proj.weight"]).T)
             ) @ _t(w[p + "mlp.down_proj.weight"]).T
    xn = _rms(x, _t(w["norm.weight"]))
    return (xn @ _t(w["lm_head.weight"]).T).numpy(), (xn if normed_out else x).numpy()


def d2t(w):
    return np.arange(w["lm_head.weight"].shape[0]) + w["d2t"] if "d2t" in w else np.arange(dfx.V)


def taps_and_tokens(n, seed=3):
    """Target taps concatenated in TAPS order (a layer tapped twice gives the same tensor twice), tokens."""
    rng = np.random.default_rng(seed)
    per_layer = {j: rng.standard_normal((n, dfx.H)).astype(np.float32) for j in sorted(set(TAPS))}
    return np.concatenate([per_layer[j] for j in TAPS], -1), [int(t) for t in rng.integers(0, 300, n)]


def close(a, b, tol=1e-5):
    assert np.isfinite(a).all()
    err = np.abs(np.asarray(a, np.float64) - b).max()
    assert err <= tol, err  # absolute


# ------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Same weights, both layouts, exported."""
    root = tmp_path_factory.mktemp("drafter")
    w = dfx.drafter_weights(seed=0)
    outs = {}
    for name, write in (("eagle3", dfx.write_eagle3), ("speculators", dfx.write_speculators)):
        ck = read_drafter(write(root / name, w), TARGET)
        export_drafter(ck, root / f"{name}.out")
        outs[name] = root / f"{name}.out"
    return w, outs


def _export(tmp_path, writer, w, **kw):
    ck = read_drafter(writer(tmp_path / "src", w, **kw), TARGET)
    export_drafter(ck, tmp_path / "out")
    return ck, Eagle3Drafter(tmp_path / "out")


# ------------------------------------------------------------------------ parity
def _check_observe(drafter, w, chunks, fc=ref_fc, **ref_kw):
    """Observe in chunks (K/V carried between calls) and compare each call's last row with a full pass."""
    n = sum(chunks)
    taps, toks = taps_and_tokens(n)
    f = fc(w, taps)
    lg, hid = ref_layer(w, f, toks, np.arange(n), np.tril(np.ones((n, n), bool)), **ref_kw)
    s = 0
    for c in chunks:
        drafter.observe(toks[s: s + c], taps[s: s + c])
        s += c
        close(drafter._logits, lg[s - 1])
        close(drafter._hidden, hid[s - 1])
    return taps, toks, lg, hid


def test_onnx_matches_torch_with_kv(plain):
    w, outs = plain
    dr = Eagle3Drafter(outs["eagle3"])
    _check_observe(dr, w, [5, 1, 3, 1])
    assert dr.length == 10
    # every row of one multi-token step against the reference (past = the 10 stable rows)
    taps, toks = taps_and_tokens(13)
    dr.reset()
    dr.observe(toks[:10], taps[:10])
    f = dr.fc.run(None, {"taps": taps[10:]})[0]
    vis = np.ones((3, 10), bool)
    out = dr._run(f, toks[10:], 10 + np.arange(3), 0, 10, vis, np.tril(np.ones((3, 3), bool)), np.arange(3))
    lg, hid = ref_layer(w, ref_fc(w, taps), toks, np.arange(13), np.tril(np.ones((13, 13), bool)))
    close(out["logits"], lg[10:])
    close(out["hidden"], hid[10:])
    # only some rows asked for: their logits and hidden, and still every row's K/V (the next calls read them)
    part = dr._run(f, toks[10:], 10 + np.arange(3), 0, 10, vis, np.tril(np.ones((3, 3), bool)), [2, 0])
    assert part["logits"].shape[0] == part["hidden"].shape[0] == 2
    close(part["logits"], lg[[12, 10]])
    close(part["hidden"], hid[[12, 10]])
    np.testing.assert_array_equal(part["new_key"], out["new_key"])
    np.testing.assert_array_equal(part["new_value"], out["new_value"])


def test_guesses_are_the_guess_after_each_of_the_last_positions(plain):
    """observe(..., guesses=k) over a call longer than one observe chunk: the last k positions' guesses
    equal guess() after observing one position at a time, and the K/V and draft state are as without."""
    from hybrid_npu.runtime.drafters.draft_tree import OBSERVE_CHUNK
    _, outs = plain
    n, k = OBSERVE_CHUNK + 6, 10  # the guessed rows straddle the chunk boundary
    taps, toks = taps_and_tokens(n, seed=8)
    a, b = Eagle3Drafter(outs["eagle3"]), Eagle3Drafter(outs["eagle3"])
    got = a.observe(toks, taps, guesses=k)
    want = []
    for j in range(n):
        b.observe(toks[j: j + 1], taps[j: j + 1])
        want.append(b.guess())
    assert got == want[-k:]
    c = Eagle3Drafter(outs["eagle3"])
    assert c.observe(toks, taps) is None
    np.testing.assert_array_equal(a.key[:, :n], c.key[:, :n])
    close(a._logits, c._logits, 1e-6)
    assert a.guess() == c.guess() == want[-1]


def test_window_sees_only_the_last_rows(plain):
    """A drafter with a window of W stable rows = the reference whose query at position t sees
    rows [t - W, t] only (observe one token at a time, then a chain proposal); a window longer
    than the context changes nothing."""
    w, outs = plain
    W, n = 4, 11
    dr, full = Eagle3Drafter(outs["eagle3"], window=W), Eagle3Drafter(outs["eagle3"], window=None)
    taps, toks = taps_and_tokens(n)
    band = np.array([[t - W <= j <= t for j in range(n)] for t in range(n)])
    lg, hid = ref_layer(w, ref_fc(w, taps), toks, np.arange(n), band)
    for t in range(n):
        dr.observe(toks[t: t + 1], taps[t: t + 1])
        full.observe(toks[t: t + 1], taps[t: t + 1])
        close(dr._logits, lg[t])
        close(dr._hidden, hid[t])
    # a 3-level chain: level-2 query at position n sees stable rows [n - W, n) and the level-1 row
    tokens, _ = dr.propose(toks[-1], top_k=1, depth=3, total_tokens=2)
    feats, ids, pos = list(ref_fc(w, taps).numpy()), list(toks), list(range(n))
    feats.append(hid[-1])
    ids.append(tokens[0])
    pos.append(n)
    m = n + 1
    band2 = np.array([[(r >= n) or (max(p, n) - W <= r <= p) for r in range(m)] for p in pos]) & np.tril(
        np.ones((m, m), bool))
    band2[:n, :n] = band
    l2, _ = ref_layer(w, np.stack(feats), ids, np.array(pos), band2)
    assert tokens[1] == int(d2t(w)[np.argmax(l2[-1])])
    big = Eagle3Drafter(outs["eagle3"], window=64)
    big.observe(toks, taps)
    assert big.propose(toks[-1], 4, 4, 20) == full.propose(toks[-1], 4, 4, 20)


def test_skipped_rows_are_never_read(plain):
    """skip(n) then observing the last context_rows pairs = observing all of them in the same calls
    for the last ones: the same K/V in every row a later query can see, the same last logits,
    hidden and guesses, the same trees (the skipped rows are never computed, so never read)."""
    w, outs = plain
    W, n = 8, 300
    taps, toks = taps_and_tokens(n)
    lazy, ref = Eagle3Drafter(outs["eagle3"], window=W), Eagle3Drafter(outs["eagle3"], window=W)
    keep = lazy.context_rows
    assert keep == W + 128 and keep < n
    lazy.skip(n - keep)
    ref.observe(toks[: n - keep], taps[: n - keep])
    logits = {lazy: {}, ref: {}}  # position -> draft logits, of the rows the guesses read

    def recording(d):
        run = d._run

        def recorded(features, ids, position, lo, hi, visible, new_visible, rows, **kw):
            out = run(features, ids, position, lo, hi, visible, new_visible, rows, **kw)
            logits[d].update({int(p): r for p, r in zip(np.asarray(position)[rows], out["logits"]) if p >= n - 9})
            return out
        return recorded

    lazy._run, ref._run = recording(lazy), recording(ref)
    guesses = [d.observe(toks[n - keep:], taps[n - keep:], guesses=9) for d in (lazy, ref)]
    assert lazy.length == ref.length == n and guesses[0] == guesses[1]
    assert sorted(logits[lazy]) == sorted(logits[ref]) == list(range(n - 9, n))
    for p in logits[ref]:
        close(logits[lazy][p], logits[ref][p], 1e-6)
    del lazy._run, ref._run
    close(lazy._logits, ref._logits, 1e-6)
    close(lazy._hidden, ref._hidden, 1e-6)
    for name in ("key", "value"):
        close(getattr(lazy, name)[:, n - keep: n], getattr(ref, name)[:, n - keep: n], 1e-6)
    assert lazy.propose(toks[-1], 3, 4, 20) == ref.propose(toks[-1], 3, 4, 20)
    assert Eagle3Drafter(outs["eagle3"], window=None).context_rows is None
    with pytest.raises(ValueError, match="every row"):
        Eagle3Drafter(outs["eagle3"], window=None).skip(3)


def test_a_feed_flushed_into_a_drafter_that_reads_every_row_equals_one_observe(plain, monkeypatch):
    """A window-None drafter cannot skip, so a long run's feed is observed as it grows (FLUSH_AT,
    shrunk here): the drafter ends with the K/V, logits and trees of one observe of every pair."""
    from hybrid_npu.runtime import drafter_feed
    monkeypatch.setattr(drafter_feed, "FLUSH_AT", 100)
    w, outs = plain
    n = 300
    taps, toks = taps_and_tokens(n)
    flushed, ref = Eagle3Drafter(outs["eagle3"], window=None), Eagle3Drafter(outs["eagle3"], window=None)
    feed = drafter_feed.feed_for(flushed)
    for t in range(n):
        feed.add(toks[t:t + 1], taps[t:t + 1], decoded=True)
    assert 0 < flushed.length < n and len(feed._tokens) <= 100
    skipped, tokens, features = feed.take()
    assert skipped == 0
    flushed.observe(tokens, features)
    ref.observe(toks, taps)
    assert flushed.length == ref.length == n
    close(flushed._logits, ref._logits, 1e-5)
    for name in ("key", "value"):
        close(getattr(flushed, name)[:, :n], getattr(ref, name)[:, :n], 1e-5)
    assert flushed.propose(toks[-1], 3, 4, 20) == ref.propose(toks[-1], 3, 4, 20)


def test_both_layouts_give_identical_graphs_and_outputs(plain):
    w, outs = plain
    for f in ("drafter.onnx", "drafter_fc.onnx", "drafter_weights.bin", "vocab.safetensors"):
        assert (outs["eagle3"] / f).read_bytes() == (outs["speculators"] / f).read_bytes(), f
    a, b = Eagle3Drafter(outs["eagle3"]), Eagle3Drafter(outs["speculators"])
    taps, toks = taps_and_tokens(6)
    a.observe(toks, taps)
    b.observe(toks, taps)
    assert np.array_equal(a._logits, b._logits) and np.array_equal(a._hidden, b._hidden)
    assert a.propose(toks[-1], 3, 3, 10) == b.propose(toks[-1], 3, 3, 10)


def test_speculators_options_match_torch(tmp_path):
    """norm_before_fc (input_norm), norm_before_residual, Qwen3-style q/k norms, norm_output (feed back norm(x))."""
    w = dfx.drafter_weights(seed=5, qk_norm=True, input_norm=True)
    ck, dr = _export(tmp_path, dfx.write_speculators, w, norm_before_residual=True, norm_output=True)
    c = ck.config
    assert c.norm_before_fc and c.norm_before_residual and c.qk_norm and c.feed_back_normed
    _check_observe(dr, w, [4, 2], fc=lambda w, t: ref_fc(w, t, input_norm=True), nbr=True, qk_norm=True,
                   normed_out=True)


def test_taps_reordered_and_converted(tmp_path):
    """vLLM ids are used as is; SpecForge eagle_config ids are 'output of layer k' = entering k+1."""
    w = dfx.drafter_weights(seed=2)
    ck, dr = _export(tmp_path / "v", dfx.write_speculators, w, aux_ids=(3, 2, 3))
    assert ck.config.tap_layers == (3, 2, 3) and "as is" in ck.config.tap_source
    _check_observe(dr, w, [3, 2], fc=lambda w, t: ref_fc(w, t, drafter_taps=(3, 2, 3)))
    ck = read_drafter(dfx.write_eagle3(tmp_path / "sf", w, eagle_config_ids=(1, 2, 2)), TARGET)
    assert ck.config.tap_layers == (2, 3, 3) and "k+1" in ck.config.tap_source


def test_shared_target_embedding(tmp_path):
    """No embed_tokens.weight (official checkpoints): the target's table is copied in at export."""
    emb = dfx.target_embedding(h=48)
    w = dfx.drafter_weights(seed=4, embed=False, hidden_size=48)
    with pytest.raises(UserError, match="embed_tokens"):
        read_drafter(dfx.write_eagle3(tmp_path / "a", w, hidden_size=48), TARGET)
    ck = read_drafter(tmp_path / "a", TARGET, target_embedding=lambda: emb)
    assert ck.config.embedding == "target"
    export_drafter(ck, tmp_path / "out")
    _check_observe(Eagle3Drafter(tmp_path / "out"), {**w, "embed_tokens.weight": emb}, [3, 1],
                   nh=4, nkv=2, hd=12)


# ------------------------------------------------------------------------ bad input
def _one_line(exc):
    assert "\n" not in str(exc.value) and str(exc.value)


def test_bad_drafters_refused(tmp_path):
    w = dfx.drafter_weights(seed=1)
    cases = {
        "hidden": (dfx.write_eagle3, dfx.drafter_weights(seed=1, fc_in=3 * 40), {}, r"120 .*144"),
        "target_hidden_size": (dfx.write_eagle3, w, {"target_hidden_size": 64}, "64.*48"),
        "vocab": (dfx.write_eagle3, w, {"vocab_size": 300}, "300.*320"),
        "tap": (dfx.write_speculators, w, {"aux_ids": (1, 3, 3)}, r"entering layers \[1, 3, 3\].*\[2, 3, 3\]"),
        "specforge_tap": (dfx.write_eagle3, w, {"eagle_config_ids": (0, 2, 2)}, r"\[1\]"),
    }
    for name, (writer, weights, kw, pattern) in cases.items():
        path = writer(tmp_path / name, weights, **kw)
        with pytest.raises(UserError, match=pattern) as e:
            read_drafter(path, TARGET)
        _one_line(e)
    with pytest.raises(UserError, match="pickle.*safetensors") as e:
        read_drafter(dfx.write_pickle_only(tmp_path / "pickle", w), TARGET)
    _one_line(e)


# ------------------------------------------------------------------------ trees
def _valid_tree(tokens, parents, w, top_k, depth, total):
    assert len(tokens) == len(parents) <= total
    image = set(d2t(w).tolist())
    levels = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        assert t in image
        assert -1 <= p < i  # parents before children
        levels.append(1 if p < 0 else levels[p] + 1)
    assert max(levels) <= depth
    for p in set(parents):  # at most top_k children per node, distinct tokens
        kids = [tokens[i] for i, q in enumerate(parents) if q == p]
        assert len(kids) <= top_k and len(set(kids)) == len(kids)
    return levels


def test_propose_valid_deterministic_and_matches_reference(plain):
    w, outs = plain
    dr = Eagle3Drafter(outs["eagle3"])
    taps, toks = taps_and_tokens(7)
    dr.observe(toks, taps)
    for top_k, depth, total in ((4, 4, 20), (3, 6, 12), (2, 1, 5), (5, 3, 60), (1, 6, 6), (1, 5, 3)):
        tokens, parents = dr.propose(toks[-1], top_k=top_k, depth=depth, total_tokens=total)
        levels = _valid_tree(tokens, parents, w, top_k, depth, total)
        assert dr.length == 7  # stable K/V untouched
        assert (tokens, parents) == dr.propose(toks[-1], top_k, depth, total)  # tree K/V discarded
        # every expanded node's children are among its top_k under the reference along its path
        f0 = ref_fc(w, taps).numpy()
        lg, hid = ref_layer(w, f0, toks, np.arange(7), np.tril(np.ones((7, 7), bool)))
        root_top = set(d2t(w)[np.argsort(-lg[-1])[:top_k]].tolist())
        assert {t for t, p in zip(tokens, parents) if p < 0} <= root_top
        for node in range(len(tokens)):
            kids = [tokens[i] for i, p in enumerate(parents) if p == node]
            if not kids:
                continue
            path = [node]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            # the path's own drafter steps, fed back (feature of parent step, token), at positions 7..
            feats, ids, hidden = list(f0), list(toks), hid[-1]
            for j in path:
                feats.append(hidden)
                ids.append(tokens[j])  # target ids index the embedding
                n = len(ids)
                l2, h2 = ref_layer(w, np.stack(feats), ids, np.arange(n), np.tril(np.ones((n, n), bool)))
                hidden = h2[-1]
            top = np.argsort(-l2[-1])
            assert set(kids) <= set(d2t(w)[top[:top_k]].tolist()), (node, levels[node])


@pytest.mark.parametrize("window", [None, 4])
def test_chain_proposal_is_the_beam_search_at_top_k_1(plain, window):
    """top_k 1 takes the chain path (no beam bookkeeping, one copy of the window's K/V for every
    level); it proposes what the beam code does and leaves the same K/V rows, with every row
    visible and with a window that leaves the oldest rows out."""
    w, outs = plain
    dr = Eagle3Drafter(outs["eagle3"], window=window)
    taps, toks = taps_and_tokens(9)
    dr.observe(toks, taps)
    for depth, total in ((1, 1), (4, 4), (6, 3), (7, 7)):
        chain = dr.propose(toks[-1], 1, depth, total)
        rows = dr.length + len(chain[0]) - 1
        chain_kv = dr.key[:, :rows].copy(), dr.value[:, :rows].copy()
        assert chain == dr._propose_tree(1, depth, total) and len(chain[0]) == min(depth, total)
        assert chain[1] == [-1] + list(range(len(chain[0]) - 1))
        np.testing.assert_allclose(chain_kv[0], dr.key[:, :rows], atol=1e-5)
        np.testing.assert_allclose(chain_kv[1], dr.value[:, :rows], atol=1e-5)


def test_rollback_is_free(plain):
    """observe, propose, observe more, propose == a drafter that never proposed in between."""
    w, outs = plain
    a, b = Eagle3Drafter(outs["eagle3"]), Eagle3Drafter(outs["eagle3"])
    taps, toks = taps_and_tokens(9)
    a.observe(toks[:5], taps[:5])
    a.propose(toks[4], 4, 5, 30)
    a.observe(toks[5:], taps[5:])
    b.observe(toks, taps)
    assert a.propose(toks[-1], 4, 5, 30) == b.propose(toks[-1], 4, 5, 30)
    with pytest.raises(ValueError, match="last observed"):
        a.propose(toks[-1] + 1, 4, 5, 30)


def test_with_exported_target(text_tied, tmp_path):
    """Real taps: the tiny target's prefill graph feeds the drafter (embedding shared from the target)."""
    import json

    import onnxruntime as ort
    from hybrid_npu.config import ModelConfig
    from hybrid_npu.export.checkpoint import read_checkpoint
    from hybrid_npu.runtime.pipeline import Pipeline
    from hybrid_npu.runtime.state import State
    from hybrid_npu.runtime.step_inputs import chain_feed

    manifest = json.loads((text_tied.out / "model.json").read_text())
    cfg = ModelConfig.from_dict(manifest["config"])
    target = read_checkpoint(text_tied.src)
    w = dfx.drafter_weights(seed=6, embed=False, hidden_size=48)
    ck = read_drafter(dfx.write_eagle3(tmp_path / "src", w, hidden_size=48), cfg,
                      target_embedding=lambda: target.load("embed_tokens.weight"))
    export_drafter(ck, tmp_path / "out")
    dr = Eagle3Drafter(tmp_path / "out")
    sess = ort.InferenceSession(str(text_tied.out / manifest["graphs"]["prefill"]["file"]),
                                providers=["CPUExecutionProvider"])
    n = manifest["graphs"]["prefill"]["n"]
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 290, n)]
    out = Pipeline([sess], "CPU").run(chain_feed(cfg, State.fresh(cfg), ids, n))  # it feeds the state units
    root = int(out["logits"][0].argmax())
    taps = dr.fuse_taps(out)
    dr.observe(ids[1:] + [root], taps)  # taps of position t pair with token t+1; the root closes the prompt
    tokens, parents = dr.propose(root, top_k=4, depth=5, total_tokens=24)
    _valid_tree(tokens, parents, w, 4, 5, 24)
    emb = {**w, "embed_tokens.weight": target.load("embed_tokens.weight")}
    lg, _ = ref_layer(emb, ref_fc(w, taps), ids[1:] + [root], np.arange(n), np.tril(np.ones((n, n), bool)))
    close(dr._logits, lg[-1])


def test_top_k_stable_is_the_stable_full_sort_prefix_with_ties():
    from hybrid_npu.runtime.drafters.draft_tree import top_k_stable

    rng = np.random.default_rng(0)
    for shape, k in (((50,), 5), ((4, 300), 4), ((3, 7), 7), ((2, 9), 12)):
        scores = rng.integers(0, 6, size=shape).astype(np.float32)  # many ties
        want = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
        np.testing.assert_array_equal(top_k_stable(scores, k), want)


# ------------------------------------------------------------------------ quantised drafter
@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_drafter_is_the_float_drafter_on_its_dequantised_weights(tmp_path, bits):
    """export_drafter(quant=...) stores every linear layer block-quantised (MatMulNBits; the head at
    head_bits, the embedding fp16) and no float copy; with fp32 compute it equals the float drafter
    exported from the dequantised weights, and as shipped it drafts a valid tree."""
    import onnx
    from hybrid_npu.export.quantize import QuantSpec, dequantize_blockwise, quantize_blockwise

    spec = QuantSpec(bits=bits, block_size=16)
    w = dfx.drafter_weights(seed=0)
    ck = read_drafter(dfx.write_eagle3(tmp_path / "src", w), TARGET)
    manifest = export_drafter(ck, tmp_path / "q", quant=spec)
    assert manifest["weights"]["quant"] == spec.to_manifest()
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q" / "drafter.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 5 and "Gemm" not in ops  # qkv, o, gate|up, down, head
    # the embedding is read in place, fp16, not folded by ORT into an fp32 copy (a Cast ahead of the Gather)
    assert fixtures.tables_ort_holds(tmp_path / "q" / "drafter.onnx", w["embed_tokens.weight"].shape) == [
        onnx.TensorProto.FLOAT16]
    shipped = Eagle3Drafter(tmp_path / "q")

    def round_trip(m, b):
        return dequantize_blockwise(*quantize_blockwise(m, b, spec.block_size, spec.symmetric), b, m.shape[1])

    rt = {k: (round_trip(v, spec.head_bits if k == "lm_head.weight" else bits) if k.endswith("proj.weight")
              or k in ("fc.weight", "lm_head.weight") else v) for k, v in w.items()}
    rt["embed_tokens.weight"] = w["embed_tokens.weight"].astype(np.float16).astype(np.float32)
    export_drafter(read_drafter(dfx.write_eagle3(tmp_path / "rt", rt), TARGET), tmp_path / "rt.out")
    fixtures.fp32_compute(tmp_path / "q")
    exact, ref = Eagle3Drafter(tmp_path / "q"), Eagle3Drafter(tmp_path / "rt.out")
    taps, toks = taps_and_tokens(40)
    for d in (exact, ref, shipped):
        d.observe(toks[:33], taps[:33])
        d.observe(toks[33:], taps[33:])
    scale = max(1.0, np.abs(ref._logits).max())
    close(exact._logits / scale, ref._logits / scale, 1e-4)
    close(exact._hidden, ref._hidden, 1e-4 * max(1.0, np.abs(ref._hidden).max()))
    assert exact.propose(toks[-1], 3, 3, 10) == ref.propose(toks[-1], 3, 3, 10)
    tokens, parents = shipped.propose(toks[-1], 3, 3, 10)
    assert len(tokens) == 10 and all(-1 <= p < i for i, p in enumerate(parents))


def _lasting(dr):
    """What a drafter carries from round to round: its observed rows and the last row's outputs
    (rows past `length` are a propose's scratch, written again by every propose)."""
    return (dr.length, dr._last_token, dr.key[:, :dr.length].copy(), dr.value[:, :dr.length].copy(),
            None if dr._hidden is None else dr._hidden.copy(), None if dr._logits is None else dr._logits.copy())


class FailingStep:
    """The drafter's step session, raising on its `at`-th call: a look-ahead that fails part-way."""

    def __init__(self, session, at):
        self.session, self.calls, self.at = session, 0, at

    def run(self, *args, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the drafter failed mid-draft")
        return self.session.run(*args, **kw)


@pytest.mark.parametrize("window", [None, 4])
def test_a_look_ahead_kept_dropped_or_failed_leaves_no_trace(plain, window):
    """runtime/look_ahead.draft_ahead on the real EAGLE-3 drafter between rounds, as generation runs
    it while the NPU verifies: deeper than any round (its scratch rows grow the buffers), and failing
    part-way (None, never raised). Afterwards the drafter's lasting state and its next trees and
    chains equal those of a drafter that never looked ahead."""

    from hybrid_npu.runtime import look_ahead

    w, outs = plain
    a, b = Eagle3Drafter(outs["eagle3"], window=window), Eagle3Drafter(outs["eagle3"], window=window)
    taps, toks = taps_and_tokens(14)
    for lo, hi in ((0, 5), (5, 6), (6, 10), (10, 14)):
        a.observe(toks[lo:hi], taps[lo:hi])
        b.observe(toks[lo:hi], taps[lo:hi])
        chain = look_ahead.draft_ahead(a, toks[hi - 1], 40, {})
        assert len(chain) == 40
        a.step = FailingStep(a.step, at=3)
        assert look_ahead.draft_ahead(a, toks[hi - 1], 9, {}) is None
        a.step = a.step.session
        for x, y in zip(_lasting(a), _lasting(b)):
            np.testing.assert_array_equal(x, y)
        assert a.propose(toks[hi - 1], 4, 5, 30) == b.propose(toks[hi - 1], 4, 5, 30)
        assert a.propose(toks[hi - 1], 1, 6, 6) == b.propose(toks[hi - 1], 1, 6, 6)
