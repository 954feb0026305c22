"""When to speculate, and how deep: decided per step from what the rounds so far measured.

Speculation pays only when a round's expected tokens per second beat plain decoding's. The policy
keeps running estimates of
  - the cost of a plain decode step, t_dec,
  - the cost of a round: a fixed part (verify, commit, observe) per verify size and a draft cost
    per level, and
  - how the drafter's drafts are accepted, as two rates: p, that a round's first draft is, and q,
    that a draft right after an accepted one is (a chain of depth d then emits
    E(d) = 1 + p (1 + q + ... + q^(d-1)) tokens, the bonus included; with q = p the geometric
    1 + a + ... + a^d of a single rate).
Each cost is the median of its last `window` measurements: robust to what a shared machine does
(a call now and then several times slower) and to a session's slow first call, without the
optimism of a running minimum. Measured on the embedded model: a plain average let one slow first
decode step hold speculation on for a whole reply; a fast-down/slow-up average (a near-minimum)
rated the noisier rounds too cheap and speculated where plain decoding was faster.
For each depth d it compares E(d) / cost(d) with 1 / t_dec and picks the best depth, or a plain
step when no depth wins. Each rate is counted with censoring: a round of depth d that accepted A
drafts saw, for p, one success (A > 0) or one failure, and for q, A - 1 successes and, when
0 < A < d, one failure. Two rates because a drafter's acceptance comes in runs: one rate read off
the drafter's guesses (depth-1 drafts, they measure p only) said 0.6-0.75 a token where the same
drafter's 14-deep chains accepted 8-10 drafts, and after a long document the policy decoded
plainly where rounds ran 1.44x plain (embedded model, Zen 3, docs/speculation.md). q has a
pseudo-count of p (with no evidence of its own it is p) and, unlike p, is kept across contexts: how
long a drafter's runs are is the drafter's, what it guesses first is the text's.

A cost is kept only when the step before was of the same kind, in the same reply: the first plain
step after rounds (and the first round after plain steps) runs with the other session's weights in
the caches and costs more than in a run of its kind; kept, it made plain decoding look slower than
it is and the policy speculated where plain was faster (measured, embedded model after 500 tokens:
0.61x). So the first rounds and a refresh of t_dec are two steps, the second one measured. A
reply's first step runs after its prefill: not kept either (note_context).

Plain steps teach the policy nothing about acceptance, so while decoding plainly it probes: two
rounds after `probe_every` plain steps, the interval doubling (up to `max_probe_every`) each time
the probe loses and reset when speculation wins again, and never sooner than the probe's expected
extra time allows within `probe_budget` (5%) of the plain decoding since the last one. Two, so that the probe measures the
round's cost again too (the second is kept): with one-round probes a round cost measured high
once (a load spike) was never measured again and held plain decoding on for whole replies
(measured on the embedded model, top-4 tree: 93 rounds and 778 plain steps over 16 chat prompts,
where speculating every step ran 2.1x plain). While speculating, a plain step after 2,
then 4, 8, ... up to `refresh_every` rounds keeps t_dec current (soon at first: one early
measurement is not yet to be trusted), up to `max_refresh_every` while rounds beat plain decoding by
`wide_margin` (a stale t_dec cannot flip that decision). The output never depends on these choices: a plain
step and a verified round both emit the target's own tokens (greedy) or its own distribution
(sampled, each decided before the step from the past only).

A drafter that can score its guesses (runtime/eagle3.py: its first-level guess before each token
the target decoded plainly, computed in the catch-up observe it makes anyway) gives acceptance
evidence without any round (record_guesses; asked every guess_every plain steps, less often while
they say plain, and never more often than their measured cost allows within guess_budget of the
plain decoding between them): while guesses come, plain decoding runs no probes unless the guesses leave
rounds within guess_near of paying (a guess is a depth-1 draft, and a drafter's acceptance comes
in runs, so the guesses read low: 0.69 a token where rounds accepted 0.87), and at a far context
a reply starts plainly, measuring rounds only if the guesses, at the last context's costs
relative to a decode step, say a round would pay. Measured on the embedded model
after 1.5k-12k tokens, where its drafter accepts 1-2 tokens a round: two measuring rounds and the
probes had cost 4-10% of a 96-token reply (docs/speculation.md).

The policy sees only numbers it is given (record_plain, record_round, record_guesses), never a
clock, so its decisions are deterministic given the costs (tests feed fake ones).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median


@dataclass
class SpecPolicy:
    max_depth: int
    verify_nodes: object = None          # depth -> the verify graph a round runs now: its size, or (device,
    #                                       size) when rounds may verify on more than one device
    verify_graphs: object = None         # max depth -> every depth's verify_nodes answer at once (one call
    #                                       a step instead of one per depth; the engine keeps them)
    window: int = 8                       # measurements each cost's median is taken over
    keep: float = 0.875                   # per round, how much of the old acceptance evidence stays
    probe_every: int = 8
    max_probe_every: int = 64
    probe_budget: float = 0.05            # while plain wins, probes may cost at most this share of the time
    max_budget_interval: int = 1024
    refresh_every: int = 16
    refresh_steps: int = 4                # plain steps a refresh of the decode cost runs (the last is near steady)
    wide_margin: float = 1.5              # rounds emitting this far ahead of plain decoding refresh its cost only every
    max_refresh_every: int = 64           # ... up to this many rounds: a decode cost off by less than the margin
    #                                       cannot turn them into a loss, and each refresh (4 plain steps, then a
    #                                       cold round) cost the embedded model's chat ~2%
    margin: float = 1.0                   # speculate when its rate beats plain by this factor
    hysteresis: float = 0.2               # ... and by (1 + this) more to switch from plain decoding
    guessing: bool = False                # the drafter scores its guesses (record_guesses; set by the engine)
    guess_every: int = 32                 # plain steps between the drafter's guesses being scored (each a drafter call:
    #                                       ~1.5 ms on the embedded model, whatever the count)
    guesses_per_catch_up: int = 8         # the last this many of them scored (keep^8 = 0.34: older ones weigh little)
    max_guess_every: int = 256            # ... the interval doubling up to this while the guesses say plain
    plain_sample_every: int = 8           # while no round could pay, one plain step in this many is timed
    guess_budget: float = 0.02            # the guesses may cost at most this share of the plain decoding
    #                                       between them (each is a drafter call over the pairs since the
    #                                       last: at 0.8B int4 a full-vocabulary MTP head's took ~1 decode step)
    charge_switches: bool = True          # a probe's budget also pays for the steps it leaves cold: where the
    #                                       caches are shared, a call right after another session's ran 1.1-1.5
    #                                       ms slower on a ~2 ms embedded step (docs/speculation.md:
    #                                       adaptive 0.86-0.95 -> 0.97-1.05x plain where rounds lose)
    guess_near: float = 0.85              # guesses that put rounds within this of plain's rate still probe: a
    #                                       guess is a depth-1 draft, and acceptance comes in runs (embedded
    #                                       pair, 24-token prompt: guesses 0.69, rounds 0.87 a token)
    # the last measurements of each cost
    _decode: deque = field(default_factory=deque)
    _draft_level: deque = field(default_factory=deque)
    _guess_cost: deque = field(default_factory=deque)  # the drafter's guess calls (record_guess_cost)
    _cold_plain: deque = field(default_factory=deque)  # a plain step's excess over decode_s right after a
    #                                                    round or a guess call (the drafter's session ran)
    _cold_round: deque = field(default_factory=deque)  # a round's excess over its estimate right after plain steps
    _fixed: dict = field(default_factory=dict)    # verify size -> round costs besides the draft
    successes: float = 0.0                        # decayed acceptance counts: a round's first draft, or a guess (p)
    failures: float = 0.0
    run_successes: float = 0.0                    # ... a draft right after an accepted one (q)
    run_failures: float = 0.0
    runs: bool = True                             # two rates (p, q); False: one rate over every draft (geometric)
    run_prior_weight: float = 4.0                 # at a far context q's evidence shrinks to this many drafts: a
    #                                               prior the new context's rounds soon outweigh (kept whole, the
    #                                               ~60 drafts' worth behind a 1,500-token reply's q of 0.9 held 14-deep
    #                                               chains for ~15 rounds after 6,000 tokens, where 2 of 3 are accepted)
    _round_tokens: float = 0.0                    # what rounds emitted and took, decayed as the counts are: their
    _round_seconds: float = 0.0                   # realised rate, which wide_margin is judged by
    # bookkeeping
    _plain_run: int = 0
    _spec_run: int = 0
    _probe_interval: int = 0
    _refresh_interval: int = 2
    _last: str | None = None                      # kind of the step before: "plain" or "round"
    _refreshing: bool = False
    _probe_depth: int = 0                         # the depth of a probe's second round still to come
    decisions: deque = field(default_factory=lambda: deque(maxlen=4096))  # recent depths chosen (0 = plain)
    _context: int | None = None                   # context length the costs were measured at
    _medians: dict = field(default_factory=dict)  # id(a cost's deque) -> its median, until it changes
    _best: tuple | None = None                    # (what best_depth read, its answer)
    _version: int = 0                             # counts changes of the costs (measurements, a far context)
    _can_pay: tuple | None = None                 # (_version, verify graphs, rounds_can_pay's answer)
    _prior: tuple | None = None                   # the last context's costs over its decode step: (draft
    #                                               level, {verify key: fixed}), until this one's are measured
    _guessed: bool = False                        # guesses scored since the last round
    _graphs: tuple | None = None                  # inside choose(): each depth's verify graph
    guess_interval: int = 0                       # plain steps until the next guesses are due
    _await_guesses: bool = False                  # at a far context: plain steps until the guesses judge rounds
    _fast_plain: bool = False                     # the last choose() answered plain where no round could pay
    _plain_held: tuple | None = None              # (plain run a probe could be due at, _signature()): _hold_plain
    _rounds_kept: tuple | None = None             # (fixed costs, draft level, verify graphs, _round_costs' answer)
    _after_break: bool = False                    # the next step is a reply's first: its cost is not kept
    _after_other: bool = False                    # the last call was a round or a guess call

    def __post_init__(self):
        if self.max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        self._probe_interval = self.probe_every
        self.guess_interval = self.guess_every

    # ------------------------------------------------------------ estimates
    def _add(self, seen: deque, seconds: float) -> None:
        # (a plain step moves the costs only when it moves decode_s: record_plain; a guess call's cost
        # moves no decision but when guesses are next due)
        if seen is not self._decode and seen is not self._guess_cost and seen is not self._cold_plain \
                and seen is not self._cold_round:
            self._version += 1
        seen.append(seconds)
        while len(seen) > self.window:
            seen.popleft()
        self._medians.pop(id(seen), None)
        self._medians.pop("fixed", None)

    def _median(self, seen: deque) -> float:
        """A cost's median, computed again only after a new measurement: the policy asks for it every
        step, and recomputing all of them (six depths, twice a step) took ~60 µs of a ~2.5 ms plain
        step on the embedded model."""
        m = self._medians.get(id(seen))
        if m is None:
            m = self._medians[id(seen)] = median(seen)
        return m

    @property
    def decode_s(self) -> float | None:
        """A plain step's cost: the fastest of the recent ones, not their median. A plain step right
        after a round runs slow (the caches and the cores' state are the round's), and in a run of
        mostly rounds nearly every plain step is such a one: their median rated plain decoding ~1.5x
        too slow and kept rounds going at 0.90x plain (embedded model, docs/speculation.md). Noise only
        ever adds time, so the fastest is the steady step the choice is against."""
        return min(self._decode) if self._decode else None

    @property
    def draft_level_s(self) -> float | None:
        return self._median(self._draft_level) if self._draft_level else None

    @property
    def fixed_s(self) -> dict:
        """{verify key: median fixed cost}, built again only after a new measurement (do not modify)."""
        m = self._medians.get("fixed")
        if m is None:
            m = self._medians["fixed"] = {n: self._median(seen) for n, seen in self._fixed.items()}
        return m

    def acceptance(self) -> float:
        """p: that a round's first draft is accepted; 0.5 (no evidence either way) before any round."""
        n = self.successes + self.failures
        return 0.5 if n == 0 else self.successes / n

    def continuation(self, p: float | None = None) -> float:
        """q: that a draft right after an accepted one is accepted, with one pseudo-count of p (p itself
        with no evidence of its own, as the one rate when runs is off)."""
        p = self.acceptance() if p is None else p
        return (self.run_successes + p) / (self.run_successes + self.run_failures + 1.0)

    def expected_tokens(self, depth: int) -> float:
        p = self.acceptance()
        q = self.continuation(p)
        return 1.0 + p * (depth if q >= 1.0 else (1.0 - q ** depth) / (1.0 - q))

    def _nodes(self, depth: int) -> int:
        if self._graphs is not None:
            return self._graphs[depth - 1]
        if self.verify_graphs is not None:
            return self.verify_graphs(self.max_depth)[depth - 1]
        return self.verify_nodes(depth) if callable(self.verify_nodes) else 0

    def _costs(self) -> tuple | None:
        """(draft cost per level, {verify key: fixed cost}, unit): seconds are those costs times the
        unit. Measured at this context, unit 1; before they are, the last context's in decode steps,
        unit this context's decode step (a round's cost tracks the decode step's as the context grows:
        3.0 and 3.4 decode steps at 24 and 1.5k tokens on the embedded model); None while neither is
        known."""
        if self.draft_level_s is not None and self._fixed:
            return self.draft_level_s, self.fixed_s, 1.0
        if self.guessing and self._prior is not None and self.decode_s is not None:  # guesses judge them
            return (*self._prior, self.decode_s)
        return None

    def round_cost(self, depth: int) -> float | None:
        costs = self._costs()
        if costs is None:
            return None
        c = self._round_cost(depth, costs)
        return None if c is None else c * costs[2]

    def _round_cost(self, depth: int, costs: tuple) -> float | None:
        """A round's cost in the costs' unit."""
        return self._round_costs(costs)[depth - 1]

    def _round_costs(self, costs: tuple) -> tuple:
        """Each depth's round cost in the costs' unit (None where its device has no measured verify),
        worked out again only when the costs or a depth's verify graph change. rounds_can_pay asks for
        all of them whenever the fastest decode step moves (every ~3 plain steps): rebuilt each time,
        they took ~2% of the embedded model's decoding after 500 tokens (cProfile)."""
        graphs = self._depth_graphs()
        kept = self._rounds_kept
        if kept is not None and kept[0] is costs[1] and kept[1] == costs[0] and kept[2] == graphs:
            return kept[3]
        # only the graph of the device a round verifies on: the NPU's static verify and the CPU's
        # sized one cost different things (past the NPU's T_max rounds move to the CPU; judged by
        # the NPU's costs, the CPU's rounds were never tried: docs/speculation.md)
        measured: dict = {}
        for k, v in costs[1].items():
            measured.setdefault(_device(k), []).append((_size(k), v))
        rounds = []
        for depth, key in enumerate(graphs, 1):
            sizes = measured.get(_device(key))
            if not sizes:
                rounds.append(None)
                continue
            # a verify size costs at most what any larger measured size costs (a larger graph does more
            # work): an unmeasured size, or one measured a few times under a load spike and then never
            # chosen again, is charged as the cheapest measured size at or above it. Measured on the
            # embedded model: one 36.8 ms 4-node verify, beside 16 ms for 8 nodes, kept depths 1-3 out
            # for a whole reply. Above every measured size: the largest one.
            above = [v for size, v in sizes if size >= _size(key)]
            fixed = min(above) if above else max(sizes, key=lambda sv: sv[0])[1]
            rounds.append(fixed + depth * costs[0])
        self._rounds_kept = (costs[1], costs[0], graphs, tuple(rounds))
        return self._rounds_kept[3]

    def best_depth(self) -> tuple[int, float]:
        """(depth, tokens per second) of the best round by the estimates; (0, 0) if unknown. Its
        depth and rate in the costs' unit are kept until a round's cost, the acceptance evidence or a
        depth's verify graph changes: plain steps change none of them (at a far context, where the
        costs are the last context's in decode steps, each plain step moved the decode step's median
        and the policy recomputed every depth: 47 of 63 µs a plain step on the embedded model)."""
        costs = self._costs()
        if costs is None:
            return 0, 0.0
        key = self._estimates(costs)
        if self._best is None or self._best[0] != key:
            self._best = (key, self._best_depth(costs))
        depth, rate = self._best[1]
        return depth, rate / costs[2]

    def _estimates(self, costs: tuple) -> tuple:
        """What best_depth reads besides the unit: the round costs, the acceptance evidence, each
        depth's verify graph."""
        return (costs[0], costs[1], self.successes, self.failures, self.run_successes, self.run_failures,
                self._depth_graphs())

    def _depth_graphs(self) -> tuple:
        """Each depth's verify graph: the decision's own (choose) or asked now."""
        return self._graphs if self._graphs is not None else self._graphs_now()

    def _best_depth(self, costs: tuple) -> tuple[int, float]:
        """(depth, tokens per unit of the costs)."""
        best = (0, 0.0)
        for d, c in enumerate(self._round_costs(costs), 1):
            if c is None:
                return 0, 0.0
            rate = self.expected_tokens(d) / max(c, 1e-12)
            if rate > best[1]:
                best = (d, rate)
        return best

    def rounds_can_pay(self) -> bool:
        """Whether the best round could beat plain decoding by the margin to leave it if every draft
        were accepted, by the costs measured at this context (or the last context's, in decode steps).
        While it could not, the drafter's guesses and the probe rounds only cost time: a reply with
        no round at all ran 0.92-0.96x plain for them on the embedded model, where a round cost ~6
        plain steps (docs/speculation.md). True while the costs are unknown. The answer
        is kept until a cost is measured again or a depth's verify graph changes (it is asked every
        plain step, where ~20 µs is 1% of the embedded model's step)."""
        graphs = self._graphs
        kept = self._can_pay
        if kept is not None and kept[0] == self._version and (graphs is None or kept[1] == graphs):
            return kept[2]
        if graphs is None:
            self._graphs = self._graphs_now()
        try:
            answer = self._rounds_can_pay()
            self._can_pay = (self._version, self._graphs, answer)
        finally:
            if graphs is None:
                self._graphs = None
        return answer

    def _rounds_can_pay(self) -> bool:
        costs = self._costs()
        if costs is None and self.guessing and self._prior is not None:
            costs = (*self._prior, None)  # before this context's first plain steps: the last one's, in decode steps
        if costs is None:
            return True
        if costs[2] is None:
            unit = 1.0
        elif self.decode_s is None:
            return True
        else:
            unit = self.decode_s / costs[2]  # the costs' unit in decode steps
        rounds = self._round_costs(costs)
        if None in rounds:
            return True
        best = max((d + 1) / max(c, 1e-12) for d, c in enumerate(rounds, 1))
        return best * unit > self.margin * (1 + self.hysteresis)

    def budget_interval(self) -> int:
        """Plain steps a probe must wait for so that its expected extra time (two rounds of the best
        depth, less the tokens they are expected to emit at a plain step's cost) stays within
        `probe_budget` of the plain decoding between probes. Measured on the embedded model, quiet
        machine: a 96-token reply at a new context paid 6-8 rounds of probes, 25-35 plain steps'
        worth, and ran 0.61-0.85x plain where plain was right. With charge_switches the probe also
        pays for its first round and the plain step after it running cold (each measured against a
        run of its own kind): not charged, where the caches are shared, adaptive decoding ran 0.86-0.95x
        plain at contexts where rounds lose, with probes budgeted at 5% (docs/speculation.md)."""
        t_dec = self.decode_s
        if t_dec is None or self.probe_budget <= 0:
            return 0
        d = self.best_depth()[0] or self.max_depth
        cost = self.round_cost(d)
        if cost is None:
            return 0
        extra = 2 * max(cost - self.expected_tokens(d) * t_dec, 0.0)
        extra += self._cold(self._cold_round) + self._cold(self._cold_plain)  # into the probe and out of it
        return min(self.max_budget_interval, math.ceil(extra / (self.probe_budget * t_dec)))

    def _cold(self, seen: deque) -> float:
        """What switching costs once, by the last measurements of `seen` (0 unknown or not charged)."""
        return self._median(seen) if self.charge_switches and seen else 0.0

    def note_context(self, tokens: int, fresh: bool = False) -> None:
        """A generation starts at a context of `tokens`. Costs measured at a context far from it (a
        new reply after a long document, or a fresh short chat after one) are dropped and measured
        again: a decode step and a verify grow with the context, and carried over they kept rounds
        going where plain decoding won (measured in scripts/bench/bench_speculative.py's sweep). What they
        were relative to the decode step stays as a prior (_costs) until they are; with a guessing
        drafter the reply then starts plainly and the drafter's guesses decide whether rounds are
        worth measuring at all, and the evidence for p starts over (what a drafter guesses first
        depends on the text; the guesses measure it within guess_every steps), while q, how far
        its runs go once a draft is accepted, stays to read the guesses with. Without guesses the
        acceptance evidence stays: it decays round by round."""
        far = self._context is not None and abs(tokens - self._context) > max(512, self._context // 2)
        self._version += 1
        # a reply's first step, of either kind, runs after a prefill (and whatever the machine did
        # between replies): like the first step after a switch of kind, its cost is not kept. Kept, one
        # such round measured slow held the median of its verify size alone, said no round could pay,
        # and a 12-turn chat decoded plainly from its second turn on (0.95x plain; 1.20x in a rerun)
        self._after_break = True
        if far or fresh:  # a new context or text: its guesses are asked soon (below, why)
            self.guess_interval = self.guess_every
        if far:
            if self.decode_s is not None and self.draft_level_s is not None and self._fixed:
                self._prior = (self.draft_level_s / self.decode_s, {k: v / self.decode_s for k, v in self.fixed_s.items()})
            # with a guessing drafter, plain steps first: a reply after a long document paid two
            # measuring rounds where its drafter accepted 1-2 tokens a round (docs/speculation.md)
            self._await_guesses = self.guessing and self._prior is not None
            # judged by this context's guesses alone, asked soon (above): after a 12k-token document's
            # plain reply (acceptance 0.23 there, guesses asked every 256 steps) the next short chat
            # replies (95 tokens) asked no guesses, or 8 weighed against the document's, and stayed
            # plain where rounds paid 1.15x (embedded model, scripts/bench/bench_speculative.py's sweep)
            if self._await_guesses:  # (q stays: guesses are first drafts and cannot measure it)
                self.successes = self.failures = 0.0
            weight = self.run_successes + self.run_failures
            if weight > self.run_prior_weight:  # q's value, at a prior's weight
                self.run_successes *= self.run_prior_weight / weight
                self.run_failures *= self.run_prior_weight / weight
            self._round_tokens = self._round_seconds = 0.0
            self._plain_run = 0
            self._decode.clear()
            self._draft_level.clear()
            self._fixed.clear()
            self._medians.clear()
            self._last, self._refreshing, self._probe_depth = None, False, 0
            self._probe_interval, self._refresh_interval = self.probe_every, 2
            self._context = tokens
        elif self._context is None:
            self._context = tokens

    # ------------------------------------------------------------ decisions
    def _graphs_now(self) -> tuple:
        """Each depth's verify graph, asked of the engine once (for a whole decision, or one check)."""
        return (tuple(self.verify_graphs(self.max_depth)) if self.verify_graphs is not None
                else tuple(self._nodes(d) for d in range(1, self.max_depth + 1)))

    def choose(self) -> int:
        """Depth of the next step's draft; 0 = a plain decode step."""
        kept = self._can_pay
        if (kept is not None and not kept[2] and kept[0] == self._version and self._last == "plain"
                and not (self._refreshing or self._probe_depth or self._await_guesses)
                and self._plain_run < self.max_budget_interval):
            # plain decoding where no round could pay, until the next probe: what _choose would answer,
            # without its ~15 µs a step (1% of the embedded model's step)
            self.decisions.append(0)
            self._fast_plain = True
            return 0
        self._fast_plain = False
        # each depth's verify graph, asked once for the whole decision (it was asked ~18 times a step:
        # ~40 of a policy's ~60 µs a step on the embedded model)
        self._graphs = self._graphs_now()  # (None between calls)
        try:
            held = self._plain_held
            if held is not None and self._plain_run < held[0] and held[1] == self._signature():
                d = 0  # what _choose answered last, unchanged until a probe is due (_hold_plain)
            else:
                d = self._choose()
        finally:
            self._graphs = None
        self.decisions.append(d)
        return d

    def plan(self, best: tuple | None = None) -> int:
        """The depth the estimates favour now, 0 when a plain step beats every round (or unknown);
        best: best_depth()'s answer, when the caller has it."""
        if self.decode_s is None:
            return 0
        depth, rate = self.best_depth() if best is None else best
        # switching costs what neither estimate holds (the first step of a kind pays for the caches
        # holding the other session's weights): a clear win is asked for before leaving plain decoding
        need = self.margin * (1 + self.hysteresis if self._last == "plain" else 1)
        return depth if depth > 0 and rate * self.decode_s > need else 0

    def measuring_depth(self) -> int:
        """The depth of the rounds that measure the costs (at the start, and again at a far context):
        as deep as the drafts still have an even chance, 1 with no evidence. At max depth, a reply at
        a new context whose drafter accepted little paid two full rounds before plain decoding
        (embedded model, 12k tokens of source: acceptance length 1.0-1.3)."""
        # Laplace's rule: one accepted draft is not yet a drafter that is always right (with the raw
        # rate, the first measuring round's success sent the second to full depth)
        p = (self.successes + 1.0) / (self.successes + self.failures + 2.0)
        q = self.continuation(p)
        if p < 0.5:
            return 1
        if q >= 1.0:
            return self.max_depth
        # the deepest d with p q^(d-1) >= 1/2 (with q = p: a^d >= 1/2)
        return max(1, min(self.max_depth, 1 + int(math.log(0.5 / p) / math.log(q) + 1e-9)))

    def _choose(self) -> int:
        if self._await_guesses and self._plain_run < 2 * self.guess_every:  # (no guesses came: measure)
            return 0
        self._await_guesses = False
        if self._costs() is None and not (self.guessing and self._prior is not None):
            return self.measuring_depth()  # measure a round (the second of a run is the one kept)
        if self.decode_s is None or self._refreshing:  # ... then plain steps, likewise
            # a refresh runs refresh_steps plain steps: the first few after a round run slow (~1.6,
            # 1.6, 1.3x a steady one, docs/speculation.md), and decode_s keeps the fastest
            self._refreshing = self._refreshing and self._plain_run < self.refresh_steps - 1
            return 0
        if self._probe_depth:  # a probe's second round: the one whose costs are kept
            depth, self._probe_depth = self._probe_depth, 0
            return depth
        best = self.best_depth()
        depth = self.plan(best)
        if depth:
            self._probe_interval = self.probe_every
            # judged by what rounds emitted, not E(d): the geometric estimate reads low where drafts are
            # accepted in runs (embedded chat: ~1.5x plain estimated, 1.9x measured every step)
            wide = self._round_tokens >= self.wide_margin * self._round_seconds / self.decode_s
            due = self._refresh_interval if wide else min(self._refresh_interval, self.refresh_every)
            if self._spec_run >= due:
                self._refresh_interval = min(2 * due, self.max_refresh_every if wide else self.refresh_every)
                self._refreshing = True
                return 0
            return depth
        if not self.rounds_can_pay():  # not even a round of nothing but hits: costs checked again rarely
            worth = self._plain_run >= self.max_budget_interval
        elif self._guessed:  # guesses came: a probe only where they leave rounds near paying
            worth = best[1] * self.decode_s >= self.guess_near * self.margin
        else:  # for guesses that never came
            worth = not self.guessing or self._plain_run >= 2 * self.guess_every
        if worth and self._plain_run >= self._probe_interval and self._plain_run >= self.budget_interval():
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
            self._probe_depth = best[0] or self.measuring_depth()
            return self._probe_depth
        self._hold_plain(worth)
        return 0

    def _signature(self) -> tuple:
        """Everything _choose reads besides the length of the plain run."""
        return (self._version, self.successes, self.failures, self.run_successes, self.run_failures, self._last,
                self._guessed, self._await_guesses, self._refreshing, self._probe_depth, self._probe_interval,
                self.guessing, self._graphs)

    def _hold_plain(self, worth: bool) -> None:
        """_choose answered plain with no probe due: until its inputs change (_signature), the answer
        stays plain up to the plain run's length where a probe could be due, so choose() need not work it
        out again each step. The whole decision, asked every plain step after 500 tokens (where the
        guesses keep rounds near paying), was ~1.5% of the embedded model's decoding."""
        if not self.rounds_can_pay():
            due = self.max_budget_interval
        elif self._guessed:
            due = 0 if worth else math.inf
        else:
            due = 0 if not self.guessing else 2 * self.guess_every
        until = max(due, self._probe_interval, self.budget_interval())
        self._plain_held = (until, self._signature())

    def times_plain(self) -> bool:
        """Whether the next plain step is to be timed (record_plain) or only counted (count_plain): all
        are, except while plain decoding runs where no round could pay, where one in
        plain_sample_every is (enough for decode_s to follow the context; timing each step and
        recording it cost ~0.8% of the embedded model's 1.8 ms step, paired)."""
        return not self._fast_plain or self._plain_run % self.plain_sample_every == 0

    def count_plain(self) -> None:
        """A plain step that was not timed (times_plain said so): the run's bookkeeping only."""
        self._last, self._after_break, self._after_other = "plain", False, False
        self._plain_run += 1
        self._spec_run = 0

    def record_plain(self, seconds: float) -> None:
        if self._after_other and not self._after_break and self.decode_s is not None:
            self._add(self._cold_plain, max(seconds - self.decode_s, 0.0))
        if self._last == "plain" and not self._after_break:
            before = self.decode_s
            self._add(self._decode, seconds)
            if self.decode_s != before:  # rounds_can_pay's answer is kept until then: it was asked anew
                self._version += 1       # every plain step, ~20 µs of the embedded model's 1.5 ms
        self.count_plain()

    def guesses_due(self, decoded: int) -> bool:
        """Whether the drafter's guesses should be scored now, after `decoded` plain steps not yet shown
        it: their interval has passed and a round could pay (else they are asked again an interval on)."""
        if not self.guessing or decoded < self.guess_interval:
            return False
        if not self.rounds_can_pay():
            self.guess_interval = decoded + self.guess_every
            return False
        afford = self.guess_budget_interval()
        if decoded < afford:  # asked again once the plain steps since the last guesses pay for them
            self.guess_interval = afford
            return False
        return True

    def guess_budget_interval(self) -> int:
        """Plain steps that keep a guess call (its measured cost, record_guess_cost) within
        `guess_budget` of the decoding between two of them; 0 while either cost is unknown."""
        t_dec = self.decode_s
        if t_dec is None or not self._guess_cost or self.guess_budget <= 0:
            return 0
        return math.ceil(self._median(self._guess_cost) / (self.guess_budget * t_dec))

    def record_guess_cost(self, seconds: float) -> None:
        """What a guess call (the drafter's catch-up that scores its guesses) took."""
        self._add(self._guess_cost, seconds)
        self._after_other = True

    def record_guesses(self, hits) -> None:
        """The drafter's first guesses before tokens the target decoded plainly, each a hit or not:
        what a depth-1 draft would have had accepted (greedy: the target's own token; sampled, a hit
        has exactly a one-token chain's acceptance probability, p(guess)). Each counts as a depth-1
        round would, so a few rounds' deeper evidence is not drowned by many guesses; while they come,
        plain decoding needs no probes (plan() reads them every step)."""
        for hit in hits:
            self.successes = self.keep * self.successes + bool(hit)
            self.failures = self.keep * self.failures + (not hit)
        if len(hits):
            self._guessed, self._await_guesses = True, False
            # while they keep saying plain, ask less often (each ask is a drafter call: a 500-token
            # plain reply asked 15 times at 32, 4 times doubling)
            wins = self.plan() > 0
            self.guess_interval = self.guess_every if wins else min(2 * self.guess_interval, self.max_guess_every)

    def record_round(self, depth: int, accepted: int, draft_s: float, rest_s: float, verify=None) -> None:
        """A round of `depth` drafts accepted `accepted` of them; draft_s its drafting, rest_s the rest
        (verify, commit, drafter observe); verify: the graph it ran (verify_nodes' answer before the
        round; by default asked now)."""
        key = self._nodes(depth) if verify is None else verify
        if self._last == "round" and not self._after_break:
            self._add(self._draft_level, draft_s / max(depth, 1))
            self._add(self._fixed.setdefault(key, deque()), rest_s)
        elif self._last == "plain" and not self._after_break and (estimate := self._steady_round(depth, key)):
            self._add(self._cold_round, max(draft_s + rest_s - estimate, 0.0))
        self._last, self._guessed, self.guess_interval = "round", False, self.guess_every
        self._after_break, self._after_other = False, True
        accepted = min(accepted, depth)
        if not self.runs:  # one rate: every draft a trial of it
            self.successes = self.keep * self.successes + accepted
            self.failures = self.keep * self.failures + (accepted < depth)
        else:
            self.successes = self.keep * self.successes + (accepted > 0)
            self.failures = self.keep * self.failures + (accepted == 0)
            if accepted and depth > 1:  # the drafts after the first accepted one: q's trials
                self.run_successes = self.keep * self.run_successes + accepted - 1
                self.run_failures = self.keep * self.run_failures + (accepted < depth)
        self._round_tokens = self.keep * self._round_tokens + accepted + 1
        self._round_seconds = self.keep * self._round_seconds + draft_s + rest_s
        self._spec_run += 1
        self._plain_run = 0

    def _steady_round(self, depth: int, key) -> float | None:
        """A round's cost measured in a run of rounds at this context: its verify graph's (key) kept cost
        and `depth` draft levels (None until both are measured)."""
        if self.draft_level_s is None or not self._fixed.get(key):
            return None
        return self.fixed_s[key] + depth * self.draft_level_s


def _device(key) -> object:
    """A verify graph key's device: (device, size) keys name one; a bare size is the only device."""
    return key[0] if isinstance(key, tuple) else None


def _size(key) -> int:
    return key[1] if isinstance(key, tuple) else key
