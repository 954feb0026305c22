"""Turn checkpoints: copies of the recurrent state at chosen positions, so a conversation whose next
rendered prompt departs from the context (Qwen3.5's template drops earlier turns' <think> blocks)
resumes from the nearest earlier position instead of prefilling everything again.

A GDN layer's state cannot be rewound, so a checkpoint copies it (conv window + delta-rule matrix:
cfg.state_bytes() each). Full-attention K/V needs no copy: rows [0, position) are never rewritten
while the context grows, so restoring position p just drops the rows past p. Restoring also drops
every checkpoint past p, since the rows they would need get overwritten next.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .state import State

DEFAULT_MAX_CHECKPOINTS = 8  # two a turn (where the next render departs, and the prompt's end): 4 turns


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Checkpoint:
    position: int
    conv: dict[int, np.ndarray]       # GDN layer -> [conv_dim, K-1]
    recurrent: dict[int, np.ndarray]  # GDN layer -> [Hv, Dk, Dv] fp32
    tap: np.ndarray | None = None     # the drafter's pending feature (the last token's taps), if any
    drafter_length: int | None = None  # drafter K/V rows stable at this position

    @classmethod
    def take(cls, state: State, tap=None, drafter_length=None) -> "Checkpoint":
        return cls(state.position, {i: layer.conv.copy() for i, layer in state.gdn.items()},
                   {i: layer.recurrent.copy() for i, layer in state.gdn.items()},
                   None if tap is None else np.array(tap), drafter_length)

    def restore(self, state: State) -> None:
        """Put `state` back to this position (it must still hold the K/V rows [0, position))."""
        if state.position < self.position or len(state.tokens) < self.position:
            raise ValueError(f"checkpoint at {self.position} is past the state's {state.position} tokens")
        for i, layer in state.gdn.items():
            layer.conv[...] = self.conv[i]
            layer.recurrent[...] = self.recurrent[i]
        state.position = self.position
        del state.tokens[self.position:]


class Checkpoints:
    """At most `limit` checkpoints in position order; the oldest go first."""

    def __init__(self, limit: int = DEFAULT_MAX_CHECKPOINTS):
        self.limit = max(int(limit), 0)
        self.items: list[Checkpoint] = []

    def __len__(self) -> int:
        return len(self.items)

    def positions(self) -> list[int]:
        return [c.position for c in self.items]

    def add(self, checkpoint: Checkpoint) -> None:
        if self.limit == 0:
            return
        self.items = [c for c in self.items if c.position != checkpoint.position] + [checkpoint]
        self.items.sort(key=lambda c: c.position)
        del self.items[: max(len(self.items) - self.limit, 0)]

    def latest_at_or_before(self, position: int) -> Checkpoint | None:
        return next((c for c in reversed(self.items) if c.position <= position), None)

    def drop_after(self, position: int) -> None:
        self.items = [c for c in self.items if c.position <= position]

    def clear(self) -> None:
        self.items = []

    def forget_drafter(self) -> None:
        """The drafter started over (it served another context): its lengths here no longer hold."""
        for checkpoint in self.items:
            checkpoint.drafter_length = None


def resumable(tokens: list[int], checkpoints: list[Checkpoint], prompt_ids: list[int]) -> int:
    """How many of prompt_ids a context of `tokens` with these checkpoints keeps (Context.resume's
    rule): all of it when it is a prefix of the prompt, else its latest checkpoint before the point
    where the two part, leaving at least one prompt token to prefill."""
    common = common_prefix(tokens, prompt_ids)
    if common == len(tokens) < len(prompt_ids):
        return common
    limit = min(common, len(prompt_ids) - 1)
    return max((c.position for c in checkpoints if c.position <= limit), default=0)
