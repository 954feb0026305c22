"""The checkpoint's own MTP head as a drafter (docs/mtp-drafter.md): the exported graphs against the
numpy reference (several steps, K/V growing) and the reference against transformers' own layers;
speculation with it is lossless (greedy chain and tree, sampled distribution); a checkpoint
without an MTP head is refused in one line."""
import copy
import json

import numpy as np
import pytest
import torch
from conftest import CHUNK
from safetensors.numpy import load_file, save_file

import fixtures
from sampled_check import check_first_two
import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.checkpoint import read_checkpoint
from hybrid_npu.export.cli import main as export_main
from hybrid_npu.export.exporter import export
from hybrid_npu.export.drafters.mtp import MtpConfig, read_mtp
from hybrid_npu.export.drafters.mtp_reference import mtp_hidden_in_ref, mtp_step_ref
from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.runtime.drafters.mtp import MtpDrafter


@pytest.fixture(scope="module")
def mtp_export(tmp_path_factory):
    """The released layout (mtp.* beside the text weights, sharded), exported with --drafter mtp."""
    root = tmp_path_factory.mktemp("mtp")
    ref = fixtures.write_release_checkpoint(root / "hf", seed=3, tie=True, with_mtp=True, sharded=True)
    export(root / "hf", root / "out", chunk=CHUNK, drafter="mtp")
    return root, ref


def _weights(src) -> tuple[dict, MtpConfig]:
    ck = read_mtp(read_checkpoint(src))
    return {k: ck.load(k).astype(np.float64) for k in ck.shapes}, ck.config


def _causal(n, past=0):
    mask = np.full((n, past + n), MASKED)
    mask[:, :past] = 0.0
    mask[:, past:][np.tril(np.ones((n, n), bool))] = 0.0
    return mask


def _ref_sequence(w, c, residuals, ids):
    """The head over a whole sequence at positions 0..n-1, causal, float64."""
    n = len(ids)
    empty = np.zeros((c.num_key_value_heads, 0, c.head_dim))
    return mtp_step_ref(w, c, mtp_hidden_in_ref(w, c, residuals), ids, np.arange(n), empty, empty, _causal(n))


def _close(a, b, tol=1e-4):
    assert np.isfinite(a).all()
    err = np.abs(np.asarray(a, np.float64) - b).max()
    assert err <= tol, err


def test_onnx_head_matches_numpy_reference_over_steps_with_kv_growth(mtp_export):
    root, _ = mtp_export
    w, c = _weights(root / "hf")
    dr = MtpDrafter(root / "out" / "mtp")
    assert dr.input_order == (c.num_layers,)
    rng = np.random.default_rng(0)
    n = 14
    residuals = 2.0 * rng.standard_normal((n, c.hidden_size)).astype(np.float32)
    ids = [int(t) for t in rng.integers(0, 300, n)]
    want = _ref_sequence(w, c, residuals, ids)
    s = 0
    for chunk in (5, 1, 3, 1, 4):  # each call reads the K/V the earlier ones wrote
        dr.observe(ids[s: s + chunk], residuals[s: s + chunk])
        s += chunk
        _close(dr._logits, want["logits"][s - 1])
        _close(dr._hidden, want["hidden"][s - 1])
        _close(dr.key[:, :s], want["new_key"][:, :s])
    # a chained draft: each level feeds the head its own output hidden, one position further on
    tokens, parents = dr.propose(ids[-1], top_k=1, depth=4, total_tokens=4)
    assert parents == [-1, 0, 1, 2] and dr.length == n
    hidden, logits = want["hidden"][-1], want["logits"][-1]
    keys, values = want["new_key"], want["new_value"]
    for level, token in enumerate(tokens):
        assert token == int(np.argmax(logits))  # greedy chain: the head's argmax
        step = mtp_step_ref(w, c, hidden[None], [token], [n + level], keys, values, _causal(1, keys.shape[1]))
        keys, values = np.concatenate([keys, step["new_key"]], 1), np.concatenate([values, step["new_value"]], 1)
        hidden, logits = step["hidden"][0], step["logits"][0]
        if level < len(tokens) - 1:  # the last level is read off the logits, never run
            _close(dr.key[:, n + level], step["new_key"][:, 0])


def _transformers_head(w, ref, c):
    """The same head from transformers' own pieces: Qwen3_5RMSNorm, a full-attention Qwen3_5DecoderLayer
    loaded with mtp.layers.0.*, its rotary embedding (eager attention, explicit causal mask)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                               Qwen3_5TextRotaryEmbedding)

    cfg = copy.deepcopy(ref.config)
    cfg._attn_implementation = "eager"
    full = cfg.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(cfg, full).double().eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: torch.from_numpy(v) for k, v in w.items()
                           if k.startswith("mtp.layers.0.")})

    def norm(name):
        m = Qwen3_5RMSNorm(c.hidden_size, eps=c.rms_norm_eps).double()
        m.weight.data = torch.from_numpy(w[name])
        return m
    rotary = Qwen3_5TextRotaryEmbedding(cfg)

    def run(residual, ids):
        n = len(ids)
        with torch.no_grad():
            h = norm("norm.weight")(torch.from_numpy(residual.astype(np.float64)))[None]
            e = norm("mtp.pre_fc_norm_embedding.weight")(torch.from_numpy(w["embed_tokens.weight"][ids]))[None]
            x = torch.cat([e, norm("mtp.pre_fc_norm_hidden.weight")(h)], -1) @ torch.from_numpy(w["mtp.fc.weight"]).T
            pos = torch.arange(n)[None]
            cos, sin = rotary(x.float(), pos)
            mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            x = layer(x, (cos.double(), sin.double()), attention_mask=mask, position_ids=pos)
            out = norm("mtp.norm.weight")(x)[0]
            head = w.get("lm_head.weight", w["embed_tokens.weight"])  # tied
            return (out @ torch.from_numpy(head).T).numpy(), out.numpy()
    return run


def test_numpy_reference_matches_transformers_layers(mtp_export):
    root, ref = mtp_export
    w, c = _weights(root / "hf")
    rng = np.random.default_rng(1)
    residuals = 2.0 * rng.standard_normal((9, c.hidden_size))
    ids = [int(t) for t in rng.integers(0, 300, 9)]
    want_logits, want_hidden = _transformers_head(w, ref, c)(residuals, ids)
    got = _ref_sequence(w, c, residuals, ids)
    _close(got["logits"], want_logits, 1e-5)  # both rotate with float32 cos/sin tables
    _close(got["hidden"], want_hidden, 1e-5)


@pytest.mark.parametrize("shape", [{"top_k": 1, "depth": 4, "total_tokens": 4},
                                   {"top_k": 3, "depth": 3, "total_tokens": 12}], ids=["chain", "tree"])
def test_greedy_speculation_with_the_mtp_head_is_the_plain_output(mtp_export, shape):
    root, _ = mtp_export
    engine = hybrid_npu.load_engine(root / "out")
    assert isinstance(engine.drafter, MtpDrafter)
    assert json.loads((root / "out" / "model.json").read_text())["drafter"]["kind"] == "mtp"
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, 2 * CHUNK + 3)]
    plain = engine.generate(prompt, 72, stop_at_eos=False, speculative=False)
    engine.adaptive, engine.draft_shape = False, shape  # every step a round of this shape
    spec = engine.generate(prompt, 72, stop_at_eos=False)
    assert spec == plain
    assert engine.last_stats["rounds"] >= 10


def test_greedy_speculation_continues_a_conversation(mtp_export):
    """A second turn appended after the first: the drafter's K/V goes on from where it was."""
    root, _ = mtp_export
    engine = hybrid_npu.load_engine(root / "out")
    engine.adaptive, engine.draft_shape = False, {"top_k": 2, "depth": 3, "total_tokens": 6}
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 300, CHUNK + 2)]
    spec = engine.generate(prompt, 24, stop_at_eos=False) + engine.generate([8, 9], 40, stop_at_eos=False,
                                                                              append=True)
    plain_engine = hybrid_npu.load_engine(root / "out")
    plain = plain_engine.generate(prompt, 24, stop_at_eos=False, speculative=False)
    plain += plain_engine.generate([8, 9], 40, stop_at_eos=False, speculative=False, append=True)
    assert spec == plain


# ---------------------------------------------------------------- sampling is distribution-exact
V = 12


@pytest.fixture(scope="module")
def tiny_vocab_mtp(tmp_path_factory):
    """A 12-token target with an MTP head: its safetensors get random mtp.* of the right shapes."""
    root = tmp_path_factory.mktemp("tiny_vocab_mtp")
    ref = fixtures.write_text_checkpoint(root / "hf", seed=5, vocab_size=V, bos_token_id=0, eos_token_id=1,
                                         pad_token_id=0)
    (root / "hf" / "tokenizer.json").unlink()  # its 300 ids do not fit 12 rows (refused at export); ids suffice here
    f = root / "hf" / "model.safetensors"
    tensors = load_file(str(f))
    tensors.update({k: v.numpy() for k, v in fixtures.make_mtp_state_dict(ref.config, seed=5).items()})
    save_file(tensors, str(f), metadata={"format": "pt"})
    export(root / "hf", root / "out", chunk=CHUNK, verify=8, drafter="mtp")
    return root / "out"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.9)])
def test_sampled_speculation_with_mtp_trees_has_the_plain_distribution(tiny_vocab_mtp, temperature, top_p):
    """First two generated tokens over 20,000 seeded runs against the exact plain joint distribution:
    for each first token the MTP head drafts its top-3 tree (depth 2) after it, the target verifies
    it once, and the runs exercise the seeded verify on those trees."""
    engine = hybrid_npu.load_engine(tiny_vocab_mtp)
    logits0 = engine.prefill_logits([3, 7, 2, 9, 4])
    engine.catch_up_drafter()  # the prompt's pairs wait for the drafter's next use: here
    dr = engine.drafter
    length, tap = dr.length, engine.tap_pending

    def draft(y, p2):
        dr.rewind(length)
        dr.observe([y], tap[None])  # the prompt's last tap pairs with the first generated token
        return dr.propose(y, top_k=3, depth=2, total_tokens=7)  # top-3 of 12 tokens: drafts are accepted
    check_first_two(engine, logits0, temperature, top_p, draft)


def test_seeded_replies_drafted_with_their_own_noise_have_the_plain_distribution(tiny_vocab_mtp):
    """End to end through engine.generate: 1,200 seeded replies, each a round after its first token
    whose chain the MTP head drafts with the reply's own noise (coupled drafting: the draft depends on
    the seed), give the exact plain joint distribution of the first two tokens (chi-square), with
    drafts really accepted."""
    from sampled_check import chi_square_p

    from hybrid_npu.runtime.sampling import filtered_probs

    runs, prompt = 1200, [3, 7, 2, 9, 4]
    engine = hybrid_npu.load_engine(tiny_vocab_mtp)
    p1 = filtered_probs(engine.prefill_logits(prompt), 1.0)
    base, joint = copy.deepcopy(engine.state), np.zeros((V, V))
    for y in range(V):
        engine.state = copy.deepcopy(base)
        joint[y] = p1[y] * filtered_probs(engine.decode(y), 1.0)
    engine.adaptive, engine.draft_shape = False, {"top_k": 1, "depth": 3, "total_tokens": 3}
    counts, accepted = np.zeros((V, V)), 0
    for seed in range(runs):
        first, second, _ = engine.generate(prompt, 3, temperature=1.0, seed=seed, stop_at_eos=False)
        assert engine.last_stats["rounds"] >= 1  # the second token came from a round
        counts[first, second] += 1
        accepted += engine.last_stats["acceptance_length"] > 1
    assert accepted > runs // 20
    expected = joint.ravel() * runs
    assert counts.ravel()[expected == 0].sum() == 0
    stat, pvalue, bins = chi_square_p(counts.ravel(), expected)
    print(f"\ncoupled chains: chi-square {stat:.1f} over {bins} bins, p = {pvalue:.3f}, "
          f"a draft accepted in {accepted / runs:.0%} of replies")
    assert pvalue > 0.001


# ---------------------------------------------------------------- bad input
def test_a_checkpoint_without_an_mtp_head_is_refused_in_one_line(text_tied, tmp_path, capsys):
    assert export_main([str(text_tied.src), str(tmp_path / "out"), "--drafter", "mtp", "--no-parity"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no MTP head" in err and "mtp.*" in err, err
    assert not (tmp_path / "out").exists()


def test_choosing_a_drafter_kind_the_export_does_not_ship_says_so(mtp_export):
    root, _ = mtp_export
    with pytest.raises(UserError, match="ships no eagle3 drafter"):
        hybrid_npu.load_engine(root / "out", drafter="eagle3")
    assert isinstance(hybrid_npu.load_engine(root / "out", drafter="mtp").drafter, MtpDrafter)


def test_an_export_ships_both_drafters_and_the_kind_is_chosen_at_load(mtp_export, tmp_path):
    """EAGLE-3 in drafter/ (the default) and an MTP head trained apart (a directory of mtp.*) in mtp/."""
    import drafter_fixtures
    from hybrid_npu.runtime.drafters.eagle3 import Eagle3Drafter

    root, _ = mtp_export
    weights = drafter_fixtures.drafter_weights(seed=1, hidden_size=48, embed=False)
    eagle = drafter_fixtures.write_eagle3(tmp_path / "eagle3", weights, hidden_size=48)
    export(root / "hf", tmp_path / "both", chunk=CHUNK, drafter=eagle, mtp=root / "hf")
    manifest = json.loads((tmp_path / "both" / "model.json").read_text())
    assert manifest["drafters"] == {"mtp": "mtp", "eagle3": "drafter"} and manifest["drafter"]["kind"] == "eagle3"
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, CHUNK + 3)]
    plain = None
    for kind, cls in ((None, Eagle3Drafter), ("eagle3", Eagle3Drafter), ("mtp", MtpDrafter)):
        engine = hybrid_npu.load_engine(tmp_path / "both", drafter=kind)
        assert type(engine.drafter) is cls
        plain = plain or engine.generate(prompt, 40, stop_at_eos=False, speculative=False)
        engine.adaptive = False
        assert engine.generate(prompt, 40, stop_at_eos=False) == plain


def test_untied_target_head_drafts_with_its_own_lm_head(tmp_path):
    """An untied target: the MTP logits come from the target's lm_head, not its embedding."""
    fixtures.write_release_checkpoint(tmp_path / "hf", seed=4, tie=False, with_mtp=True)
    export(tmp_path / "hf", tmp_path / "out", chunk=CHUNK, drafter="mtp", compile_context=False)
    w, c = _weights(tmp_path / "hf")
    assert "lm_head.weight" in w
    dr = MtpDrafter(tmp_path / "out" / "mtp")
    rng = np.random.default_rng(5)
    residuals = 2.0 * rng.standard_normal((6, c.hidden_size)).astype(np.float32)
    ids = [int(t) for t in rng.integers(0, 300, 6)]
    dr.observe(ids, residuals)
    _close(dr._logits, _ref_sequence(w, c, residuals, ids)["logits"][-1])


def test_training_module_computes_what_the_export_runs(mtp_export):
    """scripts/train/mtp_model.py's TTT unroll against the numpy reference: step 0 is the head over the
    sequence; step 1 at row t is the chained step the runtime drafts (its own hidden, token t+2,
    position t+1, seeing rows 0..t and itself)."""

    from mtp_model import MtpHead

    from hybrid_npu.config import ModelConfig

    root, _ = mtp_export
    w, c = _weights(root / "hf")
    cfg = ModelConfig.from_dict(json.loads((root / "out" / "model.json").read_text())["config"])
    head = MtpHead(cfg, torch.from_numpy(w["embed_tokens.weight"]).float(),
                   torch.from_numpy(w.get("lm_head.weight", w["embed_tokens.weight"])).float())
    head.load_state_dict({k[len("mtp."):]: torch.from_numpy(v).float() for k, v in w.items() if k.startswith("mtp.")})
    rng = np.random.default_rng(3)
    n = 8
    residuals = 2.0 * rng.standard_normal((n, c.hidden_size))
    ids = [int(t) for t in rng.integers(0, 300, n)]
    hidden = mtp_hidden_in_ref(w, c, residuals)
    with torch.no_grad():
        step0, step1 = head.ttt(torch.from_numpy(hidden).float()[None], torch.tensor([ids]), 2)
    ref = mtp_step_ref(w, c, hidden[:-1], ids[1:], np.arange(n - 1), np.zeros((c.num_key_value_heads, 0, c.head_dim)),
                       np.zeros((c.num_key_value_heads, 0, c.head_dim)), _causal(n - 1))
    _close(step0[0].numpy(), ref["logits"])
    for t in range(n - 2):
        past_k, past_v = ref["new_key"][:, : t + 1], ref["new_value"][:, : t + 1]
        chained = mtp_step_ref(w, c, ref["hidden"][t: t + 1], [ids[t + 2]], [t + 1], past_k, past_v, _causal(1, t + 1))
        _close(step1[0, t].numpy(), chained["logits"][0])


@pytest.mark.parametrize("window", [None, 5])
def test_training_unroll_is_the_runtime_drafter_with_its_window(mtp_export, window):
    """scripts/train/mtp_model.py's TTT unroll against the runtime's MtpDrafter, windowed or not: step 0 at
    row t is its observe of rows 0..t (a row at a time, as a window needs), steps 1.. the chain it
    proposes from there; with a window, the training mask reads the rows the runtime reads (an
    observed row the window before it and itself, a chained step the last `window` stable rows)."""

    from mtp_model import MtpHead

    from hybrid_npu.config import ModelConfig

    root, _ = mtp_export
    w, c = _weights(root / "hf")
    cfg = ModelConfig.from_dict(json.loads((root / "out" / "model.json").read_text())["config"])
    head = MtpHead(cfg, torch.from_numpy(w["embed_tokens.weight"]).float(),
                   torch.from_numpy(w.get("lm_head.weight", w["embed_tokens.weight"])).float(), window=window)
    head.load_state_dict({k[len("mtp."):]: torch.from_numpy(v).float() for k, v in w.items() if k.startswith("mtp.")})
    rt = MtpDrafter(root / "out" / "mtp", window=window)
    rng = np.random.default_rng(5)
    n, depth = 20, 4
    residuals = (2.0 * rng.standard_normal((n, c.hidden_size))).astype(np.float32)
    ids = rng.integers(0, 300, n)
    hidden = mtp_hidden_in_ref(w, c, residuals)
    levels = []  # each chained level's logits, as the runtime drafts them
    run = rt._call  # every call of the drafter graph
    rt._call = lambda *a, **k: (lambda out: levels.append(out["logits"][0].copy()) or out)(run(*a, **k))
    for t in (0, 4, 9, 14):
        rt.reset()
        for r in range(t + 1):
            rt.observe([int(ids[r + 1])], residuals[r: r + 1])
        first = rt._logits.copy()
        levels.clear()
        chain, _ = rt.propose(int(ids[t + 1]), top_k=1, depth=depth, total_tokens=depth)
        assert len(levels) == depth - 1  # each chained level's call was seen
        forced = np.concatenate([ids[: t + 2], chain[:-1]])   # the chain's own tokens as ground truth
        padded = np.zeros((len(forced), c.hidden_size), np.float32)
        padded[: t + 1] = hidden[: t + 1]
        with torch.no_grad():
            logits = head.ttt(torch.from_numpy(padded)[None], torch.from_numpy(forced)[None], depth)
        for got, want in zip(logits, [first, *levels]):
            _close(got[0, t].numpy(), want)
        assert [int(lg[0, t].argmax()) for lg in logits] == chain, t


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_mtp_head_is_the_reference_on_its_dequantised_weights(mtp_export, tmp_path, bits):
    """A quantised target ships its MTP head quantised alike (export_mtp(quant=...)): every linear
    layer and its own copy of the tied head block-quantised (MatMulNBits), the embedding table fp16;
    with fp32 compute the head is the numpy reference on the dequantised weights."""
    import onnx
    from hybrid_npu.export.drafters.mtp import export_mtp
    from hybrid_npu.export.quantize import QuantSpec, dequantize_blockwise, quantize_blockwise

    root, _ = mtp_export
    spec = QuantSpec(bits=bits, block_size=16)
    manifest = export_mtp(read_mtp(read_checkpoint(root / "hf")), tmp_path / "q", quant=spec)
    assert manifest["weights"]["quant"] == spec.to_manifest()
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q" / "mtp.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 6 and "Gemm" not in ops  # fc, qkv, o, gate|up, down, head
    w, c = _weights(root / "hf")
    # the embedding is read in place, fp16: a Cast ahead of its Gather was folded into an fp32 copy
    # (at real size 1.0 GB more than the file: the 0.8B's MTP session held 1.1 GB for 0.56 GB of weights)
    assert fixtures.tables_ort_holds(tmp_path / "q" / "mtp.onnx", w["embed_tokens.weight"].shape) == [
        onnx.TensorProto.FLOAT16]
    fixtures.fp32_compute(tmp_path / "q")  # the reference's arithmetic

    def round_trip(m, b):
        m = m.astype(np.float32)
        return dequantize_blockwise(*quantize_blockwise(m, b, spec.block_size, spec.symmetric), b, m.shape[1])

    table = w["embed_tokens.weight"]
    w = {k: round_trip(v, bits).astype(np.float64) if k.endswith(("proj.weight", "fc.weight")) else v
         for k, v in w.items()}
    w["lm_head.weight"] = round_trip(table, spec.head_bits).astype(np.float64)  # tied: its own copy
    w["embed_tokens.weight"] = table.astype(np.float16).astype(np.float64)
    dr = MtpDrafter(tmp_path / "q")
    rng = np.random.default_rng(1)
    residuals = 2.0 * rng.standard_normal((12, c.hidden_size)).astype(np.float32)
    ids = [int(t) for t in rng.integers(0, 300, 12)]
    want = _ref_sequence(w, c, residuals, ids)
    dr.observe(ids[:7], residuals[:7])
    dr.observe(ids[7:], residuals[7:])
    scale = max(1.0, np.abs(want["logits"][-1]).max())
    _close(dr._logits / scale, want["logits"][-1] / scale)
    _close(dr._hidden, want["hidden"][-1])
    _close(dr.key[:, :12], want["new_key"][:, :12])
