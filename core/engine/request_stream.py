"""One request's side of the :class:`~pagoda.engine.async_engine.AsyncLLMEngine`: the mailbox the engine thread
drops each step's new tokens into, and the async iterator a caller reads outputs from. The reader makes the
outputs (text, decoded logprobs) from the tokens, on its own task: the engine thread never does."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pagoda.engine.llm_engine import PromptType
from pagoda.outputs import EngineOutput, RequestOutput, RequestOutputKind, RequestState
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.async_engine import AsyncLLMEngine


@dataclass(eq=False)
class _Stream:
    """One request's mailbox: the engine outputs not read yet, or the error that ended it."""

    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[EngineOutput] = field(default_factory=list)
    error: Optional[BaseException] = None
    has_output: bool = False  # an output arrived: the request started
    first_put_time: Optional[float] = None  # when the event loop took its first output in (monotonic seconds)
    finished: bool = False
    num_cost_tokens: int = 0  # prompt + max_tokens, times n: what admission counts until the first output
    num_seqs: int = 1  # n: the sequences it adds
    tenant: Optional[str] = None  # who sent it (per-tenant admission limits)

    def put(self, output: EngineOutput) -> None:
        """On the event loop: keep a step's output; wake the reader unless it only wants the final one."""
        self.pending.append(output)
        if not self.has_output:
            self.has_output = True
            self.first_put_time = time.monotonic()
        self.finished = output.finished
        if output.finished or self.kind is not RequestOutputKind.FINAL_ONLY:
            self.event.set()


def request_cost_tokens(prompt: PromptType, params: SamplingParams, max_model_len: int) -> int:
    """What a request may cost in tokens: its prompt plus max_tokens (without one, the rest of the context),
    for each of its n sequences. A text prompt counts its characters, a bound that needs no tokenizer."""
    if isinstance(prompt, (str, list)):
        num_prompt = len(prompt)
    else:
        ids = prompt.get("prompt_token_ids")
        num_prompt = len(ids) if ids is not None else len(prompt.get("prompt") or "")
    num_output = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - num_prompt)
    return (num_prompt + num_output) * params.n


class RequestStream:
    """Async iterator over one request's outputs (of the kind it was added with); ``aclose()`` (or cancelling a
    waiting ``__anext__``) aborts the request if it has not finished, freeing its KV blocks."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, stream: _Stream, params: SamplingParams,
                 added: concurrent.futures.Future) -> None:
        self._engine = engine
        self.request_id = request_id
        self._stream = stream
        self._params = params
        self._added = added
        self._state: Optional[RequestState] = None
        self._done = False

    @property
    def first_delivered_time(self) -> Optional[float]:
        """When the event loop took in the request's first output from the engine thread (monotonic seconds;
        None before)."""
        return self._stream.first_put_time

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        stream = self._stream
        while True:
            try:
                if self._added is not None:
                    await self._wait_added()
                while not stream.event.is_set():
                    await stream.event.wait()
            except asyncio.CancelledError:
                self._finish(abort=True)
                raise
            stream.event.clear()
            if stream.error is not None:
                self._finish(abort=False)
                raise stream.error
            pending, stream.pending = stream.pending, []
            stats = self._engine.serving_stats
            try:
                t0 = time.perf_counter()
                for engine_output in pending:
                    self._state.apply(engine_output)
                t1 = time.perf_counter()
                out = self._state.make_output()
                stats.output_seconds += time.perf_counter() - t1
                stats.detokenize_seconds += t1 - t0
            except BaseException:  # the reader cannot go on: the engine must not run on for it
                self._finish(abort=True)
                raise
            if out is None:  # nothing new to show yet (e.g. text held back)
                continue
            if out.finished:
                self._finish(abort=False)
            return out

    async def _wait_added(self) -> None:
        try:
            # shielded: a cancelled caller must not cancel the add itself, or the queue count drifts
            prompt, prompt_token_ids = await asyncio.shield(asyncio.wrap_future(self._added))
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._finish(abort=False)  # never added: nothing to abort
            raise
        self._added = None
        self._state = self._engine.output_processor.new_state(self.request_id, prompt, prompt_token_ids,
                                                              self._params, self._stream.kind)

    async def aclose(self) -> None:
        self._finish(abort=True)

    def _finish(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._engine._streams.pop(self.request_id, None)
        if abort and not self._stream.finished:
            self._engine._abort_soon(self.request_id)

    def __del__(self) -> None:  # a consumer that walked away without closing
        if not self._done and not self._stream.finished:
            self._engine._abort_soon(self.request_id)
