"""A loaded model and its contexts: several conversations on one model, interleaved, each give
exactly what that conversation gives alone on a model of its own (speculating with the shared
drafter, which starts over for whichever context it comes back to); the memory plan covers them
together; a stream ends with its Response."""
import gc

import pytest

import hybrid_npu
from hybrid_npu.errors import UserError

PROMPTS = ([5, 17, 99, 3, 41, 8, 250, 12], [7, 7, 30, 200, 64, 9])


def alone(prompt, turns, n):
    """The reference: one conversation on a freshly loaded model, turn after turn."""
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1)
    out = [engine.generate(prompt, n, stop_at_eos=False)]
    for turn in turns:
        out.append(engine.generate(turn, n, stop_at_eos=False, append=True))
    return out


def test_interleaved_contexts_on_one_model_each_give_their_own_conversation():
    model = hybrid_npu.load(hybrid_npu.default_model(), threads=1)
    assert model.drafter is not None  # the rounds draft with the one drafter both contexts share
    a, b = model.new_context(), model.new_context()
    turns = [[11, 12, 13], [40, 2]]
    got = {0: [], 1: []}
    for step in range(3):  # a turn of a, then of b, then a again: the drafter changes hands each time
        for i, context in enumerate((a, b)):
            ids = PROMPTS[i] if step == 0 else turns[step - 1]
            tokens = hybrid_npu.stream(model, context, ids, 24, stop_at_eos=False, append=step > 0)
            yielded = list(tokens)
            r = tokens.response
            assert r.ids == yielded and r.text == model.tokenizer.decode(yielded) and r.finish_reason == "length"
            got[i].append(yielded)
    assert got[0] == alone(PROMPTS[0], turns, 24)
    assert got[1] == alone(PROMPTS[1], turns, 24)
    assert a.context_ids()[: len(PROMPTS[0])] == PROMPTS[0] and b.context_ids()[: len(PROMPTS[1])] == PROMPTS[1]


def test_the_memory_plan_covers_every_context_of_a_model():
    probe = hybrid_npu.load(hybrid_npu.default_model(), threads=1)
    m = probe.memory
    # room for one context's fixed state (GDN state, checkpoint copies) and 64 tokens, not two
    model = hybrid_npu.load(hybrid_npu.default_model(), threads=1,
                            memory=m.weights_bytes + m.state_bytes + m.checkpoint_bytes + 64 * m.kv_bytes_per_token)
    first = model.new_context()
    with pytest.raises(UserError, match="holds no more contexts"):
        model.new_context()
    del first
    gc.collect()
    second = model.new_context()  # the first's memory is back
    assert second.max_context == 64


def test_a_context_runs_only_on_its_own_model():
    model = hybrid_npu.load(hybrid_npu.default_model(), threads=1)
    other = hybrid_npu.load(hybrid_npu.default_model(), threads=1)
    with pytest.raises(UserError, match="another model"):
        hybrid_npu.stream(model, other.new_context(), [5, 6, 7], 4)
