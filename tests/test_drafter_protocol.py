"""A drafter is whatever has reset/observe/propose (runtime/drafters/__init__.py Drafter); what else it can do
is found once, when the engine is given it, and an object that is no drafter is one line."""
import json

import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime.drafters import DrafterCaps


class Minimal:
    def reset(self): ...
    def observe(self, tokens, features): ...
    def propose(self, root, top_k, depth, total_tokens): return [], []


@pytest.fixture(scope="module")
def engine():
    return hybrid_npu.load_engine(hybrid_npu.DEFAULT_MODEL)


def test_the_exported_drafter_has_every_capability_and_its_own_taps(engine):
    taps = json.loads((hybrid_npu.DEFAULT_MODEL / "drafter" / "drafter.json").read_text())["taps"]["input_order"]
    assert engine.drafter_caps == DrafterCaps(rewinds=True, guesses=True, skips=True, picks=True,
                                              input_order=tuple(taps))


def test_a_minimal_drafter_has_none_and_a_swap_finds_them_again(engine):
    exported = engine.drafter
    try:
        engine.drafter = Minimal()
        assert engine.drafter_caps == DrafterCaps()
    finally:
        engine.drafter = exported
    assert engine.drafter_caps.rewinds


@pytest.mark.parametrize("obj", [object(), type("NoPropose", (), {"reset": lambda s: None,
                                                                 "observe": lambda s, t, f: None})()])
def test_an_object_that_is_no_drafter_is_one_line(obj):
    with pytest.raises(UserError, match="has no .*propose") as e:
        hybrid_npu.load_engine(hybrid_npu.DEFAULT_MODEL, drafter=obj)
    assert "\n" not in str(e.value)
