"""The graphs a loaded model runs, opened when first needed: prefill and decode at load (a broken
export fails there), the rest on first use or in the background ahead of it."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .pipeline import Pipeline


class LazyPipelines(dict):
    """Graph name -> Pipeline. Prefill and decode open at load (a broken export fails there); the
    rest on first use: the verify graph only once speculation runs, since a quantised export's
    session holds its own prepacked copy of the weights (0.8B int4: ~0.8 GB per session)."""

    def __init__(self, open_one: Callable[[str], Pipeline], names, eager: tuple[str, ...]):
        super().__init__()
        self._open, self._names = open_one, set(names)
        self._opening: dict[str, Future] = {}  # prefetch: name -> its session, still being opened
        for name in eager:
            self[name] = open_one(name)

    def prefetch(self, name: str) -> None:
        """Start opening `name` in the background; its first lookup waits for it (and raises what
        opening raised). Building a session is ORT's graph optimisation and, for a quantised
        export, the weights' prepacking: the embedded model's verify session took 275 ms, the
        0.8B int4 one 2.4 s, inside the first reply's first round (docs/speculation.md)."""
        if name in self or name in self._opening or name not in self._names:
            return
        # the executor's worker is joined at exit (a process that exited mid-build segfaulted)
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"open-{name}")
        self._opening[name] = pool.submit(self._open, name)
        pool.shutdown(wait=False)

    def ready(self, name: str) -> bool:
        """Whether looking `name` up now returns at once rather than waiting for its prefetch (a name
        never prefetched counts as ready: its lookup opens it, as it always did)."""
        if name in self:
            return True
        opening = self._opening.get(name)
        return opening is None or opening.done()

    def __missing__(self, name: str) -> Pipeline:
        if name not in self._names:
            raise KeyError(name)
        opening = self._opening.pop(name, None)
        if opening is not None:
            self[name] = got = opening.result()
            return got
        self[name] = pipeline = self._open(name)
        return pipeline
