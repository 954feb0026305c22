"""Generation after the prefill, as a generator of tokens: plain decode steps, or speculative
rounds (draft a tree, verify it in one pass, commit the accepted path) with plain steps between
them where the policy (speculation/) says a round does not pay. stream(model, context, ...) runs
one context of a model (runtime/model.py, runtime/context.py) and yields the tokens as they come
(as mlx-lm's stream_generate), then holds its Response; Engine.generate collects it into a list.

The output is the target's whatever the steps are (docs/speculation.md): a plain step emits the
sampler's choice from the target's logits, a round the target's argmax path (greedy) or the very
tokens plain sampling would choose (sampled: the choice is keyed by seed and position,
speculative.accept_sampled, docs/reproducibility.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Callable, Iterator

import numpy as np

from hybrid_npu.errors import UserError

from . import look_ahead
from .drafters import DrafterCaps
from .npu_sessions import NPU_DEVICE
from .pipeline import CPU_DEVICE
from .sampling import Sampler, check_sampling
from .speculation import SpecPolicy, Step
from .speculative import Tree, accept_greedy, accept_sampled, commit_beside, tree_feed

@dataclass(frozen=True)
class Response:
    """What a generation produced: the new tokens (ids) and their text, why it ended ("stop": end of
    turn; "length": max_new_tokens or the memory plan's limit, stats["context_full"] says which;
    "interrupted": should_stop), and its stats (where the prefill ran, rates, speculation counts)."""
    text: str
    ids: list[int]
    finish_reason: str
    stats: dict


class Stream:
    """The new tokens as they are decided; `response` once the iteration is done or closed. A
    speculative round commits several tokens at once: closing the stream inside a round keeps the
    round's tokens in the context (context.context_ids()) though they were not all yielded, and the
    response has them all."""

    def __init__(self, make_tokens: Callable[[list], Iterator[int]]):
        # the generator writes its Response into a list of its own, not into the Stream: a cycle
        # (stream -> generator -> stream) would keep a finished reply's frame, and the context it
        # reads, alive until Python's cyclic collector ran
        self._done: list[Response] = []
        self._tokens = make_tokens(self._done)

    @property
    def response(self) -> Response | None:
        return self._done[0] if self._done else None

    def __iter__(self) -> Iterator[int]:
        return self._tokens

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()


def stream(model, context, prompt_ids: list[int], sampler: Sampler | None = None, max_new_tokens: int = 256, *,
           stop_at_eos: bool = True, append: bool = False, speculative: bool | None = None,
           progress: Callable[[int, int], None] | None = None, should_stop: Callable[[], bool] | None = None,
           checkpoint_at=()) -> Stream:
    """Prefill `prompt_ids` into `context` (a fresh one unless append: then after what it holds),
    then yield each new token as it is decided; sampler: default the model's own
    (Sampler.from_defaults). speculative (default: on when the model has a drafter) drafts a token
    tree per round and verifies it in one pass; the output is exactly the plain output (greedy) or
    has exactly its distribution (sampled). should_stop (e.g. Ctrl-C) is asked between steps: a
    round always finishes, so the state stays at the last committed token. checkpoint_at: context
    positions inside this prefill at which to keep a turn checkpoint."""
    if context.model is not model:
        raise UserError("this context belongs to another model: make it with model.new_context()")
    check_sampling(max_new_tokens, None)
    sampler = sampler if sampler is not None else Sampler.from_defaults(model.sampling_defaults)
    speculative = model.drafter is not None if speculative is None else speculative
    if speculative and model.drafter is None:
        raise UserError("speculative=True needs a drafter: hybrid_npu.load(path, drafter=DIR)")
    if not append:
        context.reset()
    ids = context.pending + list(prompt_ids)  # the last reply's final token is not yet in the state
    context.check_fits(len(ids) + 1)  # the prompt and at least one new token
    return Stream(lambda out: _generate(model, context, ids, sampler, max_new_tokens, stop_at_eos, append,
                                        speculative, progress, should_stop, checkpoint_at, out))


def _generate(model, context, ids, sampler, max_new_tokens, stop_at_eos, append, speculative, progress,
              should_stop, checkpoint_at, done_into: list) -> Iterator[int]:
    pending, context.pending = context.pending, []
    t0 = time.perf_counter()
    context.own_drafter()
    try:
        logits = context.prefill(ids, progress, checkpoint_at)
    except UserError:  # refused before any work: the context is as it was
        context.pending = pending
        raise
    policy = policy_for(model, context) if speculative and model.adaptive else None
    # the prompt's last pairs, which the first round or guesses read (drafter_feed.py); not while no
    # round could pay here (they wait in the feed until one is tried)
    if speculative and (policy is None or policy.start(context.state.position, fresh=not append)):
        context.catch_up_drafter()
    limit = min(max_new_tokens, context.room())  # the memory plan bounds decode and speculation too
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    new = [sampler.choose(logits, context.state.position)]  # a token's position: the tokens before it
    stats = context.spec_stats = {"rounds": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0, "plain_steps": 0,
                                  "ahead_kept": 0, "ahead_dropped": 0, "plain_step_s": []}
    context.ahead = None  # a look-ahead never outlives its reply
    steps_s = stats["plain_step_s"]  # each plain step's decode and choice
    if model.drafter is not None and context.tap_pending is not None:
        context.drafter_feed.add([new[0]], context.tap_pending[None])
        context.tap_pending = None
    done = lambda: ((stop_at_eos and new[-1] in model.config.eos_token_ids) or len(new) >= limit  # noqa: E731
                    or (should_stop is not None and should_stop()))
    guessed = None  # (hits, seconds) of a plain step's guesses, told the policy with the next step
    try:
        yield new[0]
        while not done():
            # at most two calls into the policy a step: what to run, then what it cost
            step = (policy.step(guessed) if policy else Step(model.draft_shape["depth"])) if speculative else Step(0)
            guessed = None
            # near the plan's limit the last tokens decode plainly; so do those while the verify session
            # is still opening (a fresh model's first reply): waiting for it cost that reply ~3x
            if step.depth and round_fits(model, context) and model.pipelines.ready("verify"):
                emitted = speculative_round(model, context, new[-1], limit - len(new), stop_at_eos, sampler,
                                            step.depth, policy, step.guesses)
            elif speculative:
                emitted = [plain_step(model, context, new[-1], sampler)]
                k = policy.after_plain(steps_s[-1] if step.timed else None,
                                       context.drafter_feed.decoded) if policy is not None else 0
                if k:  # the drafter's guesses: acceptance without a round
                    t = time.perf_counter()
                    hits = context.catch_up_drafter(k)
                    guessed = (hits, time.perf_counter() - t)
            else:
                t = time.perf_counter()
                emitted = [sampler.choose(context.step("decode", [new[-1]]), context.state.position)]
                steps_s.append(time.perf_counter() - t)
            new.extend(emitted)  # in the context now, whether or not the caller takes them all
            yield from emitted
    finally:  # (the drafter is shown this reply's plain tokens when it is next needed: drafter_feed.py)
        t_decode = time.perf_counter() - t1
        if guessed is not None:  # the last step's guesses, had no step come after it
            policy.took_guesses(*guessed)
        context.pending = new[-1:]
        finish = _finish_reason(new, stop_at_eos, model.config.eos_token_ids, should_stop)
        s = {
            "prefill_tokens": len(ids), "prefill_tokens_per_s": len(ids) / max(t_prefill, 1e-9),
            "prefill_device": context.prefill_devices, "decode_tokens": len(new),
            "decode_tokens_per_s": max(len(new) - 1, 0) / max(t_decode, 1e-9), "decode_device": CPU_DEVICE,
            "ttft_s": t_prefill, "context_tokens": context.state.position + len(context.pending),
            "finish_reason": finish, "context_full": len(new) >= limit and limit < max_new_tokens,
            # a plain step's typical cost in this very reply: new tokens x this over the decode time is
            # the reply's rate against plain decoding measured at the same moments (bench_speculative)
            "plain_step_median_s": median(steps_s) if steps_s else None,
        }
        if speculative:
            s.update(rounds=stats["rounds"], plain_steps=stats["plain_steps"], draft_s=stats["draft_s"],
                     verify_s=stats["verify_s"], verify_device=stats.get("verify_device", CPU_DEVICE),
                     acceptance_length=(stats["accepted"] + stats["rounds"]) / max(stats["rounds"], 1),
                     ahead_kept=stats["ahead_kept"], ahead_dropped=stats["ahead_dropped"])
        text = model.tokenizer.decode(new) if model.tokenizer is not None else ""
        done_into.append(Response(text, list(new), finish, s))


def _finish_reason(new: list[int], stop_at_eos: bool, eos_ids, should_stop) -> str:
    """"stop": end of turn; "interrupted": should_stop (Ctrl-C); "length": max_new_tokens or the
    memory plan's context limit (last_stats["context_full"] says which)."""
    if stop_at_eos and new[-1] in eos_ids:
        return "stop"
    if should_stop is not None and should_stop():
        return "interrupted"
    return "length"


# ---------------------------------------------------------------- speculation
def policy_for(model, context) -> SpecPolicy:
    """The context's policy for the model's draft shape, kept from reply to reply and when the shape
    is switched away and back (its costs and acceptance still hold for that shape: a
    bench_speculative run that alternates a chain and a tree paid each repeat's measuring rounds
    again); shapes are kept apart (a tree's acceptance and verify sizes say nothing of a chain's: a
    top-4 tree's costs held chain rounds back); all new when model.make_policy was replaced."""
    if context.policy_maker is not model.make_policy:
        context.policies, context.policy_maker = {}, model.make_policy
    key = tuple(sorted(model.draft_shape.items()))
    policy = context.policies.get(key)
    if policy is None:
        policy = context.policies[key] = model.make_policy(context)
    policy.guessing = model.drafter_caps.guesses  # the drafter may be swapped
    return policy


def round_fits(model, context) -> bool:
    """A speculative round writes a whole tree's rows before it keeps the accepted path."""
    return context.state.position + model.manifest.verify.n <= context.max_context


def plain_step(model, context, token: int, sampler: Sampler) -> int:
    """One decode step inside a speculative generation, its time appended to plain_step_s: the
    drafter is shown it later, in one call before the next round or when the policy's guesses are
    due (Context.catch_up_drafter), not one call per plain token."""
    t0 = time.perf_counter()
    nxt = sampler.choose(context.step("decode", [token]), context.state.position)
    context.spec_stats["plain_step_s"].append(time.perf_counter() - t0)
    # its taps as the graph returned them (a slice: no index array), joined when the drafter takes them
    context.drafter_feed.add([nxt], model.tap_parts(context.last_out, slice(0, 1)), decoded=True)
    context.spec_stats["plain_steps"] += 1
    return nxt


def drafting_with(caps: DrafterCaps, sampler: Sampler, root_position: int) -> dict:
    """propose's `pick` for a sampled reply: the drafter picks each level's token by the sampler's own
    Gumbel-max noise for that position (Sampler.draft_choice), so its chain agrees with what the
    target will sample as often as the two distributions allow (docs/reproducibility.md). Empty
    for greedy replies and for drafters that take no `pick` (any object with propose)."""
    if sampler.greedy or not caps.picks:
        return {}
    return {"pick": lambda level, logits, ids: sampler.draft_choice(logits, root_position + level, ids)}


def speculative_round(model, context, root: int, room: int, stop_at_eos: bool, sampler: Sampler,
                      depth: int | None = None, policy: SpecPolicy | None = None, guesses: int = 0) -> list[int]:
    """Draft a tree of `depth` levels (default: the draft shape's) under `root`, verify it in one
    pass, commit the accepted path; returns the tokens it emits (accepted drafts + the target's bonus
    token), at most `room`. policy: told what the round cost and accepted, and the hits of the
    `guesses` its drafter's catch-up scored."""
    depth = model.draft_shape["depth"] if depth is None else depth
    device, n = verify = context.verify_graph(depth)  # the NPU's static graph while it fits T_max
    tc = time.perf_counter()
    hits = context.catch_up_drafter(guesses)
    t0 = time.perf_counter()
    state, drafter, stats = context.state, model.drafter, context.spec_stats
    drafting = drafting_with(model.drafter_caps, sampler, state.position)
    on_npu = device == NPU_DEVICE
    # the drafter runs ahead where the NPU verifies; on the CPU both would share the cores ("always":
    # there too, to measure and test the structure with the CPU standing in for the NPU)
    ahead = model.look_ahead == "always" or (on_npu and model.look_ahead == "npu")
    kept = look_ahead.take(context, state.position, root, depth) if ahead else None
    if kept:  # the previous round's look-ahead continues exactly here
        draft_tokens, draft_parents = kept, list(range(-1, len(kept) - 1))
        stats["ahead_kept"] = stats.get("ahead_kept", 0) + 1
    else:
        draft_tokens, draft_parents = drafter.propose(root, **dict(model.draft_shape, depth=depth), **drafting)
    tree, n_real = Tree.from_draft(root, draft_tokens, draft_parents, n)
    t1 = time.perf_counter()
    context.check_fits(n)
    t_max = model.profile.attention_capacity
    if on_npu and state.capacity != t_max:
        state.resize(t_max)  # the NPU graphs read exactly T_max rows; kept for the next rounds
    run, chain = model.pipelines["npu_verify" if on_npu else "verify"].run, None
    if ahead:  # the NPU verifies while the CPU drafts past the round's likeliest end
        pending = look_ahead.verify_beside(model, run, tree_feed(model.config, state, tree))
        chain = look_ahead.draft_ahead(drafter, root, depth + 1 + model.draft_shape["depth"], drafting)
        out = pending.result()
    else:
        out = run(tree_feed(model.config, state, tree))
    stats["verify_device"] = device
    if sampler.greedy:
        path, bonus = accept_greedy(out["logits"], tree, n_real)
    else:
        path, bonus = accept_sampled(out["logits"], tree, n_real, sampler, state.position)
    accepted_drafts = len(path) - 1
    emitted = [tree.tokens[j] for j in path[1:]] + [bonus]
    if stop_at_eos:  # nothing after an end-of-sequence token
        cut = next((i for i, t in enumerate(emitted) if t in model.config.eos_token_ids), None)
        emitted = emitted if cut is None else emitted[: cut + 1]
    emitted = emitted[:room]
    path = path[: len(emitted)]  # the root and the drafts before the last emitted token
    if ahead:  # (a failed look-ahead, chain None, is dropped too)
        context.ahead = look_ahead.after_round(state.position, emitted, chain)
        if context.ahead is None:
            stats["ahead_dropped"] = stats.get("ahead_dropped", 0) + 1
    commit_beside(context.commit_worker(), state, out, tree, path, model.config.linear_conv_kernel_dim,
                  lambda: drafter.observe(emitted, model.taps(out, np.array(path))))
    t2 = time.perf_counter()
    if policy is not None:  # what the target accepted, before any cut (room, end of sequence)
        policy.record_round(depth, accepted_drafts, t1 - t0, t2 - t1, verify, hits)
    stats["rounds"] += 1
    stats["accepted"] += len(path) - 1
    stats["draft_s"] += t1 - tc
    stats["verify_s"] += t2 - t1
    return emitted
