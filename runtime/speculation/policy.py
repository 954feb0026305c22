"""The speculation policy: its settings, what it has measured (estimates.py), the decision
(decision.py) and the schedule (schedule.py) together, behind the two calls a generation step makes:
step() before it (what to run) and after_plain() or record_round() after it (what it cost). It sees
only the numbers it is given, never a clock, so its decisions are deterministic given the costs."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import decision
from .estimates import Estimates
from .schedule import Schedule
from .settings import Settings


@dataclass(frozen=True)
class Step:
    depth: int            # the round's draft depth; 0: a plain step
    timed: bool = True    # a plain step: timed (after_plain(seconds)) or only counted (after_plain(None))
    guesses: int = 0      # a round: the drafter's guesses its catch-up scores (record_round(guesses=))


def _estimate(name: str) -> property:
    return property(lambda self: getattr(self.estimates, name), lambda self, v: setattr(self.estimates, name, v))


@dataclass
class SpecPolicy(Settings):
    estimates: Estimates = field(init=False, repr=False)
    schedule: Schedule = field(init=False, repr=False)
    decisions: deque = field(init=False, repr=False)  # recent depths chosen (0 = plain)

    def __post_init__(self):
        if self.max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        self.estimates, self.schedule = Estimates(self), Schedule(self)
        self.decisions = deque(maxlen=4096)

    successes, failures = _estimate("successes"), _estimate("failures")
    run_successes, run_failures = _estimate("run_successes"), _estimate("run_failures")

    # ------------------------------------------------------------ the generation loop's calls
    def start(self, tokens: int, fresh: bool) -> bool:
        """A reply starts at a context of `tokens` (fresh: a new text, not a continuation); whether a
        round could pay here (else the drafter need not be shown the prompt yet)."""
        self.note_context(tokens, fresh)
        return self.rounds_can_pay()

    def step(self, guessed: tuple | None = None) -> Step:
        """What the next step runs; guessed: (hits, seconds) of the guesses the last plain step's
        after_plain asked for, if any."""
        if guessed is not None:
            self.took_guesses(*guessed)
        depth = self.choose()
        if depth:
            return Step(depth, guesses=self.guesses_per_catch_up if self.guessing else 0)
        return Step(0, timed=self.times_plain())

    def after_plain(self, seconds: float | None, decoded: int) -> int:
        """A plain step took `seconds` (None: it was not timed, Step.timed); `decoded` plain steps
        wait for the drafter. Returns how many of its guesses to score now (0: none)."""
        if seconds is None:
            self.count_plain()
        else:
            self.record_plain(seconds)
        return self.guesses_per_catch_up if self.guesses_due(decoded) else 0

    def took_guesses(self, hits, seconds: float) -> None:
        """The guesses after_plain asked for: each a hit or not, and what their call took."""
        if len(hits):
            self.record_guesses(hits)
        self.record_guess_cost(seconds)

    # ------------------------------------------------------------ decisions
    def choose(self) -> int:
        """Depth of the next step's draft; 0 = a plain decode step."""
        self.schedule.fast_plain = False
        depth = self._choose()
        self.decisions.append(depth)
        return depth

    def _choose(self) -> int:
        est, schedule, graphs = self.estimates, self.schedule, self._graphs_now()
        measuring = decision.measuring_depth(est, self)
        depth = schedule.forced(est, measuring)
        if depth is not None:
            return depth
        costs = est.costs()  # the round costs, worked out once for the whole decision
        rounds = None if costs is None else est.round_costs(costs, graphs)
        best = decision.best_depth(est, graphs, costs, rounds)
        depth = decision.plan(est, self, best)
        if depth:
            return schedule.speculate(est, depth)
        can_pay = decision.rounds_can_pay(est, self, graphs, costs, rounds)
        return schedule.probe(est, best, costs, rounds, can_pay, measuring)

    def plan(self) -> int:
        return decision.plan(self.estimates, self, self.best_depth())

    def best_depth(self) -> tuple[int, float]:
        return decision.best_depth(self.estimates, self._graphs_now())

    def rounds_can_pay(self, graphs: tuple | None = None) -> bool:
        return decision.rounds_can_pay(self.estimates, self, self._graphs_now() if graphs is None else graphs)

    def measuring_depth(self) -> int:
        return decision.measuring_depth(self.estimates, self)

    def times_plain(self) -> bool:
        return self.schedule.times_plain()

    def guesses_due(self, decoded: int) -> bool:
        return self.schedule.guesses_due(self.estimates, decoded, self.rounds_can_pay)

    @property
    def guess_interval(self) -> int:
        return self.schedule.guess_interval

    # ------------------------------------------------------------ measurements
    def record_plain(self, seconds: float) -> None:
        self.estimates.record_plain(seconds)
        self.schedule.count_plain()

    def count_plain(self) -> None:
        """A plain step that was not timed (times_plain said so): the run's bookkeeping only."""
        self.estimates.count_plain()
        self.schedule.count_plain()

    def record_round(self, depth: int, accepted: int, draft_s: float, rest_s: float, verify=None,
                     guesses=()) -> None:
        """A round of `depth` drafts accepted `accepted` of them; draft_s its drafting, rest_s the rest
        (verify, commit, drafter observe); verify: the graph it ran (default: asked now); guesses: the
        hits its catch-up scored before it (Step.guesses)."""
        if len(guesses):
            self.record_guesses(guesses)
        key = self._graphs_now()[depth - 1] if verify is None else verify
        self.estimates.record_round(depth, accepted, draft_s, rest_s, key)
        self.schedule.count_round()

    def record_guesses(self, hits) -> None:
        self.estimates.record_guesses(hits)
        if len(hits):
            self.schedule.guesses_came(self.plan() > 0)

    def record_guess_cost(self, seconds: float) -> None:
        self.estimates.record_guess_cost(seconds)

    def note_context(self, tokens: int, fresh: bool = False) -> None:
        far = self.estimates.note_context(tokens)
        self.schedule.note_context(far, fresh, self.guessing and self.estimates.prior is not None)

    # ------------------------------------------------------------ the estimates, read
    @property
    def decode_s(self) -> float | None:
        return self.estimates.decode_s

    @property
    def draft_level_s(self) -> float | None:
        return self.estimates.draft_level_s

    @property
    def fixed_s(self) -> dict:
        return self.estimates.fixed_s

    def acceptance(self) -> float:
        return self.estimates.acceptance()

    def continuation(self, p: float | None = None) -> float:
        return self.estimates.continuation(p)

    def expected_tokens(self, depth: int) -> float:
        return self.estimates.expected_tokens(depth)

    def round_cost(self, depth: int) -> float | None:
        return self.estimates.round_cost(depth, self._graphs_now())

    def _graphs_now(self) -> tuple:
        """Each depth's verify graph (the engine's verify_graphs or verify_nodes; sizes 0 without)."""
        if self.verify_graphs is not None:
            return tuple(self.verify_graphs(self.max_depth))
        nodes = self.verify_nodes if callable(self.verify_nodes) else (lambda d: 0)
        return tuple(nodes(d) for d in range(1, self.max_depth + 1))
