"""One model and one conversation on it: the single-conversation API npu-chat, npu-summarize,
npu-bench and the scripts use (`hybrid_npu.load_engine`). What it does is the model's
(runtime/model.py) and its context's (runtime/context.py); it adds `generate`, which collects
generation.stream, and `last_stats`, the last call's stats. A program that holds several
conversations (npu-serve) uses the model and its contexts directly.

Attributes it does not define are the context's where the context has them (state, pending,
checkpoints, resume, save_state, ...), else the model's (config, tokenizer, drafter, draft_shape,
memory, ...); setting one sets the context's data (state, pending, ...) or else the model's.
"""
from __future__ import annotations

from contextlib import closing
from typing import Callable

import numpy as np

from .context import Context
from .generation import stream
from .model import Model
from .sampling import Sampler

_OWN = ("model", "context", "last_stats")


class Engine:
    def __init__(self, model: Model):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "context", model.new_context())
        object.__setattr__(self, "last_stats", {})

    def __getattr__(self, name: str):
        context = self.__dict__["context"]
        if hasattr(type(context), name) or name in context.__dict__:
            return getattr(context, name)
        return getattr(self.__dict__["model"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in _OWN or hasattr(type(self), name):  # its own (a test wraps generate)
            object.__setattr__(self, name, value)
        elif name in self.context.__dict__:  # its data: state, pending, checkpoints, spec_stats, ...
            setattr(self.context, name, value)
        elif hasattr(type(self.model), name) or name in self.model.__dict__:
            setattr(self.model, name, value)
        else:
            raise AttributeError(f"Engine has no attribute {name!r} (nor its model or context)")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = True,
                 on_token: Callable[[int], None] | None = None, append: bool = False,
                 progress: Callable[[int, int], None] | None = None, speculative: bool | None = None,
                 should_stop: Callable[[], bool] | None = None, checkpoint_at=()) -> list[int]:
        """Prefill the prompt, then decode up to max_new_tokens; returns the new ids (generation.stream's
        arguments; append=True continues the conversation). temperature/top_k/top_p left None take
        the model's defaults (sampling_defaults: its generation_config; greedy unless that says
        do_sample); temperature 0 is greedy. last_stats then describes this call."""
        sampler = Sampler.from_defaults(self.model.sampling_defaults, temperature, top_k, top_p, seed, max_new_tokens)
        tokens = stream(self.model, self.context, prompt_ids, sampler, max_new_tokens, stop_at_eos=stop_at_eos,
                        append=append, speculative=speculative, progress=progress, should_stop=should_stop,
                        checkpoint_at=checkpoint_at)
        new: list[int] = []
        try:
            with closing(tokens):
                for t in tokens:
                    new.append(t)
                    if on_token:
                        on_token(t)
        finally:
            if tokens.response is not None:
                self.last_stats = tokens.response.stats
        return new

    def prefill_logits(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits [vocab] after the last prompt token, from a fresh state; last_stats then describes
        this scoring pass."""
        logits, self.last_stats = self.context.prefill_logits(prompt_ids)
        return logits


__all__ = ["Engine", "Context", "Model"]
