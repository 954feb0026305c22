"""What the speculation policy knows, from the measurements it is given (never a clock): the cost of
a plain decode step, of a round (a fixed part per verify graph and a draft cost per level), of
switching between the two, and how the drafter's drafts are accepted (docs/speculation.md).

A cost is the median of its last `window` measurements (a plain step's: the fastest of them), and is
kept only when the step before was of the same kind in the same reply: the first step of a kind runs
with the other session's weights in the caches. Acceptance is two decayed rates: p, that a round's
first draft is accepted, and q, that a draft right after an accepted one is (drafters accept in runs)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from .settings import Settings


@dataclass
class Estimates:
    cfg: Settings = field(repr=False, compare=False)
    decode: deque = field(default_factory=deque)       # plain steps in a run of plain steps
    draft_level: deque = field(default_factory=deque)  # a round's drafting per level, in a run of rounds
    fixed: dict = field(default_factory=dict)          # verify key -> a round's costs besides the draft
    guess_cost: deque = field(default_factory=deque)   # the drafter's guess calls
    cold_plain: deque = field(default_factory=deque)   # a plain step's excess right after a round or guess call
    cold_round: deque = field(default_factory=deque)   # a round's excess over its steady cost after plain steps
    successes: float = 0.0       # decayed counts of p's trials: a round's first draft, or a guess
    failures: float = 0.0
    run_successes: float = 0.0   # ... of q's: a draft right after an accepted one
    run_failures: float = 0.0
    round_tokens: float = 0.0    # what rounds emitted and took, decayed as the counts are: their
    round_seconds: float = 0.0   # realised rate (schedule.py's wide margin)
    prior: tuple | None = None   # the last context's costs over its decode step: (draft level, {key: fixed})
    context: int | None = None   # the context length the costs were measured at
    last: str | None = None      # the kind of the step before: "plain" or "round"
    after_break: bool = False    # the next step is a reply's first (after a prefill): its cost is not kept
    after_other: bool = False    # the last call was a round or a guess call

    def _add(self, seen: deque, seconds: float) -> None:
        seen.append(seconds)
        while len(seen) > self.cfg.window:
            seen.popleft()

    # ------------------------------------------------------------ measurements
    def record_plain(self, seconds: float) -> None:
        if self.after_other and not self.after_break and self.decode_s is not None:
            self._add(self.cold_plain, max(seconds - self.decode_s, 0.0))
        if self.last == "plain" and not self.after_break:
            self._add(self.decode, seconds)
        self.count_plain()

    def count_plain(self) -> None:
        self.last, self.after_break, self.after_other = "plain", False, False

    def record_round(self, depth: int, accepted: int, draft_s: float, rest_s: float, key) -> None:
        """A round of `depth` drafts verified on graph `key` accepted `accepted` of them."""
        if self.last == "round" and not self.after_break:
            self._add(self.draft_level, draft_s / max(depth, 1))
            self._add(self.fixed.setdefault(key, deque()), rest_s)
        elif self.last == "plain" and not self.after_break and (steady := self.steady_round(depth, key)):
            self._add(self.cold_round, max(draft_s + rest_s - steady, 0.0))
        self.last, self.after_break, self.after_other = "round", False, True
        accepted, keep = min(accepted, depth), self.cfg.keep
        if not self.cfg.runs:  # one rate: every draft a trial of it
            self.successes = keep * self.successes + accepted
            self.failures = keep * self.failures + (accepted < depth)
        else:  # censored: one trial of p; after an accepted first draft, the rest are q's
            self.successes = keep * self.successes + (accepted > 0)
            self.failures = keep * self.failures + (accepted == 0)
            if accepted and depth > 1:
                self.run_successes = keep * self.run_successes + accepted - 1
                self.run_failures = keep * self.run_failures + (accepted < depth)
        self.round_tokens = keep * self.round_tokens + accepted + 1
        self.round_seconds = keep * self.round_seconds + draft_s + rest_s

    def record_guesses(self, hits) -> None:
        """The drafter's first guesses before tokens decoded plainly, each counted as a depth-1 round."""
        for hit in hits:
            self.successes = self.cfg.keep * self.successes + bool(hit)
            self.failures = self.cfg.keep * self.failures + (not hit)

    def record_guess_cost(self, seconds: float) -> None:
        self._add(self.guess_cost, seconds)
        self.after_other = True

    def note_context(self, tokens: int) -> bool:
        """A reply starts at a context of `tokens`; True when it is far from where the costs were
        measured: they are dropped (a step grows with the context) and kept as a prior in decode
        steps; with a guessing drafter p starts over (what it guesses first is the text's), and q
        stays as a light prior (how far its runs go is the drafter's)."""
        far = self.context is not None and abs(tokens - self.context) > max(512, self.context // 2)
        self.after_break = True
        if far:
            if self.decode_s is not None and self.draft_level_s is not None and self.fixed:
                self.prior = (self.draft_level_s / self.decode_s, {k: v / self.decode_s for k, v in self.fixed_s.items()})
            if self.cfg.guessing and self.prior is not None:
                self.successes = self.failures = 0.0
            weight = self.run_successes + self.run_failures
            if weight > self.cfg.run_prior_weight:  # q's value, at a prior's weight
                self.run_successes *= self.cfg.run_prior_weight / weight
                self.run_failures *= self.cfg.run_prior_weight / weight
            self.round_tokens = self.round_seconds = 0.0
            self.decode.clear()
            self.draft_level.clear()
            self.fixed.clear()
            self.last, self.context = None, tokens
        elif self.context is None:
            self.context = tokens
        return far

    # ------------------------------------------------------------ estimates
    @property
    def decode_s(self) -> float | None:
        """The fastest recent plain step: noise and the steps right after rounds only ever add time."""
        return min(self.decode) if self.decode else None

    @property
    def draft_level_s(self) -> float | None:
        return median(self.draft_level) if self.draft_level else None

    @property
    def fixed_s(self) -> dict:
        return {key: median(seen) for key, seen in self.fixed.items()}

    def acceptance(self) -> float:
        """p; 0.5 (no evidence either way) before any round."""
        n = self.successes + self.failures
        return 0.5 if n == 0 else self.successes / n

    def continuation(self, p: float | None = None) -> float:
        """q, with one pseudo-count of p (p itself with no evidence of its own)."""
        p = self.acceptance() if p is None else p
        return (self.run_successes + p) / (self.run_successes + self.run_failures + 1.0)

    def rates(self) -> tuple[float, float]:
        p = self.acceptance()
        return p, self.continuation(p)

    def expected_tokens(self, depth: int, rates: tuple[float, float] | None = None) -> float:
        """A chain of `depth` drafts emits 1 + p (1 + q + ... + q^(depth-1)) tokens, the bonus included
        (rates: (p, q) when the caller has them)."""
        p, q = self.rates() if rates is None else rates
        return 1.0 + p * (depth if q >= 1.0 else (1.0 - q ** depth) / (1.0 - q))

    def costs(self) -> tuple | None:
        """(draft cost per level, {verify key: fixed cost}, unit): measured here, unit 1; before they
        are (a guessing drafter at a far context), the last context's in decode steps, unit this
        context's decode step; None while neither is known."""
        if self.draft_level and self.fixed:
            return self.draft_level_s, self.fixed_s, 1.0
        if self.cfg.guessing and self.prior is not None and self.decode_s is not None:
            return (*self.prior, self.decode_s)
        return None

    def round_costs(self, costs: tuple, graphs: tuple) -> list:
        """Each depth's round cost in the costs' unit, by the verify graph it runs (`graphs`, one a
        depth): None where that graph's device has no measured verify. A size costs at most what the
        cheapest measured size at or above it costs (above all of them: the largest's)."""
        measured: dict = {}
        for key, v in sorted(costs[1].items(), key=lambda kv: -_size(kv[0])):  # largest first
            sizes = measured.setdefault(_device(key), [])
            sizes.append((_size(key), min(v, sizes[-1][1]) if sizes else v))  # the cheapest at or above
        rounds = []
        for depth, key in enumerate(graphs, 1):
            sizes, size = measured.get(_device(key)), _size(key)
            if not sizes:
                rounds.append(None)
                continue
            fixed = sizes[0][1]  # above every measured size: the largest one's
            for measured_size, cheapest in sizes:
                if measured_size < size:
                    break
                fixed = cheapest
            rounds.append(fixed + depth * costs[0])
        return rounds

    def round_cost(self, depth: int, graphs: tuple) -> float | None:
        costs = self.costs()
        c = None if costs is None else self.round_costs(costs, graphs)[depth - 1]
        return None if c is None else c * costs[2]

    def steady_round(self, depth: int, key) -> float | None:
        """A round's cost in a run of rounds here, on graph `key` (None until measured)."""
        if not self.draft_level or not self.fixed.get(key):
            return None
        return median(self.fixed[key]) + depth * self.draft_level_s

    def switch_cost(self) -> float:
        """What going into a round and out of it costs beyond steady steps (0: unknown or not charged)."""
        if not self.cfg.charge_switches:
            return 0.0
        return sum(median(seen) for seen in (self.cold_round, self.cold_plain) if seen)


def _device(key) -> object:
    """A verify graph key's device: (device, size) keys name one; a bare size is the only device."""
    return key[0] if isinstance(key, tuple) else None


def _size(key) -> int:
    return key[1] if isinstance(key, tuple) else key
