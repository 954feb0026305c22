"""Engine.pipelines opens a graph's session on first use, or ahead of it in the background
(prefetch: the verify session of an engine with a drafter)."""
import threading

import pytest

from hybrid_npu.errors import UserError
from hybrid_npu.runtime.lazy_pipelines import LazyPipelines


def opener(log, gate=None, fail=None):
    def open_one(name):
        if gate is not None:
            gate.wait(5)
        log.append((name, threading.current_thread().name))
        if name == fail:
            raise UserError(f"{name}: damaged")
        return f"pipeline:{name}"
    return open_one


def test_a_prefetched_graph_opens_once_in_the_background_and_its_lookup_waits_for_it():
    log, gate = [], threading.Event()
    pipes = LazyPipelines(opener(log, gate), ["decode", "verify"], eager=())
    pipes.prefetch("verify")
    pipes.prefetch("verify")  # already on its way: no second session
    assert "verify" not in pipes  # not used yet: a test of "no verify session unless used" still holds
    gate.set()
    assert pipes["verify"] == "pipeline:verify" and pipes["verify"] == "pipeline:verify"
    assert log == [("verify", "open-verify_0")]
    assert pipes["decode"] == "pipeline:decode" and log[-1] == ("decode", threading.current_thread().name)


def test_a_prefetch_that_fails_raises_at_the_lookup_and_unknown_names_stay_unknown():
    pipes = LazyPipelines(opener([], fail="verify"), ["verify"], eager=())
    pipes.prefetch("verify")
    pipes.prefetch("npu_verify")  # not a graph of this export: nothing starts
    with pytest.raises(UserError, match="verify: damaged"):
        pipes["verify"]
    with pytest.raises(KeyError):
        pipes["npu_verify"]


def test_a_process_that_exits_right_after_loading_exits_cleanly():
    """The embedded model has a drafter, so its verify session is still being built when this
    process exits at once (a CLI refusing its input does): exit status 0, not a crash."""
    import subprocess
    import sys

    code = "import hybrid_npu; hybrid_npu.load_engine(hybrid_npu.default_model())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-400:]
