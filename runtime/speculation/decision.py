"""Depth or plain, given the estimates (estimates.py): the round whose expected tokens per second
are the highest, taken when it beats plain decoding's one token per decode step by the margin (and by
the hysteresis more to leave plain decoding: the first step of a kind runs with the other session's
weights in the caches, a cost neither estimate holds). Functions of their inputs only."""
from __future__ import annotations

import math

from .estimates import Estimates
from .settings import Settings


def best_depth(est: Estimates, graphs: tuple, costs: tuple | None = None, rounds: list | None = None
               ) -> tuple[int, float]:
    """(depth, tokens per second) of the best round by the estimates, each depth verifying on its
    graph in `graphs`; (0, 0.0) while a cost is unknown. costs, rounds: est.costs() and its
    round_costs, when the caller has them."""
    costs = est.costs() if costs is None else costs
    if costs is None:
        return 0, 0.0
    rounds = est.round_costs(costs, graphs) if rounds is None else rounds
    best, rates = (0, 0.0), est.rates()
    for d, c in enumerate(rounds, 1):
        if c is None:
            return 0, 0.0
        rate = est.expected_tokens(d, rates) / max(c, 1e-12)
        if rate > best[1]:
            best = (d, rate)
    return best[0], best[1] / costs[2]


def plan(est: Estimates, cfg: Settings, best: tuple[int, float]) -> int:
    """The depth the estimates favour (best: best_depth's answer), 0 when a plain step beats every
    round or its cost is unknown."""
    if est.decode_s is None:
        return 0
    depth, rate = best
    need = cfg.margin * (1 + cfg.hysteresis if est.last == "plain" else 1)
    return depth if depth > 0 and rate * est.decode_s > need else 0


def rounds_can_pay(est: Estimates, cfg: Settings, graphs: tuple, costs: tuple | None = None,
                   rounds: list | None = None) -> bool:
    """Whether the best round would beat plain decoding by the margin to leave it if every draft were
    accepted, by the costs measured here (or the last context's, in decode steps); True while unknown.
    While it would not, guesses and probes only cost time. costs, rounds: as best_depth's."""
    costs = est.costs() if costs is None else costs
    if costs is None and cfg.guessing and est.prior is not None:
        costs, rounds = (*est.prior, None), None  # before this context's first plain steps: the last one's
    if costs is None:
        return True
    if costs[2] is None:
        unit = 1.0
    elif est.decode_s is None:
        return True
    else:
        unit = est.decode_s / costs[2]  # the costs' unit in decode steps
    rounds = est.round_costs(costs, graphs) if rounds is None else rounds
    if None in rounds:
        return True
    best = max((d + 1) / max(c, 1e-12) for d, c in enumerate(rounds, 1))
    return best * unit > cfg.margin * (1 + cfg.hysteresis)


def measuring_depth(est: Estimates, cfg: Settings) -> int:
    """The depth of the rounds that measure the costs (at the start, at a far context): as deep as a
    draft still has an even chance by Laplace's rule (one accepted draft is not yet a drafter that is
    always right), 1 with no evidence."""
    p = (est.successes + 1.0) / (est.successes + est.failures + 2.0)
    q = est.continuation(p)
    if p < 0.5:
        return 1
    if q >= 1.0:
        return cfg.max_depth
    # the deepest d with p q^(d-1) >= 1/2
    return max(1, min(cfg.max_depth, 1 + int(math.log(0.5 / p) / math.log(q) + 1e-9)))
