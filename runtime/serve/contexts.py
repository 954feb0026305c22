"""The conversations a server keeps between requests: up to N contexts on one model, least
recently used first out. A request goes to whichever of them keeps the most of its rendered prompt
(the prefix it shares, or its latest turn checkpoint before the point where they part); when none
keeps any, to an empty one or a new one. The others stay as they are.

Memory: the model's plan covers all its contexts together (Model.room_for), so before a request
runs, the least recently used other contexts are dropped until the request's own K/V fits beside
what the rest hold.
"""
from __future__ import annotations

from hybrid_npu.errors import UserError


class ServedContexts:
    def __init__(self, model, limit: int = 4):
        self.model, self.limit = model, max(int(limit), 1)
        self.contexts: list = []  # least recently used first

    def take_best(self, prompt_ids: list[int], need_tokens: int):
        """The context for a request of prompt_ids that may grow to need_tokens, made the most
        recently used; others are dropped as its memory needs. Context.resume(prompt_ids) then
        keeps what it can."""
        scores = [c.resumable(prompt_ids) for c in self.contexts]
        best = max(range(len(scores)), key=scores.__getitem__, default=None)
        if best is not None and scores[best] > 0:
            chosen = self.contexts.pop(best)
        else:
            empty = next((i for i, c in enumerate(self.contexts) if not c.context_ids()), None)
            chosen = self.contexts.pop(empty) if empty is not None else self._new()
        while self.contexts and chosen.max_context < need_tokens:
            self.contexts.pop(0)
        self.contexts.append(chosen)
        return chosen

    def _new(self):
        del self.contexts[: max(len(self.contexts) - self.limit + 1, 0)]
        while True:
            try:
                return self.model.new_context()
            except UserError:  # the plan holds no more: the least recently used goes first
                if not self.contexts:
                    raise
                self.contexts.pop(0)
