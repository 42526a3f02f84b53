"""Running the engine requests of one HTTP request, and the one SSE loop that streams completions and chat.

Streamed requests read delta outputs (only what each step added: new text, new tokens, their logprobs), so a
chunk costs what it carries; non-streamed ones read a single final output. Outputs that are ready together
(the prompts of one request after the same engine step) go out in one write.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Optional

from pagoda.engine.async_engine import AsyncLLMEngine, request_cost_tokens
from pagoda.execution.lora_request import LoRARequest
from pagoda.outputs import RequestOutput, RequestOutputKind
from pagoda.plugins.entrypoints.server.request_logging import OutputLog, RequestLog
from pagoda.plugins.entrypoints.server.serving import SSE_DONE, StreamUsage, output_error, sse, sse_error, usage
from pagoda.sampling_params import SamplingParams

# ``(prompt index, delta output)`` -> the chunk's choices (none: nothing worth a chunk)
ChoiceMaker = Callable[[int, RequestOutput], list[dict]]


class Generation:
    """The engine requests behind one HTTP request (one per prompt), started together, closed together.

    ``stream=True``: each request yields delta outputs; otherwise one final output each.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, prompts: list[dict], params: SamplingParams,
                 priority: int, stream: bool, tenant: Optional[str] = None,
                 lora_request: Optional[LoRARequest] = None, request_log: Optional[RequestLog] = None) -> None:
        # the prompts of one request are admitted together
        max_model_len = engine.engine.config.model.max_model_len
        engine.check_capacity(params.n * len(prompts),
                              sum(request_cost_tokens(p, params, max_model_len) for p in prompts), tenant)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        self.serving_stats = engine.serving_stats
        self.gens = [engine.generate(f"{request_id}-{i}", p, params, priority, check_capacity=False,
                                     output_kind=kind, tenant=tenant, lora_request=lora_request)
                     for i, p in enumerate(prompts)]
        self.first: list[Optional[RequestOutput]] = [None] * len(self.gens)
        self.output_logs: list[Optional[OutputLog]] = [None] * len(self.gens)
        if request_log is not None:
            for i, p in enumerate(prompts):
                request_log.received(f"{request_id}-{i}", p.get("prompt"), p["prompt_token_ids"], params)
            self.output_logs = [request_log.outputs() for _ in prompts]

    async def start(self) -> None:
        """Wait for every request's first output; any error (400, 503, ...) aborts all of them."""
        try:
            results = await asyncio.gather(*(g.__anext__() for g in self.gens), return_exceptions=True)
        except BaseException:  # cancelled: the client went away before the first token
            await self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self.first = list(results)

    async def stream(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Batches of ``(prompt index, output)`` that were ready together; the primed first outputs first."""
        pending: dict[asyncio.Future, int] = {}
        try:
            yield self._logged(list(enumerate(self.first)))
            if len(self.gens) == 1:  # one prompt: read it directly, without a task per output
                gen = self.gens[0]
                if not self.first[0].finished:
                    async for out in gen:
                        yield self._logged([(0, out)])
                return
            for i, out in enumerate(self.first):
                if not out.finished:
                    pending[asyncio.ensure_future(self.gens[i].__anext__())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                batch = []
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    out = task.result()  # StopAsyncIteration cannot happen: we stop at the finished output
                    batch.append((i, out))
                    if not out.finished:
                        pending[asyncio.ensure_future(self.gens[i].__anext__())] = i
                yield self._logged(batch)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.close()

    def _logged(self, batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
        for i, out in batch:
            if self.output_logs[i] is not None:
                self.output_logs[i].add(out)
        return batch

    async def final(self) -> list[RequestOutput]:
        last = list(self.first)
        async for batch in self.stream():
            for i, out in batch:
                last[i] = out
        return last

    async def close(self) -> None:
        for gen in self.gens:
            await gen.aclose()


async def stream_sse(gen: Generation, head: dict, make_choices: ChoiceMaker, stream_usage: StreamUsage,
                     first_fields: Optional[Callable[[RequestOutput], dict]] = None) -> AsyncIterator[str]:
    """The SSE body of a streamed completion or chat: a chunk per output with choices, the usage chunk if
    asked for, ``[DONE]``. An error after the status line was sent is the last event. ``first_fields(output)``:
    fields of the first chunk (vLLM's ``prompt_token_ids``)."""
    num_prompt: dict[int, int] = {}
    num_cached: dict[int, int] = {}
    num_completion = 0
    try:
        async for batch in gen.stream():
            t0 = time.perf_counter()
            frames = []
            for i, out in batch:
                err = output_error(out)
                if err is not None:
                    raise err
                num_prompt[i], num_cached[i] = len(out.prompt_token_ids), out.num_cached_tokens
                num_completion += sum(len(c.token_ids) for c in out.outputs)
                choices = make_choices(i, out)
                if choices:
                    chunk = dict(head, choices=choices)
                    if first_fields is not None:
                        chunk.update(first_fields(out))
                        first_fields = None
                    if stream_usage.continuous:
                        chunk["usage"] = usage(sum(num_prompt.values()), num_completion, sum(num_cached.values()))
                    elif stream_usage.final:
                        chunk["usage"] = None
                    frames.append(sse(chunk))
            gen.serving_stats.encode_seconds += time.perf_counter() - t0
            if frames:
                yield "".join(frames)
        if stream_usage.final:
            yield sse(dict(head, choices=[], usage=usage(sum(num_prompt.values()), num_completion,
                                                        sum(num_cached.values()))))
    except Exception as exc:  # the status line is gone: report the error as the last event
        yield sse_error(exc)
    yield SSE_DONE
