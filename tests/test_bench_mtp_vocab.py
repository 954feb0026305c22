"""scripts/bench/bench_mtp_vocab.py emulates a trimmed MTP head on the embedded model's own: with its
logits outside the kept tokens masked, the head drafts only those, and speculation stays lossless."""


import hybrid_npu
from hybrid_npu.export.drafters.vocab import added_token_ids, choose_draft_vocab

from bench_mtp_vocab import masked  # noqa: E402


def test_the_masked_head_drafts_only_the_kept_tokens_and_is_lossless():
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), drafter="mtp")
    always = added_token_ids(hybrid_npu.default_model() / "tokenizer.json") | set(engine.config.eos_token_ids)
    keep = choose_draft_vocab(engine.config.vocab_size, 256, always)
    drafted, propose = [], engine.drafter.propose
    engine.drafter.propose = lambda *a, **kw: drafted.extend(propose(*a, **kw)[0]) or propose(*a, **kw)
    prompt = engine.tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False).ids
    plain = engine.generate(prompt, 40, stop_at_eos=False, speculative=False)
    engine.adaptive, engine.draft_shape = False, {"top_k": 1, "depth": 4, "total_tokens": 4}
    masked(engine.drafter, keep)
    assert engine.generate(prompt, 40, stop_at_eos=False) == plain
    assert drafted and set(drafted) <= set(keep.tolist())
    masked(engine.drafter, None)  # the whole vocabulary again
    drafted.clear()
    assert engine.generate(prompt, 40, stop_at_eos=False) == plain
    assert not set(drafted) <= set(keep.tolist())
