"""The sampled-speculation check both drafters' tests run: draw the first two generated tokens many
times through the seeded Gumbel-max verify (speculative.accept_sampled) on pre-verified trees, and
compare their counts with the plain sampler's exact joint distribution by a chi-square test."""
import copy

import numpy as np
from scipy.stats import chisquare

from hybrid_npu.runtime.sampling import Sampler, filtered_probs
from hybrid_npu.runtime.speculative import Tree, accept_sampled, tree_feed

RUNS = 20_000


def sample_first_two(logits0, verified: dict, temperature: float, top_p: float, runs: int):
    """verified[y1] = (tree, n_real, verify logits) for the tree drafted after first token y1.
    Returns (counts [V, V] of (y1, y2), runs in which a draft was accepted)."""
    v = len(logits0)
    counts, drafts_accepted = np.zeros((v, v)), 0
    for r in range(runs):
        sampler = Sampler(temperature, 0, top_p, seed=r)  # run r's noise: keyed by (r, position)
        y1 = sampler.choose(logits0, 0)
        tree, n_real, logits = verified[y1]
        path, bonus = accept_sampled(logits, tree, n_real, sampler, 0)  # the root y1 is at position 0
        counts[y1, tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
        drafts_accepted += len(path) > 1
    return counts, drafts_accepted


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float, int]:
    """(statistic, p-value, bins) of the counts against expected counts; bins expected below 5 are
    pooled into one."""
    keep = expected >= 5
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum())
    stat, pvalue = chisquare(obs, exp * obs.sum() / exp.sum())
    return stat, pvalue, len(obs)


def check_first_two(engine, logits0, temperature: float, top_p: float, draft) -> None:
    """engine just prefilled a prompt whose last logits are logits0. For every first token y the
    plain sampler could give, draft(y, p2) -> (tokens, parents) is the tree drafted after y (p2: the
    target's filtered distribution after y, for a drafter that wants it); the target verifies it
    once. Then RUNS seeded runs of the verify must give the exact plain joint
    distribution of the first two tokens (chi-square), with drafts really accepted."""
    base, v = copy.deepcopy(engine.state), len(logits0)
    p1 = filtered_probs(logits0, temperature, 0, top_p)
    n = engine.manifest.verify.n
    joint, verified = np.zeros((v, v)), {}
    for y in range(v):
        engine.state = copy.deepcopy(base)
        p2 = filtered_probs(engine.decode(y), temperature, 0, top_p)
        joint[y] = p1[y] * p2
        tree, n_real = Tree.from_draft(y, *draft(y, p2), n)
        engine.state = copy.deepcopy(base)
        verified[y] = (tree, n_real, engine.pipelines["verify"].run(tree_feed(engine.config, engine.state, tree))["logits"])
    counts, drafts_accepted = sample_first_two(logits0, verified, temperature, top_p, RUNS)
    assert drafts_accepted > RUNS // 10  # drafts really were accepted, not only bonus tokens sampled
    expected = joint.ravel() * RUNS
    assert counts.ravel()[expected == 0].sum() == 0  # never a token the plain sampler cannot produce
    stat, pvalue, bins = chi_square_p(counts.ravel(), expected)
    print(f"\nT={temperature} top_p={top_p}: chi-square {stat:.1f} over {bins} bins, p = {pvalue:.3f}, "
          f"a draft accepted in {drafts_accepted / RUNS:.0%} of runs")
    assert pvalue > 0.001
