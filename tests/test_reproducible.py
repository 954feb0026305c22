"""A seed pins a sampled reply (docs/reproducibility.md): the token at each position is the
Gumbel-max of the target's filtered distribution under noise keyed by (seed, position), so a reply
is the same run after run, whether it speculates (adaptively, every round, under any policy's
decisions, with either drafter, chain or tree) or not, in this process or a fresh one."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hybrid_npu
from hybrid_npu.runtime.sampling import filtered_probs
from hybrid_npu.runtime.speculative import TREE_SHAPE
from random_policy import RandomPolicy

PROMPT = "<|im_start|>user\nWrite a Python function that does this: Parse a header line.<|im_end|>\n<|im_start|>assistant\n"
SETTINGS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
NEW = 24
RUNS = 20


@pytest.fixture(scope="module")
def engines():
    return {kind: hybrid_npu.load_engine(hybrid_npu.DEFAULT_MODEL, drafter=kind) for kind in ("eagle3", "mtp")}


def reference_reply(engine, ids, n, seed, temperature, top_k, top_p):
    """Plain sampling as docs/reproducibility.md defines it, written out here: at position t (tokens
    before it), argmax(log p + G) with G = -log(-log(1 - U)), U from Philox keyed by
    SeedSequence([seed, t])."""
    logits, position, out = engine.prefill_logits(ids), len(ids), []
    while len(out) < n:
        p = filtered_probs(logits, temperature, top_k, top_p)
        u = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, position]))).random(p.size)
        with np.errstate(divide="ignore"):
            out.append(int(np.argmax(np.log(p) - np.log(-np.log1p(-u)))))
        position += 1
        logits = engine.decode(out[-1])
    return out


def run_mode(engine, mode, run, ids, seed):
    default_policy, default_shape = engine.make_policy, dict(engine.draft_shape)
    try:
        engine.adaptive = mode in ("adaptive", "random policy")
        if mode == "random policy":
            engine.make_policy = lambda e: RandomPolicy(run, e.draft_shape["depth"])
        if mode == "tree":
            n = engine.manifest.verify.n
            engine.draft_shape = dict(TREE_SHAPE, depth=4, total_tokens=n - 1)
        reply = engine.generate(ids, NEW, seed=seed, stop_at_eos=False, speculative=mode != "plain", **SETTINGS)
        return reply, (engine.last_stats.get("rounds", 0) if mode != "plain" else 0)
    finally:
        engine.make_policy, engine.draft_shape, engine.adaptive = default_policy, default_shape, True


def test_twenty_runs_with_one_seed_give_the_reference_reply_in_every_mode(engines):
    engine = engines["eagle3"]
    ids = engine.tokenizer.encode(PROMPT).ids
    want = reference_reply(engine, ids, NEW, 1, **SETTINGS)
    modes = [("eagle3", "plain"), ("eagle3", "adaptive"), ("eagle3", "every round"), ("eagle3", "random policy"),
             ("eagle3", "tree"), ("mtp", "adaptive"), ("mtp", "every round")]
    for kind, mode in modes:
        replies, rounds = set(), 0
        for run in range(RUNS):
            reply, r = run_mode(engines[kind], mode, run, ids, seed=1)
            replies.add(tuple(reply))
            rounds += r
        assert replies == {tuple(want)}, f"{kind} {mode}"
        assert mode in ("plain", "adaptive") or rounds > 0, f"{kind} {mode}: no round ran"


def test_another_seed_or_position_gives_another_reply(engines):
    """The noise is keyed: another seed changes the reply; so does the same prompt at another
    position in the context (a second turn does not repeat the first's draws)."""
    engine = engines["eagle3"]
    ids = engine.tokenizer.encode(PROMPT).ids
    a = engine.generate(ids, NEW, seed=1, stop_at_eos=False, **SETTINGS)
    assert engine.generate(ids, NEW, seed=2, stop_at_eos=False, **SETTINGS) != a
    assert engine.generate([ids[0]] + ids, NEW, seed=1, stop_at_eos=False, **SETTINGS) != a


def npu_chat_json(*flags, env=None):
    out = subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", "--prompt",
                          "Write a Python function that does this: Parse a header line.", "--json",
                          "--temperature", "0.8", "--seed", "1", "--max-new-tokens", "40", *flags],
                         capture_output=True, env=env or os.environ.copy(), timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return json.loads(out.stdout.decode("utf-8"))


def test_npu_chat_with_a_seed_repeats_its_reply_in_fresh_processes_speculating_or_not():
    first = npu_chat_json()
    assert first["stats"].get("rounds", 0) > 0 or first["stats"].get("plain_steps", 0) > 0
    assert npu_chat_json()["token_ids"] == first["token_ids"]
    assert npu_chat_json("--no-speculative")["token_ids"] == first["token_ids"]
