"""Engines a test module shares, built on demand and released when done, so a module holds one at a time and
leaves nothing behind in the worker."""

from __future__ import annotations

import gc
from typing import Callable, Optional

from pagoda import LLM


def release(llm: Optional[LLM]) -> None:
    """Stops ``llm``'s engine (its grammar compiler's and executor's processes); the caller drops its last
    reference, and a collection frees the cycles an engine's parts form (runner, observers, hooks)."""
    if llm is not None:
        llm.engine.shutdown()
    gc.collect()


class OneEngine:
    """The engine of each kind from ``builders``, at most one alive: asking for another kind releases the one
    built before. Ordering a module's tests by the engine they use keeps the rebuilds few."""

    def __init__(self, builders: dict[str, Callable[[], LLM]]) -> None:
        self.builders = builders
        self.kind: Optional[str] = None
        self.llm: Optional[LLM] = None

    def get(self, kind: str) -> LLM:
        if kind != self.kind:
            self.close()
            self.llm = self.builders[kind]()
            self.kind = kind
        return self.llm

    def close(self) -> None:
        llm, self.llm, self.kind = self.llm, None, None
        release(llm)
        del llm
        gc.collect()
