"""``POST /v1/chat/completions``: messages rendered with the chat template, answers as messages or deltas."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.plugins.entrypoints.server.serving import (ServingContext, finish_reason, make_sampling_params, new_id,
                                                       now_s, output_error, unless_disconnected, usage)
from pagoda.plugins.entrypoints.server.streaming import Generation, stream_sse
from pagoda.plugins.entrypoints.server.structured import check_compiles, structured_outputs_of


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: text content joined into one string."""
    result = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        result.append(msg)
    return result


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[int]]:
    """Apply the chat template (on the tokenizer thread); a template failure is the request's fault: 400."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model's tokenizer has no chat template; start the server with --chat-template FILE "
                            "or use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises TemplateError, TypeError, ... for messages the template rejects
        raise APIError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                       param="messages") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    messages = plain_messages(body.messages)
    ctx.check_text_length("".join(m["content"] for m in messages), "messages")
    text, token_ids = await ctx.run_tokenizer(lambda tok: render_chat(tok, messages, body.add_generation_prompt))
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = ctx.resolve_max_tokens(len(token_ids), requested)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    structured_outputs, field = structured_outputs_of(body)
    await check_compiles(ctx.engine, structured_outputs, field)
    params = make_sampling_params(body, max_tokens, num_top, structured_outputs)
    request_id = new_id("chatcmpl")
    gen = Generation(ctx.engine, request_id, [{"prompt": text, "prompt_token_ids": token_ids}], params, body.priority,
                     stream=body.stream)
    await unless_disconnected(request, gen.start())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, request_id, num_top, include_usage), media_type="text/event-stream")
    (out,) = await unless_disconnected(request, gen.final())
    err = output_error(out)
    if err is not None:
        raise err
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(c, 0, num_top) if num_top is not None else None,
                "finish_reason": finish_reason(c), "stop_reason": c.stop_reason} for c in out.outputs]
    num_completion = sum(len(c.token_ids) for c in out.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": now_s(),
                         "model": ctx.served_model_name, "choices": choices,
                         "usage": usage(len(out.prompt_token_ids), num_completion, out.num_cached_tokens)})


def _stream(ctx: ServingContext, gen: Generation, request_id: str, num_top: Optional[int],
            include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: each choice's new content as a delta, the role with its first one."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": ctx.served_model_name}
    started: set[int] = set()

    def choices(_: int, out: RequestOutput) -> list[dict]:
        result = []
        for c in out.outputs:
            first = c.index not in started
            has_new_tokens = num_top is not None and bool(c.token_ids)
            if not first and not c.text and not has_new_tokens and c.finish_reason is None:
                continue
            started.add(c.index)
            delta = {"role": "assistant", "content": c.text} if first else {"content": c.text}
            result.append({"index": c.index, "delta": delta,
                           "logprobs": _logprobs(c, 0, num_top) if num_top is not None else None,
                           "finish_reason": finish_reason(c)})
        return result

    return stream_sse(gen, head, choices, include_usage)


def _logprobs(c: CompletionOutput, start: int, num_top: int) -> dict:
    """Chat logprobs (``{"content": [...]}``) for tokens ``start:`` of a choice."""
    content = []
    for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]
        content.append({"token": chosen.decoded_token or "", "logprob": chosen.logprob,
                        "bytes": list((chosen.decoded_token or "").encode()),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())} for lp in ranked]})
    return {"content": content, "refusal": None}
