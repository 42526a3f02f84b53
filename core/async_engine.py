"""AsyncLLMEngine: drives an LLMEngine from a background thread and streams outputs to asyncio code.

The engine thread owns the LLMEngine (which is not thread-safe): requests,
aborts and tokenizer calls reach it as commands run between two steps. Each
step's outputs are handed to the event loop in one call; every request keeps
only its newest (cumulative) output, so a slow client never makes the engine
queue up memory.

Failure model: an exception inside ``step()`` fails the requests that were
running (their KV state is no longer trustworthy) with :class:`EngineStepError`
and keeps the waiting ones. After ``max_consecutive_failures`` failed steps in
a row, or when the clean-up itself fails, the engine is dead: every request
fails with :class:`EngineDeadError` and ``is_healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from pagoda.engine import LLMEngine, PromptType
from pagoda.errors import PagodaError
from pagoda.outputs import RequestOutput
from pagoda.request import RequestStatus
from pagoda.sampling_params import SamplingParams

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


@dataclass(eq=False)
class _Stream:
    """One request's mailbox: the newest output, or the error that ended it."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: Optional[RequestOutput] = None
    error: Optional[BaseException] = None
    finished: bool = False


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a thread while requests are pending; asyncio callers stream results."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: Optional[int] = None,
                 max_consecutive_failures: int = 3) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests or engine.config.scheduler.max_waiting_requests
        self.max_consecutive_failures = max_consecutive_failures
        self.model_name = engine.config.model.served_model_name
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_pending_seqs = 0  # sequences submitted but not yet added by the engine thread
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

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop accepting; wait up to ``timeout`` s for in-flight requests, fail the rest, stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("shutting down with %d unfinished requests; failing them", len(self._streams))
            ids = list(self._streams)
            self._fail_streams(ids, EngineDeadError("the server is shutting down; the request was not finished"))
            self._submit(lambda: self.engine.abort_request(ids))
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- requests ----------------------------------------------------------------

    async def run_in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between steps (tokenizer calls, engine queries)."""
        self._check_alive()
        return await asyncio.wrap_future(self._submit(fn))

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: Optional[int] = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its cumulative outputs until it finishes.

        Raises InvalidRequestError (bad prompt or parameters) before the first
        output, EngineOverloadedError when the queue is full, EngineStepError
        or EngineDeadError when the engine fails it. Closing the generator
        early (a client that went away) aborts the request and frees its KV
        blocks.
        """
        self._check_alive()
        self._check_capacity(params.n)
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_pending_seqs += params.n
        finished = True  # nothing to abort until the engine has the request
        try:
            add = self._submit(lambda: self.engine.add_request(request_id, prompt, params, priority=priority))
            try:
                await asyncio.wrap_future(add)
            except asyncio.CancelledError:
                finished = False  # the add may still run on the engine thread: queue an abort behind it
                raise
            finally:
                self._num_pending_seqs -= params.n
            finished = False
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                out = stream.latest
                if out is None:
                    continue
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead_reason is None and not self._stop:
                self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self.engine.abort_request(request_id)))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine stopped after an unrecoverable error: {self.dead_reason}")
        if not self._accepting or self._thread is None:
            raise EngineDeadError("the server is shutting down and accepts no new requests")

    def _check_capacity(self, num_seqs: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        # racy reads of a list length from another thread are fine: this is admission control
        num_waiting = self.engine.scheduler.num_waiting + self._num_pending_seqs
        if num_waiting + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {num_waiting} sequences are already waiting and the queue holds "
                f"at most {limit} (--max-waiting-requests); retry later", self._retry_after(num_waiting))

    def _retry_after(self, num_waiting: int) -> int:
        """Seconds until the queue has likely drained: waiting x mean latency / batch slots, in [1, 60]."""
        lat = self.engine.stats.e2e_request_latency
        count = lat.count
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
        engine = self.engine
        while not self._stop:
            self._wakeup.clear()
            self._run_commands()
            if not engine.has_unfinished_requests():
                if not self._stop:
                    self._wakeup.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - any fault in a step must not kill the loop silently
                self._on_step_failure(exc)
                continue
            self._consecutive_failures = 0
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
        if self.dead_reason is None:
            self._run_commands()  # a clean stop still carries out the aborts queued by shutdown()
        self._drain_commands()

    def _on_step_failure(self, exc: Exception) -> None:
        self.num_failed_steps += 1
        self._consecutive_failures += 1
        logger.error("engine step failed:\n%s", traceback.format_exc())
        error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        try:
            # running requests have half-applied state (allocated blocks, advanced positions): fail them
            running = list(self.engine.scheduler.running)
            parent_ids = sorted({r.parent_id or r.request_id for r in running})
            for req in running:
                req.error = str(error)
                self.engine.scheduler.finish(req, RequestStatus.FINISHED_ERROR)  # counted as "error" in metrics
            self.engine.abort_request(parent_ids)  # their sibling sequences (n > 1) and output state
        except Exception as cleanup_exc:  # noqa: BLE001
            self._die(f"clean-up after a failed step raised {type(cleanup_exc).__name__}: {cleanup_exc}")
            return
        self._loop.call_soon_threadsafe(self._fail_streams, parent_ids, error)
        if self._consecutive_failures >= self.max_consecutive_failures:
            self._die(f"{self._consecutive_failures} consecutive steps failed; last: {type(exc).__name__}: {exc}")

    def _die(self, reason: str) -> None:
        logger.critical("the engine is dead: %s", reason)
        self.dead_reason = reason
        try:  # best effort: give every block back, so the LLMEngine itself is left clean
            self.engine.abort_request(list(self.engine.output_processor.parents))
        except Exception:  # noqa: BLE001
            logger.exception("could not abort the remaining requests of the dead engine")
        self._stop = True
        self._loop.call_soon_threadsafe(self._fail_streams, None,
                                        EngineDeadError(f"the engine stopped after an unrecoverable error: {reason}"))

    def _drain_commands(self) -> None:
        while self._commands:
            _, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(self.dead_reason or "the engine is stopped"))

    # ---- on the event loop ---------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue
            stream.latest = out
            stream.finished = out.finished
            stream.event.set()

    def _fail_streams(self, request_ids: Optional[list[str]], error: BaseException) -> None:
        """Fail the given requests' streams (all of them when ``request_ids`` is None)."""
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None and not stream.finished:
                stream.error = error
                stream.finished = True
                stream.event.set()
