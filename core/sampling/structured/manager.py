"""The engine's side of structured outputs: which backend compiles a request, the compile pool and its
cache, each sequence's matcher, and the bitmask of each step's grammar rows."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

from pagoda.config import EngineConfig
from pagoda.errors import BackendUnavailable, ConfigError, InvalidRequestError
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling.structured.bitmask import allocate_bitmask
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.sampling.structured.spec import cache_key, check_schema
from pagoda.step import SchedulerOutput

HOOK = "pagoda_structured_output_backends"
# the built-ins ``auto`` tries first, in this order; plugins' backends follow by name
AUTO_ORDER = ("xgrammar", "guidance")
CACHE_SIZE = 512  # compiled grammars kept (least recently asked for go first)


class Compiled:
    """A compiled constraint: the backend that compiled it and what its ``compile`` returned."""

    def __init__(self, backend_name: str, backend: Any, grammar: Any) -> None:
        self.backend_name = backend_name
        self.backend = backend
        self.grammar = grammar

    def new_matcher(self) -> Any:
        matcher = self.backend.new_matcher(self.grammar)
        if not hasattr(matcher, "fork"):  # the optional member's default: a matcher that cannot be copied
            matcher.fork = _cannot_fork
        return matcher


def _cannot_fork() -> None:
    return None


class StructuredOutputs:
    """Compiles constraints off the engine loop (a small thread pool), once per (backend, constraint).

    :meth:`compile` may be called from any thread; :meth:`compiled` and :meth:`fill_bitmask` from the engine's.
    A backend is built the first time a request needs it (its tokenizer tables take a moment).
    """

    def __init__(self, config: EngineConfig, plugin_manager: PluginManager, tokenizer: Any,
                 eos_token_ids: list[int]) -> None:
        self.config = config
        self.pm = plugin_manager
        # the backends read the tokenizer on the compile threads: they get a copy of their own (made on the
        # first compile, in the caller's thread), as fast tokenizers must not be shared between threads
        self._engine_tokenizer = tokenizer
        self.tokenizer: Any = None
        self.eos_token_ids = eos_token_ids
        self.vocab_size = config.model.vocab_size
        self.default_backend = config.structured_outputs_backend
        names = plugin_manager.names(HOOK)
        check_backend_name(config, plugin_manager)
        # auto: the built-ins first, then plugins' backends; one name per factory (aliases skipped)
        ordered = [n for n in AUTO_ORDER if n in names] + [n for n in names if n not in AUTO_ORDER]
        factories, self.auto_candidates = set(), []
        for name in ordered:
            factory = plugin_manager.get(HOOK, name, "structured_outputs_backend").factory
            if factory not in factories:
                factories.add(factory)
                self.auto_candidates.append(name)
        self._backends: dict[str, Any] = {}  # name -> backend, or the BackendUnavailable it raised
        self._lock = threading.Lock()  # the cache; held briefly, also by the server's event loop
        self._build_lock = threading.Lock()  # building a backend (its tokenizer tables take a moment)
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # seconds the last step's fill_bitmask took (0 for a step without grammar rows)
        self.last_fill_seconds = 0.0

    # ---- compiling -------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the :class:`Compiled` constraint (done at once when cached); its exception is an
        InvalidRequestError for a constraint no backend compiles or a backend name that does not exist."""
        name = self._backend_name(spec)
        key = (name,) + cache_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self.tokenizer = copy.deepcopy(self._engine_tokenizer)
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pagoda-grammar")
            future = self._pool.submit(self._compile, name, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(key, f))
        return future

    def compiled(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled constraint, waiting for it if it is still compiling; raises InvalidRequestError."""
        return self.compile(spec).result()

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        key = (self._backend_name(spec),) + cache_key(spec)
        with self._lock:
            future = self._cache.get(key)
        return future is not None and future.done() and future.exception() is None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self, key: tuple, future: concurrent.futures.Future) -> None:
        # a failed compile is not kept: the same constraint is tried (and refused) again when sent again
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def _backend_name(self, spec: StructuredOutputsParams) -> str:
        name = spec.backend or self.default_backend
        if name != "auto" and name not in self.pm.names(HOOK):
            raise InvalidRequestError(
                f"unknown structured-output backend {name!r} in structured_outputs.backend; known: auto, "
                + ", ".join(self.pm.names(HOOK)), param="structured_outputs.backend")
        return name

    def _compile(self, name: str, spec: StructuredOutputsParams) -> Compiled:
        if spec.json is not None:
            check_schema(spec)
        if name != "auto":
            try:
                backend = self._backend(name)
            except BackendUnavailable as exc:
                raise InvalidRequestError(f"structured-output backend {name!r} cannot run here: {exc}",
                                          param="structured_outputs.backend") from None
            reason = backend.supports(spec)
            if reason is not None:
                raise InvalidRequestError(f"the {name} structured-output backend cannot serve this request: "
                                          f"{reason}", param="structured_outputs")
            return Compiled(name, backend, backend.compile(spec))
        first_error: Optional[InvalidRequestError] = None
        reasons = []
        for candidate in self.auto_candidates:
            try:
                backend = self._backend(candidate)
            except BackendUnavailable as exc:
                reasons.append(f"{candidate}: {exc}")
                continue
            reason = backend.supports(spec)
            if reason is not None:
                reasons.append(f"{candidate}: {reason}")
                continue
            try:
                return Compiled(candidate, backend, backend.compile(spec))
            except InvalidRequestError as exc:  # another backend may read what this one refuses
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        raise InvalidRequestError("no structured-output backend can serve this request (" + "; ".join(reasons)
                                  + ")", param="structured_outputs")

    def _backend(self, name: str) -> Any:
        with self._build_lock:
            backend = self._backends.get(name)
            if backend is None:
                factory = self.pm.get(HOOK, name, "structured_outputs_backend").factory
                try:
                    backend = factory(self.config.model, self.tokenizer, self.eos_token_ids)
                except BackendUnavailable as exc:
                    backend = exc
                self._backends[name] = backend
        if isinstance(backend, BackendUnavailable):
            raise backend
        return backend

    # ---- each step ---------------------------------------------------------------

    def fill_bitmask(self, sched: SchedulerOutput) -> None:
        """Fill ``sched.grammar_bitmask``: one row per request of the step that samples under a grammar, the
        tokens allowed after its committed tokens. A request with draft slots gets the row of its first scored
        position; the runner fills the rows after each draft once the drafts are known
        (:func:`pagoda.sampling.structured.speculative.fill_draft_rows`)."""
        rows = [i for i, r in enumerate(sched.requests) if r.grammar is not None
                and sched.num_computed_before[i] + sched.num_real_tokens(i) == r.num_tokens]
        if not rows:
            sched.grammar_rows, sched.grammar_bitmask, self.last_fill_seconds = [], None, 0.0
            return
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            sched.requests[i].grammar.fill_bitmask(bitmask, j)
        sched.grammar_rows, sched.grammar_bitmask = rows, bitmask
        self.last_fill_seconds = time.perf_counter() - start


def check_backend_name(config: EngineConfig, plugin_manager: PluginManager) -> None:
    """ConfigError naming the known backends when ``structured_outputs_backend`` names none of them."""
    name = config.structured_outputs_backend
    if name != "auto" and name not in plugin_manager.names(HOOK):
        raise ConfigError(f"unknown structured-output backend {name!r} for structured_outputs_backend; known: auto, "
                          + ", ".join(plugin_manager.names(HOOK)))
