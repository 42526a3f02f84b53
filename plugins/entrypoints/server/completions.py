"""``POST /v1/completions``: text in, text out, streamed as SSE chunks or returned whole."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import CompletionRequest
from pagoda.plugins.entrypoints.server.serving import (ServingContext, finish_reason, make_sampling_params, new_id,
                                                       now_s, output_error, unless_disconnected, usage)
from pagoda.plugins.entrypoints.server.streaming import Generation, stream_sse
from pagoda.plugins.entrypoints.server.structured import check_compiles, structured_outputs_of


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request):
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server; put the text in the prompt", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of={body.best_of} must equal n={body.n}; ranking extra sequences is not supported",
                       param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported; drop one of them", param="echo")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    raw = body.prompt
    prompts = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else list(raw)
    for p in prompts:
        if isinstance(p, str):
            ctx.check_text_length(p, "prompt")

    def tokenize(tok):
        result = []
        for p in prompts:
            if isinstance(p, str):
                result.append({"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=body.add_special_tokens)})
            else:
                text = tok.decode(p) if body.echo and all(0 <= t < len(tok) for t in p) else None
                result.append({"prompt": text, "prompt_token_ids": list(p)})
        return result

    engine_prompts = await ctx.run_tokenizer(tokenize)
    max_tokens = min(ctx.resolve_max_tokens(len(p["prompt_token_ids"]), body.max_tokens) for p in engine_prompts)
    structured_outputs, field = structured_outputs_of(body)
    await check_compiles(ctx.engine, structured_outputs, field)
    params = make_sampling_params(body, max_tokens, body.logprobs, structured_outputs)
    request_id = new_id("cmpl")
    gen = Generation(ctx.engine, request_id, engine_prompts, params, body.priority, stream=body.stream)
    await unless_disconnected(request, gen.start())
    echo = [p["prompt"] or "" for p in engine_prompts] if body.echo else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, request_id, body.n, echo, include_usage),
                                 media_type="text/event-stream")
    outputs = await unless_disconnected(request, gen.final())
    choices, num_prompt, num_completion, num_cached = [], 0, 0, 0
    for i, out in enumerate(outputs):
        err = output_error(out)
        if err is not None:
            raise err
        num_prompt += len(out.prompt_token_ids)
        num_cached += out.num_cached_tokens
        for c in out.outputs:
            num_completion += len(c.token_ids)
            text = (echo[i] if echo else "") + c.text
            choices.append({"index": i * body.n + c.index, "text": text,
                            "logprobs": _logprobs(c, 0, len(echo[i]) if echo else 0) if c.logprobs is not None else None,
                            "finish_reason": finish_reason(c), "stop_reason": c.stop_reason})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": now_s(),
                         "model": ctx.served_model_name, "choices": choices,
                         "usage": usage(num_prompt, num_completion, num_cached)})


def _stream(ctx: ServingContext, gen: Generation, request_id: str, n: int, echo: Optional[list[str]],
            include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: each choice's new text (after the echoed prompt, with its first one)."""
    head = {"id": request_id, "object": "text_completion", "created": now_s(), "model": ctx.served_model_name}
    sent_chars: dict[int, int] = {}  # choice index -> characters of completion text sent

    def choices(i: int, out: RequestOutput) -> list[dict]:
        result = []
        for c in out.outputs:
            idx = i * n + c.index
            first = idx not in sent_chars
            text = (echo[i] if echo and first else "") + c.text
            has_new_tokens = c.logprobs is not None and bool(c.token_ids)
            if not first and not text and not has_new_tokens and c.finish_reason is None:
                continue
            start_chars = sent_chars.get(idx, 0)
            result.append({"index": idx, "text": text,
                           "logprobs": _logprobs(c, 0, start_chars) if c.logprobs is not None else None,
                           "finish_reason": finish_reason(c), "stop_reason": c.stop_reason})
            sent_chars[idx] = start_chars + len(c.text)
        return result

    return stream_sse(gen, head, choices, include_usage)


def _logprobs(c: CompletionOutput, start: int, text_offset: int) -> dict:
    """The legacy completions logprobs object for tokens ``start:`` of a choice."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen: Logprob = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token or "": lp.logprob for lp in sorted(entry.values(), key=lambda x: x.rank or 0)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
