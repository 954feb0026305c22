"""The sampled-speculation check both drafters' tests run: draw the first two generated tokens many
times through multi-candidate rejection on pre-verified trees, and compare their counts with the
plain sampler's exact joint distribution by a chi-square test."""
import numpy as np
from scipy.stats import chisquare

from hybrid_npu.runtime.sampling import choose
from hybrid_npu.runtime.speculative import accept_sampled


def sample_first_two(logits0, verified: dict, temperature: float, top_p: float, runs: int):
    """verified[y1] = (tree, n_real, verify logits) for the tree drafted after first token y1.
    Returns (counts [V, V] of (y1, y2), runs in which a draft was accepted)."""
    v = len(logits0)
    counts, drafts_accepted = np.zeros((v, v)), 0
    for r in range(runs):
        rng = np.random.default_rng(r)
        y1 = choose(logits0, temperature, 0, top_p, rng)
        tree, n_real, logits = verified[y1]
        path, bonus = accept_sampled(logits, tree, n_real, temperature, 0, top_p, rng)
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
