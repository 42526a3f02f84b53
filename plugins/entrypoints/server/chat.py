"""``POST /v1/chat/completions``: messages rendered with the chat template, answers as messages or deltas."""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.plugins.entrypoints.server.serving import (ServingContext, finish_reason, make_sampling_params, new_id,
                                                       now_s, output_error, prompt_logprobs_json,
                                                       unless_disconnected, usage)
from pagoda.plugins.entrypoints.server.streaming import Generation, stream_sse
from pagoda.plugins.entrypoints.server.tools import StreamedChoice, ToolRequest, plan_tools, template_tool_fields
from pagoda.plugins.entrypoints.server.structured import check_compiles, structured_outputs_of


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: text content joined into one string; tool calls and the
    ids of tool results as Hugging Face templates take them."""
    result = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        msg.update(template_tool_fields(m, i))
        result.append(msg)
    return result


def check_chat_chars(ctx: ServingContext, messages: list[dict], tools: Optional[list[dict]] = None,
                     param: str = "messages") -> None:
    """400 before rendering a chat whose text cannot fit the context, or is more than a request may have: the
    messages' content, names, tool call arguments and tool results, and the tools' JSON (``param``: the field
    named in the error)."""
    num_chars = sum(len(m["content"]) + len(m.get("name", "")) + len(m.get("tool_call_id", ""))
                    + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0) for m in messages)
    if tools:
        num_chars += len(json.dumps(tools))
    ctx.check_num_chars(num_chars, param)
    ctx.check_request_chars([num_chars], param, param)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                tools: Optional[list[dict]] = None, max_chars: Optional[int] = None) -> tuple[str, list[int]]:
    """Apply the chat template (on the tokenizer thread); a template failure is the request's fault: 400.
    ``tools`` (OpenAI's function tools) reach the template as ``tools``. A rendered text of more than
    ``max_chars`` characters (what no context can hold) is refused before it is encoded."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model's tokenizer has no chat template; start the server with --chat-template FILE "
                            "or use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises TemplateError, TypeError, ... for messages the template rejects
        raise APIError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                       param="messages") from None
    if max_chars is not None and len(text) > max_chars:
        raise APIError(400, f"the messages rendered with the chat template have {len(text)} characters, more than "
                            f"this model's context can hold (at most {max_chars}); send fewer or shorter messages",
                       param="messages")
    return text, tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    lora = ctx.resolve_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true; send the request without streaming",
                       param="prompt_logprobs")
    tooling = plan_tools(body, ctx.tool_options)
    messages = plain_messages(body.messages)
    check_chat_chars(ctx, messages, tooling.tools)
    text, token_ids = await unless_disconnected(request, ctx.run_tokenizer(
        lambda tok: render_chat(tok, messages, body.add_generation_prompt, tooling.tools, ctx.max_prompt_chars)))
    if body.max_completion_tokens is not None:
        max_tokens = ctx.resolve_max_tokens(len(token_ids), body.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = ctx.resolve_max_tokens(len(token_ids), body.max_tokens)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    structured_outputs, field = structured_outputs_of(body)
    if structured_outputs is not None and tooling.is_forced:
        raise APIError(400, f"tool_choice {body.tool_choice!r} holds the answer to the tool calls' schema, so it "
                            f"cannot be combined with {field}; send one of them", param="tool_choice")
    await check_compiles(ctx.engine, structured_outputs, field, request, ctx.tenant_of(request, body))
    params = tooling.constrain(make_sampling_params(body, max_tokens, num_top, body.prompt_logprobs,
                                                    structured_outputs))
    request_id = new_id("chatcmpl")
    try:
        gen = Generation(ctx.engine, request_id, [{"prompt": text, "prompt_token_ids": token_ids}], params,
                         body.priority, stream=body.stream, tenant=ctx.tenant_of(request, body), lora_request=lora)
        await unless_disconnected(request, gen.start())
    except InvalidRequestError as exc:
        raise tooling.explain_refusal(exc) from None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, gen, request_id, num_top, include_usage, tooling,
                                         ctx.model_name(lora)), media_type="text/event-stream")
    (out,) = await unless_disconnected(request, gen.final())
    err = output_error(out)
    if err is not None:
        raise err
    choices = []
    for c in out.outputs:
        message, reason = tooling.message(c.text, finish_reason(c))
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(c, 0, num_top) if num_top is not None else None,
                        "finish_reason": reason, "stop_reason": c.stop_reason})
    num_completion = sum(len(c.token_ids) for c in out.outputs)
    response = {"id": request_id, "object": "chat.completion", "created": now_s(), "model": ctx.model_name(lora),
                "choices": choices, "usage": usage(len(out.prompt_token_ids), num_completion, out.num_cached_tokens)}
    if body.prompt_logprobs is not None:  # vLLM's field: the rendered prompt's tokens, for the whole response
        response["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                           body.prompt_logprobs)
    return JSONResponse(response)


def _stream(ctx: ServingContext, gen: Generation, request_id: str, num_top: Optional[int],
            include_usage: bool, tooling: ToolRequest, model: str) -> AsyncIterator[str]:
    """The SSE body: each choice's new content (and tool call pieces) as a delta, the role with its first one."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}
    streams: dict[int, StreamedChoice] = {}

    def choices(_: int, out: RequestOutput) -> list[dict]:
        result = []
        for c in out.outputs:
            first = c.index not in streams
            if first:
                streams[c.index] = tooling.stream()
            stream = streams[c.index]
            delta = stream.delta(c.text, c.finish_reason is not None)
            has_new_tokens = num_top is not None and bool(c.token_ids)
            if not first and not delta.get("content") and "tool_calls" not in delta and not has_new_tokens \
                    and c.finish_reason is None:
                continue
            if first:  # OpenAI's first delta: the role, and content "" (null when it begins a tool call)
                content = delta.pop("content", None if "tool_calls" in delta else "")
                delta = {"role": "assistant", "content": content, **delta}
            result.append({"index": c.index, "delta": delta,
                           "logprobs": _logprobs(c, 0, num_top) if num_top is not None else None,
                           "finish_reason": stream.finish_reason(finish_reason(c))})
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
