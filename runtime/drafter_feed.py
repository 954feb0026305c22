"""The (token, target feature) pairs the drafter has not observed yet: it is shown them in one call
when it is next needed (a round's draft, the policy's guesses, a turn checkpoint), not as they come.

Why lazily: a windowed drafter (runtime/drafters/draft_tree.py, DRAFT_WINDOW) only ever reads the last `window`
stable rows, and each row's K/V depends on its own pair alone (one decoder layer: K/V are
projections of the layer's input, before any attention). So of a long prompt, or of a long stretch
of plain decoding, only the last rows are needed: the older ones are skipped (drafter.skip), never
computed. Observing every prompt token as it was prefilled cost 9-23% of the prefill at 1.5k-12k
tokens on the embedded model, whether or not a round ever ran (docs/speculation.md).

A drafter without `skip`, or with every row visible (window None), is shown every pair: past
FLUSH_AT held pairs the older ones are observed then (a long plain run would otherwise hold a
feature row per token, 12 kB each at the 0.8B target's EAGLE-3 width), the last HOLD_BACK kept for
the catch-up's guesses.
"""
from __future__ import annotations

import numpy as np


FLUSH_AT = 4096   # pairs held for a drafter that reads every row, before the older ones are observed
HOLD_BACK = 64    # pairs a flush leaves for the catch-up (its guesses read the last few)


class DrafterFeed:
    def __init__(self, keep: int | None, owner=None):
        self.keep = keep      # pairs a catch-up must observe (drafter.context_rows); None: all of them
        self.owner = owner    # the drafter they are for
        self.clear()

    def clear(self) -> None:
        self._tokens: list[int] = []
        self._features: list[np.ndarray] = []  # [n, width] blocks, oldest first
        self.skipped = 0                       # pairs dropped: the drafter only advances past them
        self.decoded = 0                       # pairs from plain decode steps since the last catch-up

    def __len__(self) -> int:
        return self.skipped + len(self._tokens)

    def add(self, tokens, features, decoded: bool = False) -> None:
        """Pairs (feature of position t, token t+1); features [n, width], or a tuple of its parts [n,
        w_j] (a plain step's taps as the graph returned them), joined only when the pairs are taken:
        joining each plain step's taps as it came cost ~1% of the embedded model's plain decoding, and
        of a long plain run only the last `keep` pairs are ever taken."""
        self._tokens.extend(int(t) for t in tokens)
        self._features.append(features if isinstance(features, tuple)
                              else np.asarray(features, np.float32).reshape(len(tokens), -1))
        self.decoded += len(tokens) if decoded else 0
        if self.keep is not None and len(self._tokens) > 2 * self.keep:  # bound what is held
            self._trim()
        elif self.keep is None and len(self._tokens) > FLUSH_AT and self.owner is not None:
            self._flush()

    def _trim(self) -> None:
        drop = len(self._tokens) - self.keep
        features = self._rows(drop)
        self._tokens, self._features = self._tokens[drop:], [features]
        self.skipped += drop

    def _flush(self) -> None:
        """Show the owner all but the last HOLD_BACK pairs now: it reads every row, so none may be skipped."""
        cut = len(self._tokens) - HOLD_BACK
        features = self._rows()
        self.owner.observe(self._tokens[:cut], features[:cut])
        self._tokens, self._features = self._tokens[cut:], [features[cut:]]
        self.decoded = min(self.decoded, HOLD_BACK)

    def _rows(self, drop: int = 0) -> np.ndarray:
        """The held features as one [n - drop, width] array, oldest first, without their first `drop`
        rows (whole blocks of those are never joined)."""
        first = 0
        while first < len(self._features) and _rows_in(self._features[first]) <= drop:
            drop -= _rows_in(self._features[first])
            first += 1
        out, run = [], []
        for block in self._features[first:] + [None]:  # a run of parts: each tap's rows joined at once, then the taps
            if isinstance(block, tuple):
                run.append(block)
                continue
            if run:
                out.append(np.concatenate([np.concatenate(part) for part in zip(*run)], axis=-1))
                run = []
            if block is not None:
                out.append(block)
        return (out[0] if len(out) == 1 else np.concatenate(out))[drop:]

    def take(self) -> tuple[int, list[int], np.ndarray]:
        """(pairs to skip, tokens, features [n, width]) to show the drafter, oldest first; empties the feed."""
        if self.keep is not None and len(self._tokens) > self.keep:
            self._trim()
        skipped, tokens = self.skipped, self._tokens
        features = self._rows() if self._features else np.zeros((0, 0), np.float32)
        self.clear()
        return skipped, tokens, features


def _rows_in(block) -> int:
    return len(block[0]) if isinstance(block, tuple) else len(block)


def feed_for(drafter, caps=None) -> DrafterFeed:
    """A feed that skips what `drafter` never reads, when it can skip (caps: its DrafterCaps, where
    the engine found them; else asked here)."""
    from .drafters import Skips

    skips = caps.skips if caps is not None else isinstance(drafter, Skips)
    keep = drafter.context_rows if drafter is not None and skips else None
    return DrafterFeed(keep, drafter)


def catch_up_drafter(drafter, feed: DrafterFeed, guesses: int = 0) -> list[bool]:
    """Show `drafter`, in one call, the pairs it has not observed (`feed`: a prompt's, the plain
    steps'), skipping those it would never read. Returns whether its first guess before each of the
    last `guesses` plain-decoded tokens was the target's token (the policy's acceptance evidence,
    SpecPolicy.record_guesses); each guess is a row of draft logits, so the older ones are not
    computed (the evidence decays guess by guess and would keep ~8 of them)."""
    if not len(feed):
        return []
    decoded = feed.decoded
    skipped, tokens, features = feed.take()
    if skipped:
        drafter.skip(skipped)
    k = min(guesses, decoded, len(tokens))
    if not k:
        drafter.observe(tokens, features)
        return []
    n = len(tokens)
    first = drafter.guess() if k == n and not skipped else None  # the guess it held before tokens[0]
    later = drafter.observe(tokens, features, guesses=k if first is not None else k + 1)
    before = ([first] if first is not None else []) + later[:-1]  # the guesses before tokens[-len(before):]
    return [g == t for g, t in zip(before, tokens[n - len(before):])]
