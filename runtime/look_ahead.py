"""The drafter running ahead of an NPU verify (docs/npu-verify.md): while the NPU verifies round r on a
worker thread, the CPU drafts a chain from round r's root past its most probable end, so round r+1's
draft is ready when round r accepted exactly that path. A look-ahead that does not continue where
round r ended is dropped. Only drafts are chosen here: every round is verified and accepted as any
other, so the output is the target's whatever the look-ahead drafted.

The drafter's lasting state changes only in observe (after the verify, with the target's own
features); a look-ahead is a propose like a round's, writing only the scratch rows past what the
drafter has observed, which the next observe and propose write again."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class LookAhead:
    position: int         # where the next round's root sits when this draft is kept
    root: int             # that root: the emitted token the chain had drafted there
    chain: tuple          # the next round's draft, a chain under root


def verify_beside(model, run, feed) -> Future:
    """The verify run on the model's verify thread (opened once; it ends with the model)."""
    return model.verify_worker().submit(run, feed)


def draft_ahead(drafter, root: int, depth: int, drafting: dict) -> list[int] | None:
    """A chain of `depth` levels under `root` (the drafter's most probable path), or None when the
    drafter fails: a look-ahead is an optimisation, never a reason to stop a reply."""
    try:
        tokens, parents = drafter.propose(root, top_k=1, depth=depth, total_tokens=depth, **drafting)
    except Exception:  # noqa: BLE001 - dropped, like a look-ahead that did not match
        return None
    chain = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if p != i - 1:  # the chain only: a drafter that grows siblings anyway
            break
        chain.append(int(t))
    return chain


def after_round(position: int, emitted: list[int], chain: list[int] | None) -> LookAhead | None:
    """What round r leaves for round r+1: the chain past round r's emitted tokens when they are its
    first tokens exactly (root at `position`), else nothing."""
    n = len(emitted)
    if not chain or len(chain) <= n or chain[:n] != list(emitted):
        return None
    return LookAhead(position + n, emitted[-1], tuple(chain[n:]))


def take(context, position: int, root: int, depth: int) -> list[int] | None:
    """The context's kept look-ahead's draft (its first `depth` tokens) when it continues exactly
    here; the look-ahead is spent either way."""
    ahead, context.ahead = context.ahead, None
    if ahead is None or ahead.position != position or ahead.root != root:
        return None
    return list(ahead.chain[:depth])
