"""Token choice from logits: greedy, or temperature → top-k → top-p (transformers' order), sampled
by a Gumbel-max keyed by (seed, position) (docs/reproducibility.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hybrid_npu.errors import UserError

# A temperature that small divides logits into overflow (5e-324 gives inf, then NaN probabilities);
# below it sampling is greedy in all but name, so 0 says it.
MIN_TEMPERATURE = 1e-3


def check_sampling(max_new_tokens, temperature, top_k=0, top_p=1.0, seed=None, flags: bool = False) -> None:
    """The one set of rules for generation settings, for the API (engine.generate) and the CLIs
    alike; flags=True names them as the CLIs spell them (--top-p) instead of as keywords (top_p=).
    temperature, top_k and top_p may be None: the model's default (Engine.sampling_defaults)."""
    def name(key: str) -> str:
        return f"--{key.replace('_', '-')} " if flags else f"{key}="

    def number(x) -> bool:
        return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

    def integer(x) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not integer(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"{name('max_new_tokens')}{max_new_tokens!r}: give a whole number of at least 1")
    if temperature is not None and (not number(temperature) or not math.isfinite(temperature) or temperature < 0
                                    or 0 < temperature < MIN_TEMPERATURE):
        raise UserError(f"{name('temperature')}{temperature!r}: give 0 (greedy) or a finite number of at least "
                        f"{MIN_TEMPERATURE:g}")
    if top_k is not None and (not integer(top_k) or top_k < 0):
        raise UserError(f"{name('top_k')}{top_k!r}: give 0 (off) or a whole number above 0")
    if top_p is not None and (not number(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1):
        raise UserError(f"{name('top_p')}{top_p!r}: give a value in (0, 1]")
    if seed is not None and (not integer(seed) or seed < 0):
        raise UserError(f"{name('seed')}{seed!r}: give a whole number of 0 or more")


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution actually sampled from (float64). Used by plain and speculative sampling alike."""
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < top_p  # smallest prefix whose mass reaches top_p (always keeps the top token)
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def model_defaults(generation: dict) -> dict:
    """temperature/top_k/top_p when the caller gives none, from the model's generation_config
    (as recorded in the manifest): greedy unless it says do_sample, as transformers generates."""
    sample = bool(generation.get("do_sample", False))
    return {"temperature": float(generation.get("temperature", 1.0)) if sample else 0.0,
            "top_k": int(generation.get("top_k", 0)), "top_p": float(generation.get("top_p", 1.0))}


# How many positions' noise a Sampler keeps: a speculative round draws each drafted position's noise
# while drafting and reads it again while verifying (a chain is at most a few dozen levels deep).
NOISE_KEPT = 64


@dataclass
class Sampler:
    """How tokens are chosen from logits: temperature (0 = greedy), top_k (0 = off), top_p, seed.

    A sampled token is the Gumbel-max choice argmax_x p(x) / E_x over the filtered distribution p,
    with E_x ~ Exp(1) drawn for the token's absolute position in the context (the number of tokens
    before it: prompt, earlier turns and reply) from a Philox stream keyed by (seed, position) —
    docs/reproducibility.md. So the token at a position is a function of its logits and
    (seed, position) alone, whichever way it was reached: a plain step, or a speculative round
    that verifies a draft by checking each drafted token is that choice. Without a seed the key is
    fresh entropy, drawn once per Sampler."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    key: int = field(init=False, repr=False)
    _noise: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        self.key = int(np.random.SeedSequence().entropy) if self.seed is None else int(self.seed)

    @classmethod
    def from_defaults(cls, defaults: dict, temperature=None, top_k=None, top_p=None, seed=None,
                      max_new_tokens: int = 1) -> "Sampler":
        """The settings given, checked (check_sampling, with the generation's max_new_tokens named
        first), the model's defaults (model_defaults) for those left None."""
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        return cls(defaults["temperature"] if temperature is None else temperature,
                   defaults["top_k"] if top_k is None else top_k,
                   defaults["top_p"] if top_p is None else top_p, seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def noise(self, position: int, size: int) -> np.ndarray:
        """E ~ Exp(1) for token ids 0..size-1 at `position`: -log(1 - U), U uniform doubles from Philox
        keyed by SeedSequence([key, position]) (a stream whose first n numbers do not depend on how
        many are drawn, so a drafter's smaller vocabulary reads the same numbers)."""
        e = self._noise.get(position)
        if e is None or len(e) < size:
            rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.key, int(position)])))
            e = self._noise[position] = -np.log1p(-rng.random(size))
            if len(self._noise) > NOISE_KEPT:
                del self._noise[min(self._noise)]
        return e[:size]

    def choose(self, logits: np.ndarray, position: int) -> int:
        """The token at `position` given the target's logits there."""
        if self.greedy:
            return int(np.argmax(logits))
        p = filtered_probs(logits, self.temperature, self.top_k, self.top_p)
        return int(np.argmax(p / self.noise(position, p.size)))  # argmax log p + Gumbel

    def draft_choice(self, logits: np.ndarray, position: int, target_ids: np.ndarray) -> int:
        """A drafter's pick at `position` from its own logits over `target_ids`: the same Gumbel-max
        with the same noise, so it agrees with the target's choice as often as the two distributions
        allow (coupled drafting, Daliri, Musco and Suresh 2024); an index into logits. Greedy: argmax."""
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        return int(np.argmax(z - np.log(self.noise(position, int(target_ids.max()) + 1)[target_ids])))
