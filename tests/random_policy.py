"""A speculation policy making seeded random decisions: plain steps, rounds of any depth, guess
catch-ups and "no round could pay" verdicts mixed in orders no measured policy would pick (what a
machine's load can make the measured policy decide), so tests cover those mixes deterministically."""
import numpy as np

from hybrid_npu.runtime.speculation import SpecPolicy


class RandomPolicy(SpecPolicy):
    def __init__(self, seed, depth):
        super().__init__(depth)
        self.rng = np.random.default_rng(seed)

    def _choose(self):
        return 0 if self.rng.random() < 0.4 else int(self.rng.integers(1, self.max_depth + 1))

    def guesses_due(self, decoded):
        return decoded > 0 and self.rng.random() < 0.3

    def rounds_can_pay(self):
        return self.rng.random() < 0.8
