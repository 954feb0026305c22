"""The speculation policy (runtime/speculation/): decisions from injected costs, never a clock, and
the engine's output stays the target's whatever it decides."""
import time

import numpy as np
import pytest
from conftest import CHUNK

import drafter_fixtures
import hybrid_npu
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime import generation
from hybrid_npu.runtime.speculation import SpecPolicy
from random_policy import RandomPolicy as Random

MS = 1e-3


def drive(policy, steps, decode_s, draft_level_s, fixed_s, accept):
    """Run the policy's loop with fake timings; accept(depth, k) = drafts accepted in the k-th round."""
    rounds = plains = 0
    for _ in range(steps):
        d = policy.choose()
        if d:
            policy.record_round(d, accept(d, rounds), d * draft_level_s, fixed_s)
            rounds += 1
        else:
            policy.record_plain(decode_s(plains) if callable(decode_s) else decode_s)
            plains += 1
    return list(policy.decisions)


def runs(decisions):
    """[(kind, length)] of consecutive plain steps ("p") and rounds ("r")."""
    out = []
    for d in decisions:
        kind = "r" if d else "p"
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return [tuple(r) for r in out]


def test_a_drafter_that_is_always_right_speculates_at_full_depth():
    p = SpecPolicy(6, refresh_every=16)
    dec = drive(p, 200, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
    # two rounds and two plain steps to measure both (the second of each kept), then rounds with a
    # refresh of four plain steps (refresh_steps) after 2, 4, 8, 16, 32, then every 64 rounds (rounds
    # 3.3x faster than plain: max_refresh_every, below). With no evidence the first measuring round is
    # one draft deep (measuring_depth), and one accepted draft is not yet evidence for more.
    assert dec[:2] == [1, 1] and set(dec[2:]) == {0, 6}
    assert runs(dec)[:13] == [("r", 2), ("p", 2), ("r", 2), ("p", 4), ("r", 4), ("p", 4), ("r", 8), ("p", 4),
                              ("r", 16), ("p", 4), ("r", 32), ("p", 4), ("r", 64)]
    assert drive(SpecPolicy(6, refresh_every=16), 200, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d) == dec


def test_rounds_far_ahead_of_plain_refresh_the_decode_cost_less_often():
    """A refresh is four plain steps and a cold round after them: on the embedded model's chat, where
    rounds ran ~2x plain, they made the default policy 2-20% slower than a round every step (twentieth
    pass). While the best round beats plain decoding by wide_margin (1.5x), a decode cost off by
    less cannot turn rounds into a loss, so the interval doubles on to max_refresh_every (64); nearer
    plain it stops at refresh_every (16), also when a faster decode step narrows the margin later."""
    def round_runs(fixed_s, decode_s=10 * MS):
        dec = drive(SpecPolicy(6, refresh_every=16), 300, decode_s, 1 * MS, fixed_s, lambda d, k: d)
        return [n for kind, n in runs(dec)[2:] if kind == "r"]
    assert round_runs(40 * MS)[:6] == [2, 4, 8, 16, 32, 64]  # 7 tokens for 46 ms against 70: 1.52x
    assert round_runs(48 * MS)[:8] == [2, 4, 8, 16, 16, 16, 16, 16]  # 54 ms: 1.30x
    # 35 ms a round: 2.0x while a plain step costs 10 ms; from the 15th plain step on it costs 6.5 (1.3x)
    narrowed = round_runs(29 * MS, lambda k: 10 * MS if k < 14 else 6.5 * MS)
    assert narrowed[:4] == [2, 4, 8, 16] and set(narrowed[4:-1]) == {16}
    # judged by what the rounds emitted: every round of 6 stops at its last draft (6 tokens for 32 ms,
    # 1.9x plain), where the estimate (first drafts all accepted, p = 1; then 4 of 5, q = 0.8) reads 1.47x
    p = SpecPolicy(6, refresh_every=16)
    dec = drive(p, 400, 10 * MS, 1 * MS, 26 * MS, lambda d, k: d - 1 if k >= 2 else d)
    assert p.best_depth()[1] * p.decode_s < 1.5 < p.estimates.round_tokens / p.estimates.round_seconds * p.decode_s
    assert [n for kind, n in runs(dec)[2:] if kind == "r"][:6] == [2, 4, 8, 16, 32, 64]


def test_a_drafter_that_is_never_right_falls_back_and_probes_less_and_less():
    p = SpecPolicy(6, probe_every=8, max_probe_every=32, probe_budget=0)  # the doubling schedule alone
    dec = drive(p, 200, 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)
    r = runs(dec)
    assert r[0] == ("r", 2)  # the two measuring rounds
    probes = [n for kind, n in r[1:] if kind == "r"]
    gaps = [n for kind, n in r[1:] if kind == "p"]  # plain steps before each probe
    assert probes[:4] == [2, 2, 2, 2]  # each probe two rounds: the second measures the round's cost again
    assert gaps[:4] == [8, 16, 32, 32]
    assert sum(1 for d in dec if d) <= 16  # of 200 steps


def test_the_measuring_rounds_are_as_deep_as_the_acceptance_evidence_allows():
    """Costs unknown (the start, a far context): the measuring rounds go as deep as a draft still has
    an even chance: 1 with no evidence or a poor drafter, the full depth for a good one."""
    p = SpecPolicy(6)
    assert p.measuring_depth() == 1  # no evidence: 1/2, and the second draft would have 1/4
    p.successes = 1.0
    assert p.measuring_depth() == 1  # one accepted draft: (1 + 1) / (1 + 2) = 2/3 (Laplace), 2/3² < 1/2
    # 20 drafts' worth of evidence at rate a: (20a + 1) / 22, as deep as its powers stay >= 1/2
    for a, want in ((0.3, 1), (0.75, 2), (0.9, 4), (0.95, 6)):
        p.successes, p.failures = 20 * a, 20 * (1 - a)
        assert p.measuring_depth() == want and p.choose() == want  # costs still unknown: a measuring round
    p.successes, p.failures = 0.2, 0.8
    p.note_context(24)
    drive(p, 40, 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)
    p.note_context(12000)  # far: the costs go, the (poor) acceptance stays
    assert p.draft_level_s is None and p.choose() == 1


def test_probes_wait_until_their_cost_fits_the_budget():
    """A never-right drafter: a probe (two depth-1 rounds of 1 + 15 ms, each emitting one token worth
    a 10 ms plain step) costs 2 x (16 - 10) = 12 ms more than plain decoding; with 5% of the plain
    time allowed for probes, at least 12 / (0.05 x 10) = 24 plain steps come before each."""
    decode, level, fixed, budget = 10 * MS, 1 * MS, 15 * MS, 0.05
    wait = round(2 * (fixed + level - decode) / (budget * decode))
    assert wait == 24
    dec = drive(SpecPolicy(6, probe_every=8, max_probe_every=64, probe_budget=budget), 400, decode, level, fixed,
                lambda d, k: 0)
    gaps = [n for kind, n in runs(dec)[1:] if kind == "p"]
    assert gaps[:4] == [wait, wait, 32, 64]  # the budget first, then the doubling once it is longer
    probe_depths = {d for d in dec[2:] if d}
    assert probe_depths == {1}  # the cheapest round is the probe when nothing is accepted


def drive_cold(policy, steps, decode, level, fixed, cold_plain, cold_round):
    """drive() with a never-right drafter, where the first plain step after a round costs cold_plain
    more and the first round after plain steps cold_round more (the caches left by the other kind)."""
    last = None
    for _ in range(steps):
        d = policy.choose()
        if d:
            policy.record_round(d, 0, d * level, fixed + (cold_round if last == "p" else 0.0))
            last = "r"
        else:
            policy.record_plain(decode + (cold_plain if last == "r" else 0.0))
            last = "p"
    return list(policy.decisions)


@pytest.mark.parametrize("charge", [True, False])
def test_a_probes_budget_also_pays_for_the_cold_steps_around_it(charge):
    """As above, but the plain step after a probe costs 6 ms more and the probe's first round 4 ms more
    than in a run of their kind: charged, a probe costs 2 x (16 - 10) + 4 + 6 = 22 ms more than plain
    decoding, so 22 / (0.05 x 10) = 44 plain steps come before each; not charged, 24."""
    decode, level, fixed, budget = 10 * MS, 1 * MS, 15 * MS, 0.05
    dec = drive_cold(SpecPolicy(6, probe_every=8, max_probe_every=64, probe_budget=budget, charge_switches=charge),
                     600, decode, level, fixed, 6 * MS, 4 * MS)
    gaps = [n for kind, n in runs(dec)[1:] if kind == "p"]
    wait = 44 if charge else 24
    assert gaps[1:3] == [wait, wait if charge else 32], gaps  # once both cold costs are measured


def test_one_slow_first_decode_step_does_not_hold_speculation_on():
    """The first kept decode step 5x slow, then 10 ms; a round costs 21 ms and accepts nothing
    (1 token): plain must win as soon as one 10 ms step is measured (a plain step costs the fastest
    of the recent ones: noise and the steps after rounds only ever add time)."""
    p = SpecPolicy(6, probe_every=8, max_probe_every=8, probe_budget=0)
    dec = drive(p, 40, lambda k: 50 * MS if k <= 1 else 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)
    assert runs(dec)[:4] == [("r", 2), ("p", 2), ("r", 2), ("p", 8)]  # 50 ms kept: rounds; then 10 ms: plain
    assert runs(dec)[4:8] == [("r", 2), ("p", 8), ("r", 2), ("p", 8)]  # and two-round probes only


def test_plain_steps_slowed_by_rounds_do_not_keep_rounds_going():
    """Plain steps cost 10 ms in a run of them but 16 ms for the first three after a round; a round
    of 6 drafts costs 80 ms and every draft lands (7 tokens, 11.4 ms a token): it beats the 16 ms the
    steps right after rounds show, not the 10 ms plain decoding costs. The refreshes between rounds
    run long enough to see a steady step, so rounds stop and stay rare (probes)."""
    p = SpecPolicy(6, refresh_every=4, probe_budget=0)
    dec = drive(p, 160, lambda k: 16 * MS if p.schedule.plain_run < 3 else 10 * MS, 1 * MS, 74 * MS, lambda d, k: d)
    tail = dec[80:]
    assert sum(1 for d in tail if d) <= 0.1 * len(tail), runs(dec)


def test_where_no_round_could_pay_there_are_no_probes():
    """A round of 6 drafts costs 86 ms: even with every draft accepted (7 tokens) that is 12.3 ms a
    token against a 10 ms plain step. After the measuring rounds the policy decodes plainly and
    probes only after max_budget_interval plain steps, where one that could pay probes at 8, 16, ..."""
    hopeless = SpecPolicy(6, probe_budget=0, max_budget_interval=200)
    dec = drive(hopeless, 600, 10 * MS, 1 * MS, 80 * MS, lambda d, k: d)
    assert not hopeless.rounds_can_pay()
    r = runs(dec)
    assert r[:3] == [("r", 2), ("p", 200), ("r", 2)]  # measure, then plain; a two-round probe per 200
    for _ in range(9):  # the verify got cheaper (its graph re-measured): the kept answer is asked again
        hopeless.record_round(6, 6, 6 * MS, 20 * MS)
    assert hopeless.rounds_can_pay()
    hopeful = SpecPolicy(6, probe_budget=0)  # 6 drafts for 36 ms: 5.1 ms a token at best
    dec = drive(hopeful, 120, 10 * MS, 1 * MS, 30 * MS, lambda d, k: 0)
    assert hopeful.rounds_can_pay()
    assert sum(1 for kind, _ in runs(dec) if kind == "r") >= 4  # nothing lands: probes at 8, 16, 32, ... as before
    assert SpecPolicy(6).rounds_can_pay()  # nothing measured: unknown, so rounds are tried


def test_where_no_round_could_pay_one_plain_step_in_eight_is_timed():
    """Timing and recording each plain step was ~0.8% of the embedded model's step; where choose()
    answers plain because no round could pay, only every eighth one is timed, the others counted, and
    the probe still comes after max_budget_interval plain steps."""
    p = SpecPolicy(6, probe_budget=0, max_budget_interval=200)
    drive(p, 40, 10 * MS, 1 * MS, 80 * MS, lambda d, k: d)  # measuring rounds, then hopeless plain steps
    assert not p.rounds_can_pay() and p.decisions[-1] == 0
    timed = steps = 0
    while p.choose() == 0:
        steps += 1
        if p.times_plain():
            p.record_plain(10 * MS)
            timed += 1
        else:
            p.count_plain()
        assert steps < 1000
    assert 40 + steps >= 200 - 4  # the probe came when the plain run reached the interval, as before
    assert steps // 8 <= timed <= steps // 8 + 2
    assert list(p.estimates.decode)[-1] == 10 * MS  # the timed ones still set decode_s
    busy = SpecPolicy(6)  # rounds could pay (nothing measured): every plain step is timed
    assert busy.choose() and busy.times_plain()


def test_the_last_contexts_costs_judge_whether_a_round_could_pay_before_any_plain_step():
    """At a far context the costs are the last context's in decode steps: with a guessing drafter they
    say whether guesses are worth asking before this context's first plain step is timed."""
    for fixed_ms, can in ((80, False), (30, True)):
        p = SpecPolicy(6, guessing=True, probe_budget=0)
        p.note_context(24)
        drive(p, 12, 10 * MS, 1 * MS, fixed_ms * MS, lambda d, k: d)
        p.note_context(5000)  # far: costs dropped, kept relative to the decode step
        assert p.decode_s is None and p.rounds_can_pay() is can


def test_a_cost_right_after_the_other_kind_of_step_is_not_kept():
    """The first plain step after rounds (cold caches) is not what plain decoding costs."""
    p = SpecPolicy(6)
    p.record_round(6, 6, 6 * MS, 15 * MS)   # after nothing: not kept
    assert p.draft_level_s is None
    p.record_round(6, 6, 6 * MS, 15 * MS)
    p.record_plain(40 * MS)                  # right after a round: not kept
    assert p.decode_s is None
    p.record_plain(10 * MS)
    assert p.decode_s == pytest.approx(10 * MS) and p.round_cost(6) == pytest.approx(21 * MS)


def expected_tokens(p, q, d):
    """Tokens a chain of d drafts emits when its first is accepted with probability p and each later
    one, after an accepted one, with q (bonus included): sum over k = accepted drafts of P(k) (k + 1)."""
    probs = [1 - p] + [p * q ** (k - 1) * (1 - q) for k in range(1, d)] + [p * q ** (d - 1)]
    return sum(pk * (k + 1) for k, pk in enumerate(probs))


@pytest.mark.parametrize("pq", [(0.5, 0.5), (0.7, 0.9), (0.9, 0.3)])
@pytest.mark.parametrize("fixed_ms,draft_ms,decode_ms", [(4, 2, 5), (4, 0.2, 5), (20, 1, 5), (3, 1, 8)])
def test_it_picks_the_depth_with_the_best_rate_or_plain(fixed_ms, draft_ms, decode_ms, pq):
    """The chosen depth is the argmax of expected tokens per second, computed here from the
    distribution of accepted drafts at the policy's two rates; plain when no depth beats one token
    per decode step. (0.5, 0.5): one rate, the geometric case."""
    p = SpecPolicy(6)
    for _ in range(2):  # the second of each kind is the one kept
        p.record_plain(decode_ms * MS)
    for _ in range(2):
        p.record_round(2, 1, 2 * draft_ms * MS, fixed_ms * MS)
    first, then = pq  # counts giving p = first and, with p's pseudo-count, q = then
    p.successes, p.failures = 10 * first, 10 * (1 - first)
    p.run_failures = 5 * (1 - then)
    p.run_successes = (then * (p.run_failures + 1) - first) / (1 - then)
    assert p.acceptance() == pytest.approx(first) and p.continuation() == pytest.approx(then)
    rates = {d: expected_tokens(first, then, d) / ((fixed_ms + d * draft_ms) * MS) for d in range(1, 7)}
    best = max(rates, key=rates.get)
    want = best if rates[best] * decode_ms * MS > 1 else 0
    assert p.plan() == want
    assert p.expected_tokens(6) == pytest.approx(expected_tokens(first, then, 6))


def test_a_round_counts_its_first_draft_for_p_and_the_rest_for_q():
    """Censored counts: a round of depth d accepting A drafts is one trial of p (a success when A > 0)
    and, after an accepted first draft, A - 1 successes of q and one failure when A < d. With runs
    off, every draft is a trial of one rate (A successes, one failure when A < d)."""
    for runs_on in (True, False):
        p = SpecPolicy(6, runs=runs_on)
        for depth, accepted in ((6, 4), (6, 0), (6, 6), (1, 1)):
            p.record_round(depth, accepted, 1 * MS, 10 * MS)
        k = 0.875
        if runs_on:  # p: 1, 0, 1, 1; q: 3 of 4 (a failure), nothing, 5 of 5, nothing (depth 1)
            assert p.successes == pytest.approx(k ** 3 + k + 1) and p.failures == pytest.approx(k ** 2)
            assert p.run_successes == pytest.approx(3 * k + 5) and p.run_failures == pytest.approx(k)
        else:
            assert p.successes == pytest.approx(4 * k ** 3 + 6 * k + 1) and p.failures == pytest.approx(k ** 3 + k ** 2)
            assert p.run_successes == p.run_failures == 0


def test_verify_cost_is_kept_per_graph_size():
    p = SpecPolicy(4, verify_nodes=lambda d: 4 if d <= 1 else 8)
    p.record_round(1, 1, 1 * MS, 2 * MS)  # the first of a run: not kept
    p.record_round(1, 1, 1 * MS, 2 * MS)
    p.record_round(3, 3, 3 * MS, 9 * MS)
    assert p.round_cost(1) == pytest.approx(p.draft_level_s + 2 * MS)
    assert p.round_cost(4) == pytest.approx(4 * p.draft_level_s + 9 * MS)


def test_verify_costs_are_kept_per_device():
    """Rounds verify on the NPU while the context fits its T_max, then on the CPU: a cost measured on
    one device's graph is never charged to the other's (the NPU's 16-node verify is not the CPU's
    4-node one), and the key a round ran with is the one its cost is kept under."""
    where = ["QNN/HTP"]
    p = SpecPolicy(4, verify_nodes=lambda d: (where[0], 16 if where[0] == "QNN/HTP" else 4))
    for _ in range(2):
        p.record_plain(10 * MS)
    for _ in range(2):
        p.record_round(4, 4, 4 * MS, 40 * MS)
    assert p.round_cost(4) == pytest.approx(44 * MS)
    where[0] = "CPU"
    assert p.round_cost(4) is None and p.best_depth() == (0, 0.0)  # unknown there: measured, not assumed
    p.record_round(4, 4, 4 * MS, 8 * MS, verify=("CPU", 4))
    assert p.round_cost(4) == pytest.approx(12 * MS)
    where[0] = "QNN/HTP"
    assert p.round_cost(4) == pytest.approx(44 * MS)
    assert set(p.fixed_s) == {("QNN/HTP", 16), ("CPU", 4)}


def test_a_smaller_verify_size_never_costs_more_than_a_larger_measured_one():
    """A 4-node verify measured once under a load spike (30 ms) and never chosen again must not price
    depths 1-3 above the 8-node graph's measured 9 ms: it is charged 9 ms, unmeasured 2 nodes too."""
    p = SpecPolicy(6, verify_nodes=lambda d: 2 if d == 1 else 4 if d <= 3 else 8)
    p.record_round(2, 2, 2 * MS, 30 * MS)  # the first of a run: not kept
    p.record_round(2, 2, 2 * MS, 30 * MS)
    for _ in range(4):
        p.record_round(6, 6, 6 * MS, 9 * MS)
    assert p.fixed_s == {4: pytest.approx(30 * MS), 8: pytest.approx(9 * MS)}
    for d in (1, 2, 3):
        assert p.round_cost(d) == pytest.approx(9 * MS + d * p.draft_level_s)


def test_a_probe_measures_the_round_cost_again():
    """A round cost measured high once (a load spike) is re-measured by the next probe, so the
    policy goes back to speculating when rounds are cheap again."""
    p = SpecPolicy(6, probe_every=8, max_probe_every=8)
    cost = {"fixed": 200 * MS}
    dec = []
    for step in range(120):
        d = p.choose()
        dec.append(d)
        if d:
            p.record_round(d, d, d * 1 * MS, cost["fixed"])
            cost["fixed"] = 15 * MS  # the spike is over after the first rounds
        else:
            p.record_plain(10 * MS)
    assert p.fixed_s[0] == pytest.approx(15 * MS)
    assert sum(1 for d in dec[-40:] if d) >= 30  # speculating again


def test_costs_are_measured_again_at_a_far_context():
    """Costs measured at a short context are dropped when a generation starts 6k tokens later (a
    decode step and a verify grow with the context); a nearby start keeps them."""
    p = SpecPolicy(6, refresh_every=16)
    p.note_context(24)
    drive(p, 40, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
    p.note_context(300)  # near: kept
    assert p.decode_s == pytest.approx(10 * MS)
    p.note_context(6000)
    assert p.decode_s is None and p.draft_level_s is None and not p.fixed_s
    assert p.acceptance() == pytest.approx(1.0)  # the acceptance evidence stays
    start = len(p.decisions)
    drive(p, 8, 20 * MS, 1 * MS, 30 * MS, lambda d, k: d)
    assert runs(list(p.decisions)[start:])[:2] == [("r", 2), ("p", 2)]  # measured again, as at the start
    assert p.decode_s == pytest.approx(20 * MS)


def test_guesses_are_acceptance_evidence_and_replace_the_probes():
    """A guessing drafter's scored guesses move the acceptance estimate like depth-1 rounds, and while
    they come a policy decoding plainly runs no probe rounds; guesses that say a round pays bring
    speculation back without one."""
    p = SpecPolicy(6, guessing=True, probe_budget=0)
    dec = drive(p, 6, 10 * MS, 1 * MS, 30 * MS, lambda d, k: 0 if k else 1)  # rounds that do not pay, then plain
    assert dec[:2] != [0, 0] and dec[-1] == 0
    before = p.acceptance()
    for _ in range(12):  # 192 plain steps, guesses every 16, none right: no probe at 8, 16, 32, 64, ...
        dec = drive(p, 16, 10 * MS, 1 * MS, 30 * MS, lambda d, k: 0)
        p.record_guesses([False] * 16)
    assert not any(list(p.decisions)[6:]) and p.acceptance() < before
    assert p.guess_interval == p.max_guess_every  # asked less often while the guesses say plain: 32, 64, ... 256
    # each guess decays the evidence as one round does (keep = 0.875): 16 hits after many misses
    weight = sum(0.875 ** i for i in range(16))
    s_before, n_before = p.successes, p.successes + p.failures
    p.record_guesses([True] * 16)
    assert p.successes + p.failures == pytest.approx(0.875 ** 16 * n_before + weight)
    assert p.acceptance() == pytest.approx((0.875 ** 16 * s_before + weight) / (0.875 ** 16 * n_before + weight))
    start = len(p.decisions)
    assert p.guess_interval == p.guess_every  # guesses that say rounds pay: asked at the base interval
    drive(p, 4, 10 * MS, 1 * MS, 30 * MS, lambda d, k: d)
    assert any(list(p.decisions)[start:])  # speculating again, no probe needed


def test_guesses_are_asked_no_more_often_than_their_measured_cost_allows():
    """A guess call costing 2 decode steps, at a 2% budget, is due only after 100 plain steps (not the
    base 32); with no cost measured yet, or a cheap one, at the base interval."""
    def due_after(cost_steps):
        p = SpecPolicy(6, guessing=True, probe_budget=0)
        drive(p, 6, 10 * MS, 1 * MS, 12 * MS, lambda d, k: d)  # rounds could pay: guesses are worth asking
        assert p.rounds_can_pay()
        if cost_steps is not None:
            p.record_guess_cost(cost_steps * 10 * MS)
        return next(n for n in range(1, 1000) if p.guesses_due(n))
    assert due_after(None) == due_after(0.1) == 32
    assert due_after(2.0) == 100
    assert due_after(4.0) == 200


def test_a_far_context_starts_plainly_and_asks_the_guesses():
    """At a far context a guessing policy decodes plainly (no measuring rounds) until guesses come;
    guesses that say rounds lose keep it plain at the last context's relative costs, guesses that say
    they pay start rounds straight away. Without guesses it measures as before (the test above it)."""
    def warmed(accept):
        p = SpecPolicy(6, guessing=True, refresh_every=16)
        p.note_context(24)
        drive(p, 40, 10 * MS, 1 * MS, 15 * MS, accept)
        p.note_context(6000)
        assert p.decode_s is None and not p.fixed_s and p.round_cost(6) is None
        return p
    for hits, want_rounds in ((False, False), (True, True)):
        p = warmed(lambda d, k: d)
        start = len(p.decisions)
        drive(p, 16, 20 * MS, 2 * MS, 30 * MS, lambda d, k: d)  # the reply's first 16 steps
        assert not any(list(p.decisions)[start:])  # plain, waiting for the guesses
        assert p.round_cost(6) == pytest.approx((15 + 6) / 10 * 20 * MS)  # the prior, at this decode step
        p.record_guesses([hits] * 16)
        drive(p, 16, 20 * MS, 2 * MS, 30 * MS, lambda d, k: d)
        assert any(list(p.decisions)[start + 16:]) == want_rounds
    p = SpecPolicy(6, guessing=True)  # no prior (a first reply): measuring rounds, as without guesses
    p.note_context(6000)
    assert drive(p, 2, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)[:2] == [1, 1]


def test_guesses_near_paying_still_let_a_probe_measure_rounds():
    """A guess is a depth-1 draft, and where a drafter's acceptance comes in runs the guesses read low
    (embedded model: 0.69 a token where rounds accepted 0.87). Guesses right every other time leave a
    round (15 ms + 1 ms a level against a 10 ms step) at 1.04x plain's rate: short of the switch
    (1.2x) but near, so a probe runs and, its rounds accepting everything, speculation goes on.
    Guesses never right (0.6x) run no probe."""
    for pattern, want in (([True, False], True), ([False, False], False)):
        p = SpecPolicy(6, guessing=True, probe_budget=0)
        drive(p, 6, 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)  # costs measured; plain from then on
        for _ in range(8):
            p.record_guesses(pattern * 4)
        start = len(p.decisions)
        for _ in range(4):
            drive(p, 16, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
            if not any(list(p.decisions)[start:]):
                p.record_guesses(pattern * 4)
        assert any(list(p.decisions)[start:]) == want
        if want:
            assert sum(1 for d in list(p.decisions)[-16:] if d) >= 8  # the rounds found, they go on


def test_a_far_context_judges_by_its_own_guesses():
    """After a context where the drafter was never right (its guesses asked ever less often), a far
    context asks its guesses at the base interval and judges by them alone: guesses right 5 times in
    8 start rounds, which the old context's evidence would have outweighed."""
    p = SpecPolicy(6, guessing=True, refresh_every=16)
    p.note_context(12000)
    drive(p, 8, 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)
    for _ in range(4):
        drive(p, 32, 10 * MS, 1 * MS, 15 * MS, lambda d, k: 0)
        p.record_guesses([False] * 8)
    assert p.guess_interval > p.guess_every and p.acceptance() < 0.05
    p.note_context(24)
    assert p.guess_interval == p.guess_every and p.acceptance() == 0.5  # no evidence yet
    start = len(p.decisions)
    drive(p, 32, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
    assert not any(list(p.decisions)[start:])  # plain until the guesses come
    p.record_guesses([False] * 3 + [True] * 5)
    drive(p, 8, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
    assert any(list(p.decisions)[start + 32:])


def test_no_drafter_call_while_no_round_could_pay(eagle3_export):
    """A reply the policy decodes plainly because no round could pay runs the drafter not at all: no
    catch-up at the end of the prefill, no guesses; the pairs wait in the feed, the output is plain."""
    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 300, 20)]

    class Hopeless(Scripted):
        def rounds_can_pay(self):
            return False

    engine.make_policy = lambda e: Hopeless([0])
    calls = []
    for name in ("observe", "skip"):
        real = getattr(engine.drafter, name)
        setattr(engine.drafter, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    out = engine.generate(prompt, 70, stop_at_eos=False)
    assert out == hybrid_npu.load_engine(eagle3_export).generate(prompt, 70, stop_at_eos=False, speculative=False)
    assert calls == [] and engine.last_stats["rounds"] == 0
    assert len(engine.drafter_feed) >= 19 + 69  # the prompt's pairs and the reply's, waiting


def test_the_catch_up_scores_the_drafters_own_guesses(eagle3_export):
    """The guesses the catch-up scores are the drafter's own: one position at a time, guess() before
    each token, on a second drafter fed the same pairs."""
    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 300, 20)]
    scored = []

    class Plain(Scripted):
        def record_guesses(self, hits):
            scored.extend(hits)
            super().record_guesses(hits)

    engine.make_policy = lambda e: Plain([0])
    pairs = []
    real_observe = engine.drafter.observe

    def observe(tokens, features, guesses=0):
        pairs.append((list(tokens), np.array(features), guesses))
        return real_observe(tokens, features, guesses)

    engine.drafter.observe = observe
    out = engine.generate(prompt, 40, stop_at_eos=False)
    assert out == hybrid_npu.load_engine(eagle3_export).generate(prompt, 40, stop_at_eos=False, speculative=False)
    policy = generation.policy_for(engine.model, engine.context)
    k = policy.guesses_per_catch_up
    # the prompt's 19 pairs at the end of the prefill; 39 plain tokens: a catch-up at 32 (its last k
    # scored) with the first token's pair before them; the last 7 wait for the drafter's next use,
    # here a catch-up asked for (all 7 scored)
    assert [(len(t), g) for t, _, g in pairs] == [(19, 0), (33, k + 1)] and len(scored) == k
    assert len(policy.estimates.guess_cost) == 1 and policy.estimates.guess_cost[0] > 0  # the guess call's cost, for its budget
    policy.record_guesses(engine.catch_up_drafter(policy.guesses_per_catch_up))
    assert [(len(t), g) for t, _, g in pairs][2:] == [(7, 7)] and len(scored) == k + 7
    from hybrid_npu.runtime.drafters.eagle3 import Eagle3Drafter
    ref, hits = Eagle3Drafter(eagle3_export / "drafter"), []
    for tokens, features, guessed in pairs:
        for j, (t, f) in enumerate(zip(tokens, features)):
            if guessed and j >= len(tokens) - k:
                hits.append(ref.guess() == t)
            ref.observe([t], f[None])
    assert hits == scored


# ------------------------------------------------------------------------ the engine, switching
class Scripted(SpecPolicy):
    """Decisions from a fixed cycle (plain steps and rounds of several depths), whatever is measured."""

    def __init__(self, cycle):
        super().__init__(max(max(cycle), 1))
        self.cycle, self.k = cycle, 0

    def _choose(self):
        self.k += 1
        return self.cycle[(self.k - 1) % len(self.cycle)]


CYCLE = [6, 0, 0, 3, 0, 6, 6, 1, 0, 0, 0, 2]


@pytest.fixture(scope="module")
def eagle3_export(text_tied, tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    weights = drafter_fixtures.drafter_weights(seed=1, hidden_size=48, embed=False)
    src = drafter_fixtures.write_eagle3(root / "eagle3", weights, hidden_size=48)
    export(text_tied.src, root / "export", chunk=CHUNK, drafter=src)
    return root / "export"


def test_switching_between_plain_steps_and_rounds_keeps_the_output_and_the_drafter(eagle3_export):
    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, CHUNK + 4)]
    plain = engine.generate(prompt, 96, stop_at_eos=False, speculative=False)
    engine.make_policy = lambda e: Scripted(CYCLE)
    out = engine.generate(prompt, 96, stop_at_eos=False)
    assert out == plain
    s = engine.last_stats
    assert s["rounds"] > 0 and s["plain_steps"] > 0
    # the drafter saw every (taps, token) pair once, in order: its K/V equals an always-speculating run's
    # (once shown the last plain steps' pairs, which wait for its next use)
    engine.catch_up_drafter()
    switched = (engine.drafter.length, engine.drafter.key[:, : engine.drafter.length].copy())
    engine.adaptive = False
    assert engine.generate(prompt, 96, stop_at_eos=False) == plain
    assert engine.last_stats["plain_steps"] == 0
    engine.catch_up_drafter()
    assert engine.drafter.length == switched[0]
    ref = engine.drafter.key[:, : switched[0]]
    assert np.abs(switched[1] - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())  # verify vs decode taps


def test_random_mixes_of_plain_steps_rounds_and_guesses_across_a_kv_block_keep_the_output(eagle3_export):
    """Whatever the policy does, greedy output is plain decoding's, here across the K/V buffer's growth
    (the prompt ends 10 tokens before a block boundary)."""
    from hybrid_npu.runtime.state import KV_BLOCK

    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 300, KV_BLOCK - 10)]
    plain = engine.generate(prompt, 48, stop_at_eos=False, speculative=False)
    for seed in range(4):
        engine.make_policy = lambda e, seed=seed: Random(seed, 6)
        assert engine.generate(prompt, 48, stop_at_eos=False) == plain, f"seed {seed}"
        s = engine.last_stats
        assert s["rounds"] > 0 and s["plain_steps"] > 0


def test_a_long_prompt_is_observed_only_where_the_drafter_reads_it(eagle3_export):
    """Of a prompt longer than the drafter's context_rows, only the last ones are observed (the rest
    skipped, runtime/drafter_feed.py), when the first round needs the drafter; the drafter then
    proposes what one shown every pair proposes, and the output is the plain one."""
    engine = hybrid_npu.load_engine(eagle3_export)
    keep = engine.drafter.context_rows
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 300, keep + 300)]
    plain = engine.generate(prompt, 24, stop_at_eos=False, speculative=False)
    observed = []
    real_observe = engine.drafter.observe

    def observe(tokens, features, guesses=0):
        observed.append(len(tokens))
        return real_observe(tokens, features, guesses)

    engine.drafter.observe = observe
    engine.make_policy = lambda e: Scripted([6])
    engine.prefill_logits(prompt)
    assert observed == [] and len(engine.drafter_feed) == len(prompt) - 1  # (the last tap waits)
    assert engine.generate(prompt, 24, stop_at_eos=False) == plain
    assert observed[0] == keep  # the prompt's last pairs, at the end of the prefill
    # the pairs it skipped and kept are the prompt's: a drafter shown all of them, the skipped ones
    # first, then the kept ones in the same call, proposes the same tree
    from hybrid_npu.runtime.drafters.eagle3 import Eagle3Drafter
    window = engine.drafter.window
    engine.drafter = full = Eagle3Drafter(eagle3_export / "drafter", window=window)
    engine.reset()
    engine.drafter_feed.keep = None  # a feed that holds every pair
    engine.prefill(prompt)
    _, tokens, features = engine.drafter_feed.take()
    skip = len(tokens) - keep
    full.observe(tokens[:skip], features[:skip])
    full.observe(tokens[skip:], features[skip:])
    engine.drafter = lazy = Eagle3Drafter(eagle3_export / "drafter", window=window)
    engine.prefill_logits(prompt)
    engine.catch_up_drafter()
    assert lazy.length == full.length == len(prompt) - 1
    assert lazy.propose(prompt[-1], 4, 4, 20) == full.propose(prompt[-1], 4, 4, 20)


def test_plain_steps_inside_speculation_sample_as_plain_decoding(eagle3_export):
    """A policy that never drafts after the first round samples with the same random draws as plain."""
    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 300, 20)]
    plain = engine.generate(prompt, 40, temperature=0.9, top_p=0.95, seed=7, stop_at_eos=False, speculative=False)
    engine.make_policy = lambda e: Scripted([0])
    assert engine.generate(prompt, 40, temperature=0.9, top_p=0.95, seed=7, stop_at_eos=False) == plain
    assert engine.last_stats["rounds"] == 0


def test_leaving_plain_decoding_needs_a_clear_win():
    """Rounds at 1.11x plain's rate: kept on while speculating, not worth switching to from plain."""
    p = SpecPolicy(3)
    for _ in range(2):
        p.record_round(1, 0, 1 * MS, 8 * MS)  # nothing accepted: 1 token per 9 ms
    for _ in range(2):
        p.record_plain(10 * MS)
    assert p.plan() == 0
    p.record_round(1, 0, 1 * MS, 8 * MS)
    assert p.plan() == 1


def test_a_new_draft_shape_starts_a_new_policy(eagle3_export):
    """Costs and acceptance measured for one draft shape do not carry over to another of the same
    depth (a top-4 tree's 16-node verify and lower acceptance held chain rounds back)."""
    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 300, 12)]
    engine.draft_shape = {"top_k": 4, "depth": 3, "total_tokens": 10}
    engine.generate(prompt, 16, stop_at_eos=False)
    tree_policy = generation.policy_for(engine.model, engine.context)
    engine.generate(prompt, 16, stop_at_eos=False)
    assert generation.policy_for(engine.model, engine.context) is tree_policy  # the same shape: kept, reply to reply
    engine.draft_shape = {"top_k": 1, "depth": 3, "total_tokens": 3}
    chain_policy = generation.policy_for(engine.model, engine.context)
    assert chain_policy is not tree_policy and chain_policy.successes == chain_policy.failures == 0
    engine.draft_shape = {"top_k": 4, "depth": 3, "total_tokens": 10}
    assert generation.policy_for(engine.model, engine.context) is tree_policy  # back to the tree: what it measured still holds
    engine.make_policy = lambda e: SpecPolicy(3)
    assert generation.policy_for(engine.model, engine.context) is not tree_policy  # a new maker: every policy anew


def test_the_best_depth_follows_every_new_measurement():
    """best_depth is kept between plain steps; a new round cost or acceptance changes it at once: it
    equals what a policy fed the same measurements, never asked in between, computes."""
    def feed(p, asking):
        answers = []
        for _ in range(2):
            p.record_plain(10 * MS)
        for _ in range(2):
            p.record_round(6, 6, 6 * MS, 5 * MS)    # cheap 8-node rounds, all accepted
        answers.append(asking and p.best_depth())
        p.record_plain(10 * MS)
        answers.append(asking and p.best_depth())   # a plain step changes no round estimate
        for _ in range(8):
            p.record_round(6, 0, 6 * MS, 80 * MS)   # the verify turns slow and nothing is accepted
        return answers + [p.best_depth()]
    asked = feed(SpecPolicy(6, verify_nodes=lambda d: 2 if d == 1 else 8), True)
    fresh = feed(SpecPolicy(6, verify_nodes=lambda d: 2 if d == 1 else 8), False)
    assert asked[0] == asked[1] and asked[0][0] == 6
    assert asked[-1] == fresh[-1] and asked[-1][1] < asked[0][1] / 10


@pytest.mark.verify_in_background
def test_a_fresh_engine_decodes_plainly_while_its_verify_session_opens(eagle3_export):
    """The verify session opens in the background after a load; a round that waited for it cost a
    fresh engine's first reply ~3x (scripts/demo.py). Rounds start once it is open, and the output is
    the plain one throughout."""
    import threading
    from concurrent.futures import Future

    engine = hybrid_npu.load_engine(eagle3_export)
    opened = engine.pipelines._opening.pop("verify").result()  # the load's prefetch, held back below
    still_opening = Future()
    engine.pipelines._opening["verify"] = still_opening
    # (a round that waits for the session gets it after 30 s, and then fails the counts below)
    late = threading.Timer(30, lambda: still_opening.done() or still_opening.set_result(opened))
    late.start()
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 300, CHUNK + 4)]
    plain = engine.generate(prompt, 48, stop_at_eos=False, speculative=False)
    engine.make_policy = lambda e: Scripted([6])  # a round whenever one can run
    try:
        assert engine.generate(prompt, 48, stop_at_eos=False) == plain
        assert engine.last_stats["rounds"] == 0 and engine.last_stats["plain_steps"] == 47
        assert "verify" not in engine.pipelines  # never waited for
    finally:
        late.cancel()
    still_opening.done() or still_opening.set_result(opened)
    assert engine.generate(prompt, 48, stop_at_eos=False) == plain
    assert engine.last_stats["rounds"] > 0


def test_a_reply_reports_its_plain_steps_median_cost_as_the_policy_timed_them(eagle3_export):
    """last_stats["plain_step_median_s"] (bench_speculative's rate against the reply's own plain
    steps) is the median of the very plain-step times the policy is given, None with no plain step."""
    import statistics

    engine = hybrid_npu.load_engine(eagle3_export)
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, CHUNK + 4)]
    timed = []

    class Recording(Scripted):
        def record_plain(self, seconds):
            timed.append(seconds)
            super().record_plain(seconds)

    engine.make_policy = lambda e: Recording(CYCLE)
    engine.generate(prompt, 64, stop_at_eos=False)
    s = engine.last_stats
    assert len(timed) == s["plain_steps"] > 0 and s["rounds"] > 0
    assert s["plain_step_median_s"] == statistics.median(timed)
    engine.adaptive = False  # a round every step: no plain step to judge by
    engine.generate(prompt, 32, stop_at_eos=False)
    assert engine.last_stats["plain_steps"] == 0 and engine.last_stats["plain_step_median_s"] is None
    t0 = time.perf_counter()
    engine.generate(prompt, 32, stop_at_eos=False, speculative=False)  # plain decoding times its steps too
    steps = engine.last_stats["plain_step_median_s"]
    assert 0 < steps and 31 * steps < time.perf_counter() - t0


def test_a_replys_first_round_after_a_break_is_not_kept():
    """The first step of a reply runs after its prefill (and, in a chat, whatever ran between turns):
    one such round measured slow was kept as its verify size's only cost, said no round could pay,
    and a 12-turn chat decoded plainly from its second turn on. Its cost is not kept; the next
    round's is."""
    p = SpecPolicy(6, probe_budget=0)
    p.note_context(50)
    dec = drive(p, 5, 10 * MS, 1 * MS, 15 * MS, lambda d, k: d)
    assert dec[:4] == [1, 1, 0, 0] and dec[4] > 0      # one round cost kept; the reply ends in a round
    p.note_context(80)                   # the next reply, near: costs stay
    d = p.choose()
    assert d > 0
    p.record_round(d, d, d * MS, 200 * MS)   # slow: the first round after the break
    assert p.rounds_can_pay() and p.fixed_s == {0: 15 * MS}
    p.record_round(d, d, d * MS, 16 * MS)    # the second of the run is kept
    assert sorted(p.estimates.fixed[0]) == [15 * MS, 16 * MS]
    p.note_context(90)
    p.record_plain(50 * MS)              # a reply's first plain step: not kept either
    p.record_plain(9 * MS)
    assert list(p.estimates.decode) == [10 * MS, 9 * MS]


def test_guesses_are_read_with_the_runs_the_rounds_showed():
    """A drafter whose chains run long (9 of 14 drafts a round) and whose first guesses hit 0.7 a token:
    one rate read off the guesses (0.7) puts a 14-deep round at 3.3 tokens, under plain decoding's
    rate, and after a far context the policy stayed plain (embedded model after 1,500 tokens on a Zen
    3: 2 of 3 replies ran no round where speculating every step ran 1.44x plain). With q kept from
    the rounds before, the same guesses put a round at ~6 tokens and the policy speculates again;
    a drafter whose rounds never ran on (1 of 14) stays plain after the same guesses."""
    guesses = [True, True, False, True, True, False, True, False, True, True] * 2  # 0.7
    plain_ms, level_ms, fixed_ms = 2.0, 0.25, 7.0  # the embedded model's chat on the Zen 3, roughly

    def after_far_context(runs_on, accepted):
        p = SpecPolicy(14, guessing=True, runs=runs_on)
        p.note_context(500)
        drive(p, 60, plain_ms * MS, level_ms * MS, fixed_ms * MS, lambda d, k: min(d, accepted))
        p.note_context(1500)  # far: plain steps until the guesses judge rounds
        start = len(p.decisions)
        drive(p, 32, 1.15 * plain_ms * MS, level_ms * MS, 1.15 * fixed_ms * MS, lambda d, k: min(d, accepted))
        assert not any(list(p.decisions)[start:])
        p.record_guesses(guesses)
        drive(p, 64, 1.15 * plain_ms * MS, level_ms * MS, 1.15 * fixed_ms * MS, lambda d, k: min(d, accepted))
        return sum(1 for d in list(p.decisions)[start:] if d)
    assert after_far_context(True, 9) >= 8  # rounds again, and they go on
    assert after_far_context(False, 9) == 0  # one rate: the guesses alone, plain
    assert after_far_context(True, 1) == 0


def test_a_far_context_keeps_q_as_a_light_prior():
    """q survives a far context at its value but with the weight of run_prior_weight drafts, so the
    new context's own rounds move it within a few rounds: after long runs (13 of 14), rounds that
    accept 3 of 14 bring q under 0.8 within three rounds."""
    p = SpecPolicy(14)
    for _ in range(20):
        p.record_round(14, 13, 3 * MS, 7 * MS)
    q_before = p.continuation()
    assert q_before > 0.9 and p.run_successes + p.run_failures > 50
    p.note_context(500)
    p.note_context(6000)
    assert p.continuation() == pytest.approx(q_before, abs=0.03)
    assert p.run_successes + p.run_failures == pytest.approx(p.run_prior_weight)
    for _ in range(3):
        p.record_round(14, 3, 3 * MS, 7 * MS)
    assert p.continuation() < 0.8
