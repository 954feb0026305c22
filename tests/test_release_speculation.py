"""Speculation in a real chat: the released vocabulary (248,320 tokens) and chat template, and the
checkpoint's own MTP head as the drafter, trimmed to 32k tokens counted over a sample text (the
recommended export at real size), as a user of a released Qwen3.5 runs it.

The release template drops earlier replies' <think> blocks, so from the second turn on the context
is cut back to a turn checkpoint and the drafter is rewound with it. Each speculative reply must
be the plain one (the target's own greedy output), and after every turn the drafter must draft
exactly as a fresh one shown the conversation as it now stands: a drafter left out of step would
only lose acceptance, never the output, so the output alone cannot catch it."""
import numpy as np
import pytest

import fixtures
import hybrid_npu
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling
from hybrid_npu.runtime.drafters.mtp import MtpDrafter

from conftest import CHUNK
from qwen35_release import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, write_release_tokenizer

TURNS = ["Hello, who are you?", "Tell me more about that.", "And then?"]
SHAPES = {"chain": {"top_k": 1, "depth": 3, "total_tokens": 3},
          "tree": {"top_k": 3, "depth": 3, "total_tokens": 10}}


@pytest.fixture(scope="module")
def release_mtp(release, tmp_path_factory):
    """The released layout with its mtp.* layer, the released vocabulary and tokenizer files, exported
    with --drafter mtp."""
    root = tmp_path_factory.mktemp("release_mtp")
    fixtures.write_release_checkpoint(root / "hf", seed=12, tie=True, with_mtp=True, vocab_size=VOCAB_SIZE,
                                      bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID,
                                      pad_token_id=ENDOFTEXT_ID)
    write_release_tokenizer(root / "hf", release.cache)
    sample = root / "sample.txt"  # the recommended trim: 32k tokens counted over text like the user's
    sample.write_text("Hello! I am a helpful assistant. Tell me more about that, and then? Thanks. " * 50 +
                      "你好，我是一个有用的助手。生活的真谛是什么？", encoding="utf-8")
    export(root / "hf", root / "out", chunk=CHUNK, drafter="mtp", mtp_vocab=32768, mtp_vocab_text=sample)
    return root / "out"


def drafts_of(engine, depth: int = 4) -> tuple[list[int], np.ndarray]:
    """What the engine's drafter would draft now under the pending token: a depth-`depth` chain and
    its first level's logits, after it is shown the pairs still waiting in the feed."""
    engine.catch_up_drafter()
    tokens, _ = engine.drafter.propose(engine.pending[-1], top_k=1, depth=depth, total_tokens=depth)
    return tokens, np.array(engine.drafter._logits)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_speculative_chat_turns_are_the_plain_ones_and_the_drafter_keeps_step(release_mtp, shape):
    spec_engine, plain_engine = hybrid_npu.load_engine(release_mtp), hybrid_npu.load_engine(release_mtp)
    assert isinstance(spec_engine.drafter, MtpDrafter)
    # the head drafts 32,768 tokens: the chat's added ones, the sample's (Chinese ones included, which
    # id order would have cut: they lie above 95,000), then the lowest ids
    kept = set(spec_engine.drafter.draft_to_target.tolist())
    chinese = spec_engine.tokenizer.encode("你好", add_special_tokens=False).ids
    assert len(kept) == 32768 and {IM_END_ID, ENDOFTEXT_ID} <= kept and min(chinese) > 95000
    assert set(chinese) <= kept
    assert spec_engine.tokenizer.token_to_id("<|im_end|>") == IM_END_ID  # the released tokenizer
    spec_engine.adaptive, spec_engine.draft_shape = False, SHAPES[shape]  # every step a round of this shape
    spec, plain = Conversation(spec_engine, enable_thinking=True), Conversation(plain_engine, enable_thinking=True)
    rewound = False
    for n, user in enumerate(TURNS):
        context = spec_engine.context_ids()
        got = spec.reply(user, Sampling(max_new_tokens=16, speculative=True, stop_at_eos=False))
        want = plain.reply(user, Sampling(max_new_tokens=16, speculative=False, stop_at_eos=False))
        assert got.token_ids == want.token_ids, f"turn {n + 1}"
        assert got.reused_tokens == want.reused_tokens
        assert got.stats["rounds"] >= 3, got.stats
        rewound |= 0 < got.reused_tokens < len(context)  # cut back to a checkpoint, not only appended to
        # a fresh engine shown the whole conversation at once: its drafter drafts the same
        fresh = hybrid_npu.load_engine(release_mtp)
        ids = spec_engine.context_ids()
        fresh.prefill(ids[:-1])  # (the last token's feature waits for the token after it, as after a reply)
        fresh.drafter_feed.add(ids[-1:], fresh.tap_pending[None])
        fresh.pending, fresh.tap_pending = ids[-1:], None
        tokens, logits = drafts_of(spec_engine)
        fresh_tokens, fresh_logits = drafts_of(fresh)
        assert spec_engine.drafter.length == fresh.drafter.length == len(ids) - 1
        np.testing.assert_allclose(logits, fresh_logits, rtol=1e-4, atol=1e-4)
        assert tokens == fresh_tokens, f"turn {n + 1}"
    assert rewound, "no turn resumed from a checkpoint: the test did not exercise the drafter's rewind"
