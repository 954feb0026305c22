"""A trimmed MTP head (`export-hybrid --drafter mtp --mtp-vocab N`, export/drafters/vocab.py): which
tokens it keeps, that its logits are the full head's at those tokens (numpy reference), that
speculation with it is lossless and drafts only those tokens, and one-line refusals."""
import json

import numpy as np
import pytest
from conftest import CHUNK

import fixtures
import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.cli import main as export_main
from hybrid_npu.export.drafters.vocab import added_token_ids, choose_draft_vocab, draft_vocab_size, trim_hints
from hybrid_npu.export.exporter import export
from hybrid_npu.export.text_input import read_text_input
from hybrid_npu.runtime.drafters.mtp import MtpDrafter

from test_mtp_drafter import _close, _ref_sequence, _weights

N_DRAFT = 40


def test_the_chosen_tokens_are_the_added_and_stop_ones_then_the_most_frequent():
    counts = np.array([0, 5, 9, 9, 1, 0, 7, 2, 0, 3])
    # kept: 9 and 0 (always), then by count, ties by id: 2 (9), 3 (9), 6 (7), 1 (5)
    assert choose_draft_vocab(10, 6, {9, 0}, counts).tolist() == [0, 1, 2, 3, 6, 9]
    # without counts: merge order, i.e. the lowest ids after the ones always kept
    assert choose_draft_vocab(10, 5, {9, 7}).tolist() == [0, 1, 2, 7, 9]
    assert choose_draft_vocab(10, 3, {12, -1}, counts).tolist() == [2, 3, 6]  # ids outside the vocabulary ignored


def test_the_head_is_trimmed_only_when_asked_and_the_export_says_why_to_ask():
    assert draft_vocab_size(248320, None) is None and draft_vocab_size(248320, 0) is None  # all of them
    assert draft_vocab_size(248320, 8192) == 8192
    assert "--mtp-vocab-text" in trim_hints(248320, None, None)  # a released vocabulary, untrimmed
    assert "Chinese" in trim_hints(248320, 32768, None)  # trimmed by id order: English and code
    assert trim_hints(248320, 32768, "mine.txt") is None and trim_hints(4096, None, None) is None


@pytest.mark.parametrize("n,always,match", [(10, set(), "between 2 and 9"), (1, set(), "between 2 and 9"),
                                            (2, {4, 5, 6}, "at least 3")])
def test_a_draft_vocabulary_that_cannot_work_is_one_line(n, always, match):
    with pytest.raises(UserError, match=match):
        choose_draft_vocab(10, n, always)


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    """The released layout with its MTP head, exported with the head trimmed to N_DRAFT tokens chosen
    by their counts in a text."""
    root = tmp_path_factory.mktemp("mtp_vocab")
    fixtures.write_release_checkpoint(root / "hf", seed=3, tie=True, with_mtp=True)
    (root / "text.txt").write_text("the cat sat on the mat. " * 20 + "a dog ran.", encoding="utf-8")
    export(root / "hf", root / "out", chunk=CHUNK, drafter="mtp", mtp_vocab=N_DRAFT, mtp_vocab_text=root / "text.txt")
    return root


def test_the_trimmed_head_keeps_the_texts_frequent_tokens_and_every_added_one(trimmed):
    from tokenizers import Tokenizer

    dr = MtpDrafter(trimmed / "out" / "mtp")
    ids = dr.draft_to_target.tolist()
    assert len(ids) == N_DRAFT and ids == sorted(set(ids))
    assert json.loads((trimmed / "out" / "mtp" / "drafter.json").read_text())["vocab"]["draft_vocab_size"] == N_DRAFT
    added = added_token_ids(trimmed / "hf" / "tokenizer.json")
    assert added and added <= set(ids)
    text_ids = Tokenizer.from_file(str(trimmed / "hf" / "tokenizer.json")).encode(
        (trimmed / "text.txt").read_text()).ids
    assert set(text_ids) <= set(ids)  # fewer distinct tokens than N_DRAFT: all of them kept


def test_the_trimmed_heads_logits_are_the_full_heads_at_its_tokens(trimmed):
    w, c = _weights(trimmed / "hf")
    dr = MtpDrafter(trimmed / "out" / "mtp")
    rng = np.random.default_rng(1)
    n = 9
    residuals = 2.0 * rng.standard_normal((n, c.hidden_size)).astype(np.float32)
    ids = [int(t) for t in rng.integers(0, 300, n)]
    want = _ref_sequence(w, c, residuals, ids)
    dr.observe(ids[:5], residuals[:5])
    _close(dr._logits, want["logits"][4][dr.draft_to_target])
    dr.observe(ids[5:], residuals[5:])
    _close(dr._logits, want["logits"][n - 1][dr.draft_to_target])


@pytest.mark.parametrize("shape", [{"top_k": 1, "depth": 4, "total_tokens": 4},
                                   {"top_k": 3, "depth": 3, "total_tokens": 12}], ids=["chain", "tree"])
def test_speculation_with_the_trimmed_head_is_lossless_and_drafts_only_its_tokens(trimmed, shape):
    engine = hybrid_npu.load_engine(trimmed / "out")
    keep = set(engine.drafter.draft_to_target.tolist())
    drafted = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda *a, **kw: drafted.extend(propose(*a, **kw)[0]) or propose(*a, **kw)
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, 2 * CHUNK + 3)]
    plain = engine.generate(prompt, 48, stop_at_eos=False, speculative=False)
    engine.adaptive, engine.draft_shape = False, shape
    assert engine.generate(prompt, 48, stop_at_eos=False) == plain
    assert engine.last_stats["rounds"] >= 8 and drafted and set(drafted) <= keep


@pytest.mark.parametrize("flags,problem", [
    (["--mtp-vocab", "8"], "add --drafter mtp"),
    (["--drafter", "mtp", "--mtp-vocab-text", "t.txt"], "add --mtp-vocab N"),
    (["--drafter", "mtp", "--mtp-vocab", "100000"], "between 2 and"),
    (["--drafter", "mtp", "--mtp-vocab", "64", "--mtp-vocab-text", "missing.txt"], "no such file"),
    (["--drafter", "mtp", "--mtp-vocab", "-3"], "or 0 to draft over the whole vocabulary"),
    (["--drafter", "mtp", "--mtp-vocab", "0", "--mtp-vocab-text", "t.txt"], "drop one of the two"),
])
def test_bad_mtp_vocab_flags_are_one_line(tmp_path, capsys, flags, problem):
    src = tmp_path / "hf"
    fixtures.write_release_checkpoint(src, seed=3, tie=True, with_mtp=True)
    flags = [str(tmp_path / f) if f.endswith(".txt") else f for f in flags]
    assert export_main([str(src), str(tmp_path / "out"), "--no-parity", "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and problem in err, err
    assert not (tmp_path / "out").exists()


def test_a_quantised_export_trims_its_quantised_head_too(trimmed, tmp_path):
    """int4 weights, no text (merge order): the head is the trimmed rows, block-quantised."""
    # the fp32 cache, as the other speculation-equals-plain checks of int4 exports: an int4 export can part
    # from plain decoding at near-ties when speculating (README, Limitations), and fp16 rows add ties
    export(trimmed / "hf", tmp_path / "out", chunk=CHUNK, drafter="mtp", mtp_vocab=N_DRAFT, weights="int4",
           block_size=16, kv_cache="fp32")
    engine = hybrid_npu.load_engine(tmp_path / "out")
    assert engine.drafter.draft_to_target.tolist()[: N_DRAFT // 2] == list(range(N_DRAFT // 2))
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 300, CHUNK + 5)]
    plain = engine.generate(prompt, 32, stop_at_eos=False, speculative=False)
    engine.adaptive, engine.draft_shape = False, {"top_k": 1, "depth": 3, "total_tokens": 3}
    assert engine.generate(prompt, 32, stop_at_eos=False) == plain
    assert engine.last_stats["rounds"] >= 6


def test_the_text_flags_read_their_file_or_say_in_one_line_what_is_wrong(tmp_path):
    """--mtp-vocab-text and --calibration share one reader (export/text_input.py)."""
    (tmp_path / "ok.txt").write_text("你好 hello\n", encoding="utf-8")
    assert read_text_input("--mtp-vocab-text", tmp_path / "ok.txt", "a text") == "你好 hello\n"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "blank.txt").write_text(" \n\t")
    (tmp_path / "a_dir").mkdir()
    for name, says in [("missing.txt", "no such file"), ("a_dir", "is not a file"), ("latin1.txt", "is not UTF-8"),
                       ("blank.txt", "is empty")]:
        with pytest.raises(UserError) as e:
            read_text_input("--mtp-vocab-text", tmp_path / name, "a text")
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and msg.startswith("--mtp-vocab-text") and says in msg, msg
