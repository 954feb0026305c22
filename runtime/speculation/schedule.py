"""When the speculation policy measures rather than decides: the measuring rounds at the start and
at a far context, probes (two rounds) while plain decoding wins, refreshes of the decode cost (a few
plain steps) while rounds win, and when the drafter's guesses are scored. Each interval doubles while
its answer stays the same and is bounded by a budget, a share of the plain decoding between two of
them (docs/speculation.md). Reads the estimates, never changes them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

from .estimates import Estimates
from .settings import Settings


@dataclass
class Schedule:
    cfg: Settings = field(repr=False, compare=False)
    plain_run: int = 0          # plain steps since the last round
    spec_run: int = 0           # rounds since the last plain step
    probe_interval: int = 0     # plain steps before the next probe
    refresh_interval: int = 2   # rounds before the next refresh
    refreshing: bool = False    # a refresh's plain steps are running
    probe_depth: int = 0        # the depth of a probe's second round, still to come
    guess_interval: int = 0     # plain steps before the guesses are next scored
    await_guesses: bool = False  # at a far context: plain steps until the guesses judge rounds
    guessed: bool = False       # guesses scored since the last round
    fast_plain: bool = False    # the last decision was plain where no round could pay

    def __post_init__(self):
        self.probe_interval, self.guess_interval = self.cfg.probe_every, self.cfg.guess_every

    def forced(self, est: Estimates, measuring: int) -> int | None:
        """The depth the schedule sets this step (0: plain), None where the decision is to be asked:
        plain while awaiting guesses at a far context, a measuring round (of depth `measuring`) while
        the costs are unknown, plain while the decode cost is unknown or refreshed, a probe's second
        round (the one whose cost is kept)."""
        cfg = self.cfg
        if self.await_guesses and self.plain_run < 2 * cfg.guess_every:  # (no guesses came: measure)
            return 0
        self.await_guesses = False
        if est.costs() is None and not (cfg.guessing and est.prior is not None):
            return measuring
        if est.decode_s is None or self.refreshing:
            self.refreshing = self.refreshing and self.plain_run < cfg.refresh_steps - 1
            return 0
        if self.probe_depth:
            depth, self.probe_depth = self.probe_depth, 0
            return depth
        return None

    def speculate(self, est: Estimates, depth: int) -> int:
        """Rounds win at `depth`: that depth, or 0 where a refresh of the decode cost is due (after 2, 4,
        ... rounds up to refresh_every; up to max_refresh_every while the rounds' realised rate beats
        plain decoding by wide_margin, where a stale decode cost cannot flip the decision)."""
        cfg = self.cfg
        self.probe_interval = cfg.probe_every
        wide = est.round_tokens >= cfg.wide_margin * est.round_seconds / est.decode_s
        due = self.refresh_interval if wide else min(self.refresh_interval, cfg.refresh_every)
        if self.spec_run >= due:
            self.refresh_interval = min(2 * due, cfg.max_refresh_every if wide else cfg.refresh_every)
            self.refreshing = True
            return 0
        return depth

    def probe(self, est: Estimates, best: tuple[int, float], costs: tuple | None, rounds: list | None, can_pay: bool,
              measuring: int) -> int:
        """Plain decoding wins: a probe's first round (of the best depth) where one is worth it and due
        (probe_every, doubling while probes lose, and within probe_budget), else 0. Worth it: where no
        round could pay, only after max_budget_interval plain steps; where guesses came, only if they
        leave rounds within guess_near of paying; else where guesses are not coming."""
        cfg = self.cfg
        if not can_pay:
            worth = self.plain_run >= cfg.max_budget_interval
            self.fast_plain = not worth
        elif self.guessed:
            worth = best[1] * est.decode_s >= cfg.guess_near * cfg.margin
        else:
            worth = not cfg.guessing or self.plain_run >= 2 * cfg.guess_every
        if worth and self.plain_run >= self.probe_interval and self.plain_run >= self.budget_interval(est, best, costs, rounds):
            self.probe_interval = min(2 * self.probe_interval, cfg.max_probe_every)
            self.probe_depth = best[0] or measuring
            return self.probe_depth
        return 0

    def budget_interval(self, est: Estimates, best: tuple[int, float], costs: tuple | None, rounds: list | None) -> int:
        """Plain steps a probe waits for so that its expected extra time (two rounds of the best depth
        less the tokens they emit at a plain step's cost, and the cold steps into it and out of it)
        stays within probe_budget of the plain decoding between probes."""
        cfg, t_dec = self.cfg, est.decode_s
        if t_dec is None or cfg.probe_budget <= 0:
            return 0
        d = best[0] or cfg.max_depth
        if rounds is None or rounds[d - 1] is None:  # (costs, rounds: est.costs() and its round_costs)
            return 0
        cost = rounds[d - 1] * costs[2]
        extra = 2 * max(cost - est.expected_tokens(d) * t_dec, 0.0)
        extra += est.switch_cost()
        return min(cfg.max_budget_interval, math.ceil(extra / (cfg.probe_budget * t_dec)))

    def times_plain(self) -> bool:
        """Whether the next plain step is timed: all are but where no round could pay, one in
        plain_sample_every (enough for the decode cost to follow the context)."""
        return not self.fast_plain or self.plain_run % self.cfg.plain_sample_every == 0

    def count_plain(self) -> None:
        self.plain_run += 1
        self.spec_run = 0

    def count_round(self) -> None:
        self.guessed, self.guess_interval = False, self.cfg.guess_every
        self.spec_run += 1
        self.plain_run = 0

    def guesses_due(self, est: Estimates, decoded: int, can_pay) -> bool:
        """Whether the guesses are scored now, `decoded` plain steps after the last: their interval has
        passed, a round could pay (can_pay(), asked only then) and the plain steps since the last pay
        for a guess call within guess_budget; else they are asked again later."""
        cfg = self.cfg
        if not cfg.guessing or decoded < self.guess_interval:
            return False
        if not can_pay():
            self.guess_interval = decoded + cfg.guess_every
            return False
        afford = 0
        if est.decode_s is not None and est.guess_cost and cfg.guess_budget > 0:
            afford = math.ceil(median(est.guess_cost) / (cfg.guess_budget * est.decode_s))
        if decoded < afford:
            self.guess_interval = afford
            return False
        return True

    def guesses_came(self, rounds_win: bool) -> None:
        """Guesses were scored: no waiting for them, and asked less often while they say plain."""
        self.guessed, self.await_guesses = True, False
        cfg = self.cfg
        self.guess_interval = cfg.guess_every if rounds_win else min(2 * self.guess_interval, cfg.max_guess_every)

    def note_context(self, far: bool, fresh: bool, await_guesses: bool) -> None:
        """A reply starts: at a new context or text the guesses are asked soon; at a far one the
        schedule starts over (awaiting the guesses where they will judge rounds)."""
        if far or fresh:
            self.guess_interval = self.cfg.guess_every
        if far:
            self.await_guesses = await_guesses
            self.plain_run, self.refreshing, self.probe_depth = 0, False, 0
            self.probe_interval, self.refresh_interval = self.cfg.probe_every, 2
