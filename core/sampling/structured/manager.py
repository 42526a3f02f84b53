"""The engine's side of structured outputs: which backend compiles a request, the compile pool and its
cache, each sequence's matcher, and the bitmask of each step's grammar rows."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from pagoda.config import EngineConfig
from pagoda.errors import BackendUnavailable, ConfigError, InvalidRequestError
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling.structured.after_reasoning import is_waiting
from pagoda.sampling.structured.bitmask import allocate_bitmask, allowed_tokens
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.sampling.structured.compile_process import CompileProcessFailed, CompileStopped, stopped_error
from pagoda.sampling.structured.spec import cache_key, check_schema, param_of
from pagoda.step import SchedulerOutput

HOOK = "pagoda_structured_output_backends"
# the built-ins ``auto`` tries first, in this order; plugins' backends follow by name
AUTO_ORDER = ("xgrammar", "guidance")
NUM_COMPILE_THREADS = 2  # compiles run at once (each xgrammar compile in a process of its own)


class Compiled:
    """A compiled constraint: the backend that compiled it and what its ``compile`` returned."""

    def __init__(self, backend_name: str, backend: Any, grammar: Any, num_chars: int) -> None:
        self.backend_name = backend_name
        self.backend = backend
        self.grammar = grammar
        # what it holds in memory (xgrammar tells; else the constraint's length stands in)
        self.num_bytes = int(getattr(grammar, "memory_size_bytes", 0) or num_chars)

    def new_matcher(self) -> Any:
        matcher = self.backend.new_matcher(self.grammar)
        if not hasattr(matcher, "fork"):  # the optional member's default: a matcher that cannot be copied
            matcher.fork = _cannot_fork
        return matcher


def _cannot_fork() -> None:
    return None


class _Job:
    """One constraint being compiled, for every request waiting for it (each through a future of its own)."""

    def __init__(self, key: tuple, name: str, spec: StructuredOutputsParams, owner: str, num_chars: int) -> None:
        self.key, self.name, self.spec, self.owner, self.num_chars = key, name, spec, owner, num_chars
        self.waiters: set[concurrent.futures.Future] = set()
        self.is_abandoned = False  # every waiter cancelled (client gone) before the compile finished


class StructuredOutputs:
    """Compiles constraints off the engine loop, once per (backend, constraint), bounded and in fair turns.

    A constraint longer than ``structured_outputs_max_chars`` is refused at once; a compile stops after
    ``structured_outputs_compile_timeout`` seconds (a 400), and as soon as no request waits for it any more
    (its clients gone). Compiles wait in one queue per owner (the server's tenant): the compile threads take
    the owners in turn, each owner's shortest constraint first, so one owner's expensive schemas delay
    another's by at most one compile timeout. Compiled grammars are kept up to
    ``structured_outputs_cache_bytes``, the least recently asked for dropped first.

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
        self.max_chars = config.structured_outputs_max_chars
        self.compile_timeout = config.structured_outputs_compile_timeout
        self.max_cache_bytes = config.structured_outputs_cache_bytes
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
        # the cache, the jobs and the queues; held briefly, also by the server's event loop
        self._lock = threading.Condition()
        self._build_lock = threading.Lock()  # building a backend (its tokenizer tables take a moment)
        self._cache: OrderedDict[tuple, Compiled] = OrderedDict()
        self._num_cache_bytes = 0
        self._jobs: dict[tuple, _Job] = {}  # key -> its job, queued or compiling
        self._queues: OrderedDict[str, list[_Job]] = OrderedDict()  # owner -> its queued jobs; owners in turn
        self._threads: list[threading.Thread] = []
        self._stop = False
        # seconds the last step's fill_bitmask took (0 for a step without grammar rows)
        self.last_fill_seconds = 0.0

    # ---- compiling -------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams, owner: Optional[str] = None) -> concurrent.futures.Future:
        """A future of the :class:`Compiled` constraint (done at once when cached), the caller's own: cancelling
        it tells the compile one waiter fewer. Its exception is an InvalidRequestError for a constraint that
        does not compile (or not in time). Raises InvalidRequestError at once for a backend name that does not
        exist or a constraint longer than the limit. ``owner``: whose turn the compile takes (None: one shared
        owner)."""
        name = self._backend_name(spec)
        key = (name,) + cache_key(spec)
        num_chars = len(key[-1])
        if num_chars > self.max_chars:
            raise InvalidRequestError(
                f"{param_of(spec)} is {num_chars} characters (as compact JSON for a schema or choice), more than "
                f"this server compiles ({self.max_chars}); send a smaller one, or raise the server's "
                "--structured-outputs-max-chars", param=param_of(spec))
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                waiter.set_result(compiled)
                return waiter
            job = self._jobs.get(key)
            if job is None:
                if self.tokenizer is None:
                    self.tokenizer = copy.deepcopy(self._engine_tokenizer)
                job = self._jobs[key] = _Job(key, name, spec, owner or "", num_chars)
                self._queues.setdefault(job.owner, []).append(job)
                self._start_threads()
                self._lock.notify()
            job.waiters.add(waiter)
        waiter.add_done_callback(lambda f: f.cancelled() and self._leave(job, f))
        return waiter

    def compiled(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled constraint, waiting for it if it is still compiling; raises InvalidRequestError."""
        return self.compile(spec).result()

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        key = (self._backend_name(spec),) + cache_key(spec)
        with self._lock:
            return key in self._cache

    @property
    def num_cache_bytes(self) -> int:
        return self._num_cache_bytes

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            for job in self._jobs.values():
                job.is_abandoned = True
            self._lock.notify_all()
        for backend in list(self._backends.values()):
            if hasattr(backend, "shutdown"):
                backend.shutdown()

    def _leave(self, job: _Job, waiter: concurrent.futures.Future) -> None:
        with self._lock:
            job.waiters.discard(waiter)
            if not job.waiters:
                job.is_abandoned = True

    def _start_threads(self) -> None:
        while len(self._threads) < NUM_COMPILE_THREADS:
            thread = threading.Thread(target=self._run_jobs, name="pagoda-grammar", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _next_job(self) -> Optional[_Job]:
        """The shortest queued job of the owner whose turn it is (the owner then goes last); None on shutdown."""
        with self._lock:
            while not self._queues and not self._stop:
                self._lock.wait()
            if self._stop:
                return None
            owner, queue = next(iter(self._queues.items()))
            job = min(queue, key=lambda j: j.num_chars)
            queue.remove(job)
            del self._queues[owner]
            if queue:
                self._queues[owner] = queue
            return job

    def _run_jobs(self) -> None:
        while (job := self._next_job()) is not None:
            result: Any = None
            error: Optional[BaseException] = None
            if not job.is_abandoned:
                try:
                    result = self._compile(job, lambda seconds: job.is_abandoned or seconds > self.compile_timeout)
                except CompileStopped:
                    error = stopped_error(param_of(job.spec), self.compile_timeout)
                except (InvalidRequestError, CompileProcessFailed) as exc:
                    error = exc  # (a compile process that could not start is the server's failure, a 500)
                except Exception as exc:  # noqa: BLE001 - a backend's bug: the request's error, not the thread's end
                    error = InvalidRequestError(f"{param_of(job.spec)} could not be compiled: "
                                                f"{type(exc).__name__}: {exc}", param=param_of(job.spec))
            self._finish(job, result, error)

    def _finish(self, job: _Job, result: Optional[Compiled], error: Optional[BaseException]) -> None:
        with self._lock:
            del self._jobs[job.key]
            waiters = list(job.waiters)
            # a failed compile is not kept: the same constraint is tried (and refused) again when sent again
            if result is not None and result.num_bytes <= self.max_cache_bytes:
                self._cache[job.key] = result
                self._num_cache_bytes += result.num_bytes
                while self._num_cache_bytes > self.max_cache_bytes:
                    self._num_cache_bytes -= self._cache.popitem(last=False)[1].num_bytes
        for waiter in waiters:
            try:
                if result is not None:
                    waiter.set_result(result)
                else:
                    waiter.set_exception(error or CompileStopped())
            except concurrent.futures.InvalidStateError:
                pass  # cancelled meanwhile

    def _backend_name(self, spec: StructuredOutputsParams) -> str:
        name = spec.backend or self.default_backend
        if name != "auto" and name not in self.pm.names(HOOK):
            raise InvalidRequestError(
                f"unknown structured-output backend {name!r} in structured_outputs.backend; known: auto, "
                + ", ".join(self.pm.names(HOOK)), param="structured_outputs.backend")
        return name

    def _compile(self, job: _Job, should_stop: Callable[[float], bool]) -> Compiled:
        name, spec = job.name, job.spec
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
            return self._checked(Compiled(name, backend, _compile_with(backend, spec, should_stop), job.num_chars),
                                 spec)
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
                return self._checked(Compiled(candidate, backend, _compile_with(backend, spec, should_stop),
                                              job.num_chars), spec)
            except InvalidRequestError as exc:  # another backend may read what this one refuses
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        raise InvalidRequestError("no structured-output backend can serve this request (" + "; ".join(reasons)
                                  + ")", param="structured_outputs")

    def _checked(self, compiled: Compiled, spec: StructuredOutputsParams) -> Compiled:
        """``compiled``, if its grammar lets a sequence start: a constraint no text can meet (a schema that is
        only a reference to itself, say) is refused here rather than failing the request's first step."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        matcher = compiled.new_matcher()
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, self.vocab_size)[0].nonzero()
        # a grammar with no text (``root ::= root``) may still offer the end token, and then refuse it
        if not len(allowed) or not matcher.accept_tokens([int(allowed[0])]):
            raise InvalidRequestError(f"no output can satisfy {param_of(spec)}: its grammar accepts no first "
                                      "token (a schema that only refers to itself, or a grammar rule that only "
                                      "expands to itself, has no text); send a constraint some text meets",
                                      param=param_of(spec))
        return compiled

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
        tokens allowed after its committed tokens (none for one still thinking before its grammar starts:
        :mod:`pagoda.sampling.structured.after_reasoning`). A request with draft slots gets the row of its first scored
        position; the runner fills the rows after each draft once the drafts are known
        (:func:`pagoda.sampling.structured.speculative.fill_draft_rows`)."""
        rows = [i for i, r in enumerate(sched.requests) if r.grammar is not None and not is_waiting(r.grammar)
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


def _compile_with(backend: Any, spec: StructuredOutputsParams, should_stop: Callable[[float], bool]) -> Any:
    """``backend.compile_until`` where the backend offers it (its compile can be stopped: ``should_stop(seconds
    spent compiling)`` says when); else its ``compile``, which runs to its end."""
    if hasattr(backend, "compile_until"):
        return backend.compile_until(spec, should_stop)
    return backend.compile(spec)
