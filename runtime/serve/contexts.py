"""The conversations a server keeps between requests: the one in the engine, and up to N more held
aside (Engine.detach), least recently used first out. A request goes to whichever of them keeps the
most of its rendered prompt (the prefix it shares, or its latest turn checkpoint before the point
where they part); the others stay as they are.

Memory: the engine's plan covers one context of max_context tokens. Held contexts take from that,
so before a request runs, the least recently used ones are dropped until the held bytes plus the
request's own K/V fit what the plan leaves after weights, GDN state and checkpoints.
"""
from __future__ import annotations

from ..turn_checkpoints import HeldContext


class ServedContexts:
    def __init__(self, engine, limit: int = 4):
        self.engine, self.limit = engine, max(int(limit), 0)
        self.held: list[HeldContext] = []  # least recently used first

    def _free_bytes(self) -> int:
        m = self.engine.memory
        return m.budget_bytes - m.weights_bytes - m.state_bytes - m.checkpoint_bytes

    def held_bytes(self) -> int:
        return sum(h.nbytes(self.engine.memory.state_bytes) for h in self.held)

    def take_best(self, prompt_ids: list[int], need_tokens: int) -> int:
        """Put the context that keeps the most of prompt_ids into the engine (the engine's own
        stays when none does better and it keeps some; one that keeps nothing is held aside, since
        it belongs to another conversation); drop held ones the request's memory needs. Returns how
        many prompt tokens the engine will keep (Engine.resume then does it)."""
        live = self.engine.resumable(prompt_ids)
        scores = [h.resumable(prompt_ids) for h in self.held]
        best = max(range(len(scores)), key=scores.__getitem__, default=None)
        if best is not None and scores[best] > live:
            chosen = self.held.pop(best)
            self._hold(self.engine.detach())
            self.engine.attach(chosen)
            live = scores[best]
        elif live == 0:  # another conversation: keep this one aside instead of starting over on it
            self._hold(self.engine.detach())
        per_token = self.engine.memory.kv_bytes_per_token
        while self.held and self.held_bytes() + need_tokens * per_token > self._free_bytes():
            self.held.pop(0)
        return live

    def _hold(self, held: HeldContext) -> None:
        if self.limit == 0 or not held.tokens:
            return
        self.held.append(held)
        del self.held[: max(len(self.held) - self.limit, 0)]
