"""scripts/train/train_drafter.py: EAGLE-3 TTT training for a hybrid target, end to end on the tiny fixture.

Checks that matter beyond "it runs": the trainer's features are the runtime's taps (the off-by-one
trap of docs/eagle3-drafter.md), the torch drafter's TTT unroll is what the exported ONNX drafter
computes at inference (observe + chain propose), the loss can go down, and a trained checkpoint
exports and speculates losslessly.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import drafter_fixtures as dfx  # noqa: E402
import fixtures  # noqa: E402
import eagle3_data  # noqa: E402
import stdlib_corpus  # noqa: E402
import train_drafter  # noqa: E402
from conftest import CHUNK  # noqa: E402
from eagle3_model import (Drafter, DraftShape, init_from_target, load_checkpoint, save_checkpoint,  # noqa: E402
                          shape_for_target)
from eagle3_train import collate, ttt_loss  # noqa: E402

import hybrid_npu  # noqa: E402
from hybrid_npu.export.drafters.eagle3 import export_drafter, read_drafter  # noqa: E402
from hybrid_npu.runtime.drafters.eagle3 import Eagle3Drafter  # noqa: E402

TAPS = dfx.target_config().tap_layers


def _corpus(root: Path) -> Path:
    """A few modules of small documented functions; enough names that some land in the held-out split."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(40):
        body = "".join(f'def f{i}_{j}(x):\n    """Return the value times {j} plus one, as an int."""\n'
                       f"    return int(x * {j} + 1)\n\n\n" for j in range(2))
        (root / f"m{i}.py").write_text(f'"""Module {i}."""\n\n' + body)
    docs = stdlib_corpus.documents(root)
    assert any(d.held_out for d in docs) and any(not d.held_out for d in docs)
    return root


@pytest.fixture(scope="module")
def trained(text_tied, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    out = root / "drafter"
    rc = train_drafter.main([str(text_tied.src), str(out), "--corpus-root", str(_corpus(root / "corpus")),
                             "--export-dir", str(root / "export"),
                             "--prompts", "12", "--gen-tokens", "12", "--max-prompt", "48", "--eval-prompts", "3",
                             "--runtime-prompts", "1", "--max-steps", "4", "--draft-vocab", "64",
                             "--ttt-steps", "3", "--batch", "4", "--threads", "1",
                             "--long-prompts", "3", "--max-context", "512", "--window", "24"])
    assert rc == 0
    return root


def test_trained_drafter_exports_and_speculates_losslessly(trained):
    log = json.loads((trained / "drafter" / "train_log.json").read_text())
    assert log["final_step"] == 4 and all(len(x) == 3 for x in log["loss_per_ttt_step"])
    assert log["data"]["train_sequences"] == 12 + 3 and log["eval_chain_long"]["rounds"] > 0
    assert log["eval_runtime"]["all_lossless"]
    cfg = json.loads((trained / "drafter" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    out = trained / "export"                            # export-hybrid TARGET OUT --drafter DRAFTER, by the script
    manifest = json.loads((out / "drafter" / "drafter.json").read_text())
    assert manifest["taps"]["layers"] == list(TAPS)     # the runtime taps what the trainer recorded
    engine = hybrid_npu.load_engine(out)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 300, CHUNK + 3)]
    plain = engine.generate(prompt, 40, stop_at_eos=False, speculative=False)
    spec = engine.generate(prompt, 40, stop_at_eos=False, speculative=True)
    assert spec == plain and engine.last_stats["rounds"] > 0


def test_trainer_features_are_the_runtime_taps(text_tied):
    class Recorder:  # a drafter that only records what the engine observes
        def reset(self):
            self.feats = []

        def observe(self, tokens, features):
            self.feats.append(np.asarray(features))

        def propose(self, *a, **kw):
            return [], []

    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (2 * CHUNK + 5, CHUNK - 3)]  # left padding too
    seqs = eagle3_data.generate(text_tied.ref, prompts, 8, 2, fixtures.ENDOFTEXT_ID, [fixtures.IM_END_ID], TAPS)
    rec = Recorder()
    engine = hybrid_npu.load_engine(text_tied.out, drafter=rec)
    for seq in seqs:
        assert len(seq.ids) > seq.prompt_len + 2      # prefill and decode-step features both checked
        logits = engine.prefill_logits([int(t) for t in seq.ids])
        engine.catch_up_drafter()                      # the pairs wait for the drafter's next use: here
        runtime = np.concatenate(rec.feats)           # taps of positions 0..n-2 (the last one waits)
        np.testing.assert_allclose(seq.taps[:-1], runtime, atol=2e-4, rtol=1e-3)
        assert seq.argmax[-1] == int(np.argmax(logits))
        assert list(seq.ids[seq.prompt_len:]) == list(seq.argmax[seq.prompt_len - 1:-1])  # greedy continuation


def test_long_contexts_keep_their_last_window_rows(text_tied):
    """keep_prompt drops a long prompt's older rows only: what is kept is the tail of the full run."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (70, 20)]
    args = (text_tied.ref, prompts, 8, 2, fixtures.ENDOFTEXT_ID, [fixtures.IM_END_ID], TAPS)
    full, kept = eagle3_data.generate(*args), eagle3_data.generate(*args, keep_prompt=32)
    for f, k in zip(full, kept):
        drop = max(f.prompt_len - 32, 0)
        assert k.prompt_len == f.prompt_len - drop and len(k.ids) == len(f.ids) - drop
        np.testing.assert_array_equal(k.ids, f.ids[drop:])
        np.testing.assert_array_equal(k.argmax, f.argmax[drop:])
        np.testing.assert_allclose(k.taps, f.taps[drop:], rtol=0, atol=1e-6)
    assert kept[0].prompt_len == 32 and kept[1].prompt_len == 20


def test_context_prompts_are_source_stretches_half_ending_in_a_question(tmp_path):
    docs = stdlib_corpus.documents(_corpus(tmp_path / "corpus"))
    tok = fixtures.train_tiny_tokenizer()
    out = eagle3_data.context_prompts(docs, tok, 40, seed=3, max_context=300, min_context=60)
    source = np.concatenate([tok.encode(d.text).ids for d in docs if d.kind == "code"])
    asks = [tok.encode(stdlib_corpus.chat_text(d.prompt)).ids for d in docs if d.kind != "code"]
    n_ask = [next((len(a) for a in asks if len(a) < len(p) and p[-len(a):] == a), 0) for p in out]
    assert 10 <= sum(n > 0 for n in n_ask) <= 30           # about half end in a chat turn
    assert all(len(p) <= 300 for p in out) and max(len(p) for p in out) > 150
    windows = np.lib.stride_tricks.sliding_window_view
    for p, n in zip(out, n_ask):                            # the rest is one stretch of the source
        body = np.asarray(p[: len(p) - n])
        assert (windows(source, len(body)) == body).all(1).any()
    assert out == eagle3_data.context_prompts(docs, tok, 40, seed=3, max_context=300, min_context=60)


def _random_drafter(seed=0) -> tuple[Drafter, np.ndarray, torch.Tensor]:
    torch.manual_seed(seed)
    s = DraftShape(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=40,
                   vocab_size=320, draft_vocab_size=64, target_hidden_size=48, n_taps=3, rms_norm_eps=1e-6,
                   rope_theta=10000.0)
    embed = torch.from_numpy(dfx.target_embedding(seed=3))
    d = Drafter(s, embed)
    gain = {"q_proj": 4.0, "k_proj": 4.0, "v_proj": 3.0, "o_proj": 3.0, "lm_head": 4.0}
    with torch.no_grad():  # attention-dominated and sharp: a wrong mask or position changes the drafts
        for name, p in d.named_parameters():
            p.mul_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else gain.get(name.split(".")[-2], 1.0))
    used = np.sort(np.random.default_rng(seed).choice(320, 64, replace=False)).astype(np.int64)
    return d, used, embed


def test_init_continues_from_a_saved_checkpoint(tmp_path):
    """--init: a fresh drafter loaded from a checkpoint computes what the saved one did (every
    weight back), and a checkpoint over another draft vocabulary is refused, not half loaded."""
    from hybrid_npu.errors import UserError

    d, used, embed = _random_drafter()
    save_checkpoint(d, used, TAPS, tmp_path / "ck")
    fresh = Drafter(d.shape, embed)
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 320, (1, 12)))
    taps = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 12, 3 * 48)).astype(np.float32))
    with torch.no_grad():
        before = fresh.ttt(taps, ids, 2)[1]
        load_checkpoint(fresh, used, tmp_path / "ck")
        after, want = fresh.ttt(taps, ids, 2)[1], d.ttt(taps, ids, 2)[1]
    assert not torch.allclose(before, want)
    torch.testing.assert_close(after, want, atol=0, rtol=0)
    other = used.copy()
    other[0] = next(i for i in range(320) if i not in set(used))
    with pytest.raises(UserError, match="draft vocabulary"):
        load_checkpoint(Drafter(d.shape, embed), np.sort(other), tmp_path / "ck")


@pytest.mark.parametrize("window", [None, 5])
def test_ttt_unroll_matches_the_exported_drafter(tmp_path, window):
    """Step 0 = the runtime's observe; step k = level k+1 of a top_k=1 chain (own feature fed back,
    attention over the stable context plus the chain so far, RoPE position t + k). With a window,
    the training mask reads the rows the runtime's windowed drafter reads (observed a row at a time:
    a chunk's rows share the window start of its first)."""
    d, used, embed = _random_drafter()
    d.midlayer.self_attn.window = window
    save_checkpoint(d, used, TAPS, tmp_path / "ck")
    export_drafter(read_drafter(tmp_path / "ck", dfx.target_config(), embed.numpy()), tmp_path / "onnx")
    rt = Eagle3Drafter(tmp_path / "onnx", window=window)
    rng = np.random.default_rng(1)
    depth = 5
    ids = rng.integers(0, 320, 24)
    taps = rng.standard_normal((24, 3 * 48)).astype(np.float32)
    for t in (0, 3, 9, 17):
        rt.reset()
        if window:
            for r in range(t + 1):
                rt.observe([int(ids[r + 1])], taps[r: r + 1])
        else:
            rt.observe([int(x) for x in ids[1: t + 2]], taps[: t + 1])
        chain, _ = rt.propose(int(ids[t + 1]), top_k=1, depth=depth, total_tokens=depth)
        forced = np.concatenate([ids[: t + 2], chain[:-1]])       # the chain's own tokens as ground truth
        padded = np.zeros((len(forced), 3 * 48), np.float32)
        padded[: t + 1] = taps[: t + 1]
        with torch.no_grad():
            logits = d.ttt(torch.from_numpy(padded)[None], torch.from_numpy(forced)[None], depth)
        np.testing.assert_allclose(logits[0][0, t].numpy(), rt._logits, atol=1e-4, rtol=1e-4)
        assert [int(used[lg[0, t].argmax()]) for lg in logits] == chain, t


def test_ttt_loss_decreases_on_a_fixed_batch(text_tied):
    model = text_tied.ref
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(0, 300, 12)] for _ in range(3)]
    seqs = eagle3_data.generate(model, prompts, 12, 3, fixtures.ENDOFTEXT_ID, [fixtures.IM_END_ID], TAPS)
    used = eagle3_data.draft_vocabulary(seqs, 320, 128)
    t2d = np.isin(np.arange(320), used)
    torch.manual_seed(0)
    d = Drafter(shape_for_target(model.config, 128), model.model.embed_tokens.weight)
    used_t = torch.from_numpy(used)
    init_from_target(d, model, used_t)
    head = model.lm_head.weight.detach()[used_t]
    batch = collate(seqs, t2d)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    history = []
    for _ in range(30):
        total, losses, _ = ttt_loss(d, batch, head, steps=3)
        opt.zero_grad()
        total.backward()
        opt.step()
        history.append(losses)
    first, last = np.array(history[0]), np.array(history[-1])
    assert (last < 0.7 * first).all(), (first, last)   # every TTT step learns, not only step 0


def test_bad_target_is_one_line_exit_2(tmp_path, capsys):
    assert train_drafter.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no config.json" in err and "\n" not in err
