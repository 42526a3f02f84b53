"""AsyncLLMEngine: drives an LLMEngine from a background thread and streams outputs to asyncio code.

The engine thread owns the LLMEngine (which is not thread-safe): requests,
aborts and tokenizer calls reach it as commands run between two steps. The
engine thread only schedules, runs the model and commits: each step's new
tokens (:class:`~pagoda.outputs.EngineOutput`, no text) are handed to the event
loop in one call, and each request's reader makes its outputs from them (text,
decoded logprobs) with the async engine's own tokenizer. A slow reader gets the
tokens of several steps in one output.

Failure model: the engine isolates a fault in a step's execution itself (a
request that fails alone ends with an error, the others go on). When a step
fails for every request in it, ``step()`` raises :class:`StepFailedError`
with the step rolled back; those requests are failed with
:class:`EngineStepError`, the others go on. Any other exception from ``step()``
fails the running requests. After ``max_consecutive_failures`` such failures
in a row the engine checks itself (:meth:`LLMEngine.self_check`: one token of
a one-token prompt through the model): if that works, the failures were the
requests' own and serving goes on; if it fails, or when the clean-up itself
fails, the engine is dead: every request fails with :class:`EngineDeadError`
and ``is_healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import math
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Optional

from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.metrics import ServingStats
from pagoda.engine.request_stream import RequestStream, _Stream, request_cost_tokens
from pagoda.errors import InvalidRequestError, PagodaError, StepFailedError
from pagoda.execution.lora_request import LoRARequest
from pagoda.outputs import EngineOutput, OutputProcessor, RequestOutputKind
from pagoda.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineOverloadedError", "EngineStepError", "RequestStream",
           "request_cost_tokens"]

logger = logging.getLogger("pagoda")


class EngineOverloadedError(PagodaError):
    """The waiting queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStepError(PagodaError):
    """The engine raised while this request was running; the request is failed, the engine goes on."""


class EngineDeadError(PagodaError):
    """The engine loop stopped (it could not recover from an error, or it was shut down)."""


_IDLE_GATHER_GAPS = 8  # the longest wait for arrivals after waking from idle, in --idle-gather-ms gaps


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a thread while requests are pending; asyncio callers stream results."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: Optional[int] = None,
                 max_consecutive_failures: int = 3, idle_gather_ms: Optional[float] = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests or engine.config.scheduler.max_waiting_requests
        self.max_waiting_tokens = engine.config.scheduler.max_waiting_tokens
        self.max_waiting_per_tenant = engine.config.scheduler.max_waiting_per_tenant
        self.max_consecutive_failures = max_consecutive_failures
        # waking from idle, wait while requests keep arriving at most this far apart (seconds; 0: not at all)
        if idle_gather_ms is None:
            idle_gather_ms = engine.config.scheduler.idle_gather_ms
        self.idle_gather_s = idle_gather_ms / 1000.0
        self.model_name = engine.config.model.served_model_name
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # the output side of every request (text, logprobs): on the event loop, with a tokenizer of its own
        self.output_processor = OutputProcessor(copy.deepcopy(engine.tokenizer))
        # the time that output side takes (and the server's response encoding), for /metrics
        self.serving_stats = ServingStats()
        # sequences queued as commands but not yet in the scheduler: submitted - added (one writer each)
        self._num_submitted_seqs = 0
        self._num_added_seqs = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._accepting = True
        self.dead_reason: Optional[str] = None
        self.num_failed_steps = 0
        self._consecutive_failures = 0

    # ---- lifecycle ---------------------------------------------------------------

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (the running one by default)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return (self._thread is not None and self._thread.is_alive() and self.dead_reason is None
                and self._accepting)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float = 0.0) -> None:
        """Stop accepting; wait up to ``timeout`` s for in-flight requests, then fail the rest (their streams
        end with an error, their KV blocks are freed). The engine thread keeps running."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("shutting down with %d unfinished requests; failing them", len(self._streams))
            ids = list(self._streams)
            self._fail_streams(ids, EngineDeadError("the server is shutting down; the request was not finished"))
            self._submit(lambda: self.engine.abort_request(ids))

    async def shutdown(self, timeout: float = 0.0) -> None:
        """:meth:`drain`, then stop the engine thread."""
        await self.drain(timeout)
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.engine.shutdown()

    # ---- requests ----------------------------------------------------------------

    async def run_in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between steps (tokenizer calls, engine queries)."""
        self._check_alive()
        return await asyncio.wrap_future(self._submit(fn))

    def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                 priority: Optional[int] = None, check_capacity: bool = True,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                 tenant: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Queue a request now; iterate the result for its outputs (cumulative ones unless ``output_kind``
        says otherwise) until it finishes.

        Raises EngineOverloadedError at once when the queue is full (admission
        and queueing happen in one synchronous call, so concurrent callers
        cannot all slip past the limit). Iterating raises InvalidRequestError
        (bad prompt or parameters) before the first output, EngineStepError or
        EngineDeadError when the engine fails the request. Callers that admit
        a group of requests together call :meth:`check_capacity` once and pass
        ``check_capacity=False``. ``lora_request``: the request's LoRA adapter (None: the base model).
        """
        self._check_alive()
        # the request arrives now, not when the engine thread next runs commands (after the step it is in): its
        # queue time and TTFT in the metrics then count the wait for that step, as the client sees it
        arrival_time = time.monotonic()
        compiling = None
        if params.structured_outputs is not None:
            try:
                compiling = self.engine.structured_outputs.compile(params.structured_outputs)
            except InvalidRequestError as exc:  # an unknown backend: raised by add_request on the engine thread
                compiling = concurrent.futures.Future()
                compiling.set_exception(exc)
        num_cost_tokens = request_cost_tokens(prompt, params, self.engine.config.model.max_model_len)
        if check_capacity:
            self.check_capacity(params.n, num_cost_tokens, tenant)
        stream = _Stream(kind=output_kind, num_cost_tokens=num_cost_tokens, num_seqs=params.n, tenant=tenant)
        self._streams[request_id] = stream
        self._num_submitted_seqs += params.n

        def add() -> tuple[Optional[str], list[int]]:
            try:
                if compiling is not None:
                    if compiling.exception() is not None:
                        raise compiling.exception()  # a constraint that does not compile: the request's 400
                    if request_id not in self._streams:
                        return None, []  # closed while its constraint compiled: its abort has already run
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time, priority=priority,
                                        output_kind=None, tenant=tenant, lora_request=lora_request)
                group = self.engine.requests.parents[request_id]
                return group.prompt, group.prompt_token_ids
            finally:
                self._num_added_seqs += params.n  # engine thread only; the loop only writes the other counter

        if compiling is None:
            return RequestStream(self, request_id, stream, params, self._submit(add))
        # a structured output's constraint compiles in the engine's compile pool, off the engine thread; the
        # request is added once it has (add_request then finds it compiled, or raises its error)
        added: concurrent.futures.Future = concurrent.futures.Future()
        compiling.add_done_callback(lambda _: _copy_when_done(self._submit(add), added))
        return RequestStream(self, request_id, stream, params, added)

    def _abort_soon(self, request_id: str) -> None:
        if self.dead_reason is None and not self._stop:
            self._submit(lambda: self.engine.abort_request(request_id))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine stopped after an unrecoverable error: {self.dead_reason}")
        if not self._accepting or self._thread is None:
            raise EngineDeadError("the server is shutting down and accepts no new requests")

    def check_capacity(self, num_seqs: int, num_tokens: int = 0, tenant: Optional[str] = None) -> None:
        """Raise EngineOverloadedError if ``num_seqs`` more sequences (or ``num_tokens`` more tokens of prompt and
        output) would overfill the waiting queue, or ``tenant``'s share of it; InvalidRequestError if they could
        never fit it."""
        self._check_tokens(num_tokens)
        self._check_tenant(num_seqs, tenant)
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_seqs > limit:  # could never be admitted, even into an empty queue
            raise InvalidRequestError(
                f"this request has {num_seqs} sequences (prompts x n) but the server queues at most {limit} "
                "(--max-waiting-requests); send fewer prompts or a smaller n per request")
        # racy reads of a list length from another thread are fine: this is admission control
        num_pending = self._num_submitted_seqs - self._num_added_seqs
        num_waiting = self.engine.scheduler.num_waiting + num_pending
        if num_waiting and num_waiting + num_seqs > limit:  # an empty queue admits any request
            raise EngineOverloadedError(
                f"the server is overloaded: {num_waiting} sequences are already waiting and the queue holds "
                f"at most {limit} (--max-waiting-requests); retry later", self._retry_after(num_waiting))

    def _check_tenant(self, num_seqs: int, tenant: Optional[str]) -> None:
        limit = self.max_waiting_per_tenant
        if limit is None:
            return
        if num_seqs > limit:
            raise InvalidRequestError(
                f"this request has {num_seqs} sequences (prompts x n) but the server queues at most {limit} per "
                "client (--max-waiting-per-tenant); send fewer prompts or a smaller n per request")
        unstarted = [s for s in self._streams.values() if s.tenant == tenant and not s.has_output and not s.finished]
        num_waiting = sum(s.num_seqs for s in unstarted)
        if num_waiting and num_waiting + num_seqs > limit:
            raise EngineOverloadedError(
                f"too many requests from this client: {num_waiting} of its sequences are waiting to start and the "
                f"server queues at most {limit} per client (--max-waiting-per-tenant); retry later",
                self._retry_after(num_waiting))

    def _check_tokens(self, num_tokens: int) -> None:
        limit = self.max_waiting_tokens
        if limit is None:
            return
        if num_tokens > limit:
            raise InvalidRequestError(
                f"this request may take {num_tokens} tokens (prompt plus max_tokens, times n) but the server queues "
                f"at most {limit} (--max-waiting-tokens); lower max_tokens, n or the number of prompts")
        # requests with no output yet: queued, or in their first prefill
        unstarted = [s for s in self._streams.values() if not s.has_output and not s.finished]
        num_queued = sum(s.num_cost_tokens for s in unstarted)
        if num_queued and num_queued + num_tokens > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: requests not yet started hold {num_queued} tokens and the queue holds "
                f"at most {limit} (--max-waiting-tokens); retry later", self._retry_after(len(unstarted)))

    def _retry_after(self, num_waiting: int) -> int:
        """Seconds until the queue has likely drained: waiting x mean latency / batch slots, in [1, 60]."""
        lat = self.engine.stats.e2e_request_latency if self.engine.stats is not None else None
        count = lat.count if lat is not None else 0
        mean = lat.sum / count if count else 1.0
        slots = max(1, self.engine.config.scheduler.max_num_seqs)
        return int(min(60, max(1, math.ceil(num_waiting * mean / slots))))

    # ---- the engine thread -------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead_reason is not None or self._stop:
            future.set_exception(EngineDeadError(self.dead_reason or "the engine is stopped"))
            return future
        self._commands.append((fn, future))
        self._wakeup.set()
        return future

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller re-raises it in its own task
                future.set_exception(exc)

    def _run(self) -> None:
        try:
            self._serve_steps()
        except BaseException as exc:  # noqa: BLE001 - a crashed loop must fail its clients, not hang them
            logger.exception("the engine loop crashed")
            self._die(f"the engine loop crashed: {type(exc).__name__}: {exc}")
        if self.dead_reason is None:
            self._run_commands()  # a clean stop still carries out the aborts queued by shutdown()
        self._drain_commands()

    def _serve_steps(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wakeup.clear()
            self._run_commands()
            if not engine.has_unfinished_requests():
                if not self._stop:
                    self._wakeup.wait()
                    self._gather_arrivals()
                continue
            try:
                outputs = engine.step_engine_outputs()
            except Exception as exc:  # noqa: BLE001 - any fault in a step must not kill the loop silently
                self._on_step_failure(exc)
                continue
            self._consecutive_failures = 0
            if outputs:
                self._to_loop(self._deliver, outputs)

    def _gather_arrivals(self) -> None:
        """Just woken from idle: let requests sent together with the first one arrive before the first step.

        Without this, the first request alone is prefilled in a step of its own while the others, handed in a
        millisecond later, wait for that step. Waits while commands keep coming at most ``idle_gather_s``
        apart, for at most 8 such gaps; a lone request waits one gap.
        """
        gap = self.idle_gather_s
        if gap <= 0:
            return
        deadline = time.monotonic() + _IDLE_GATHER_GAPS * gap
        while not self._stop:
            self._wakeup.clear()
            self._run_commands()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._wakeup.wait(min(gap, remaining)):
                return

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (thread-safe); a closed loop has no one left to tell."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _on_step_failure(self, exc: Exception) -> None:
        self.num_failed_steps += 1
        logger.error("engine step failed:\n%s", traceback.format_exc())
        error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        try:
            if isinstance(exc, StepFailedError):
                # rolled back: only the step's own requests saw the fault
                parent_ids = list(exc.request_ids)
                sequences = [c for rid in parent_ids for c in self.engine.sequences_of(rid)]
            else:
                # the step may have been left half-applied: fail every running request
                sequences = list(self.engine.scheduler.running)
                parent_ids = sorted({r.parent_id or r.request_id for r in sequences})
            self._consecutive_failures += 1
            for req in sequences:
                self.engine.scheduler.fail(req, str(error))  # counted as "error" in metrics
            self.engine.abort_request(parent_ids)  # their sibling sequences (n > 1) and output state
        except Exception as cleanup_exc:  # noqa: BLE001
            self._die(f"clean-up after a failed step raised {type(cleanup_exc).__name__}: {cleanup_exc}")
            return
        self._to_loop(self._fail_streams, parent_ids, error)
        if self._consecutive_failures >= self.max_consecutive_failures:
            problem = self.engine.self_check()
            if problem is None:
                logger.warning("%d steps failed in a row but the engine's self-check passes: the failed requests "
                               "caused them; serving goes on", self._consecutive_failures)
                self._consecutive_failures = 0
                return
            self._die(f"{self._consecutive_failures} consecutive steps failed and the self-check failed too "
                      f"({problem}); last: {type(exc).__name__}: {exc}")

    def _die(self, reason: str) -> None:
        logger.critical("the engine is dead: %s", reason)
        self.dead_reason = reason
        try:  # best effort: give every block back, so the LLMEngine itself is left clean
            self.engine.abort_request(list(self.engine.requests.parents))
        except Exception:  # noqa: BLE001
            logger.exception("could not abort the remaining requests of the dead engine")
        self._stop = True
        self._to_loop(self._fail_streams, None,
                      EngineDeadError(f"the engine stopped after an unrecoverable error: {reason}"))

    def _drain_commands(self) -> None:
        while self._commands:
            _, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(self.dead_reason or "the engine is stopped"))

    # ---- on the event loop ---------------------------------------------------------

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]  # its consumer holds the stream; the table keeps live ones

    def _fail_streams(self, request_ids: Optional[list[str]], error: BaseException) -> None:
        """Fail the given requests' streams (all of them when ``request_ids`` is None)."""
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.error = error
                stream.finished = True
                stream.event.set()


def _copy_when_done(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """Give ``target`` the result or exception of ``source`` once it has one."""
    def copy(done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
