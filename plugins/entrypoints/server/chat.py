"""``POST /v1/chat/completions``: messages rendered with the chat template, answers as messages or deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.engine.beam_search import beam_search_async
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.frontend import content_as_parts, resolve_content_format
from pagoda.plugins.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.plugins.entrypoints.server.reasoning import ReasoningRequest, StreamedReasoning
from pagoda.plugins.entrypoints.server.serving import (ServingContext, StreamUsage, beam_search_params, finish_reason,
                                                       make_sampling_params, now_s, output_error, prompt_logprobs_json,
                                                       response_id, token_text, truncated_prompt, unless_disconnected,
                                                       usage)
from pagoda.plugins.entrypoints.server.streaming import Generation, stream_sse
from pagoda.plugins.entrypoints.server.tools import StreamedChoice, ToolRequest, plan_tools, template_tool_fields
from pagoda.plugins.entrypoints.server.structured import check_compiles, structured_outputs_of
from pagoda.plugins.entrypoints.server.timeline import mark, note_started


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


# apply_chat_template's own parameters and the variables it sets: chat_template_kwargs may not replace them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Optional[dict], param: str = "chat_template_kwargs") -> dict:
    """vLLM's ``chat_template_kwargs``: more variables for the template (``enable_thinking``, ...); 400 for a
    name that the request's own fields set."""
    kwargs = kwargs or {}
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"{param} may not set {', '.join(reserved)}: the request's own fields (messages, tools, "
                            "documents, add_generation_prompt, continue_final_message) set them", param=param)
    return kwargs


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                tools: Optional[list[dict]] = None, max_chars: Optional[int] = None, *,
                continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
                documents: Optional[list[dict]] = None, add_special_tokens: bool = False,
                chat_template: Optional[str] = None, content_format: str = "auto") -> tuple[str, list[int]]:
    """Apply the chat template (on the tokenizer thread); a template failure is the request's fault: 400.
    ``tools`` (OpenAI's function tools) reach the template as ``tools``, ``template_kwargs`` as variables of
    their names. ``continue_final_message`` leaves the last message open for the answer to continue it. A
    rendered text of more than ``max_chars`` characters (what no context can hold) is refused before it is
    encoded; ``add_special_tokens`` adds the tokenizer's special tokens (BOS) to the template's. ``chat_template``:
    the template to render with instead of the tokenizer's (the server's tool-aware one). ``content_format``
    (``--chat-template-content-format``): ``string``, ``openai`` (each message's text reaches the template as
    OpenAI's list of parts) or ``auto`` (``openai`` for a template that loops over a message's content)."""
    if not tokenizer.chat_template and chat_template is None:
        raise APIError(400, "this model's tokenizer has no chat template; start the server with --chat-template FILE "
                            "or use /v1/completions", param="messages")
    try:
        if resolve_content_format(content_format, chat_template or tokenizer.chat_template) == "openai":
            messages = content_as_parts(messages)
        text = tokenizer.apply_chat_template(messages, tools=tools, documents=documents, tokenize=False,
                                             chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja raises TemplateError, TypeError, ... for messages the template rejects
        raise APIError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                       param="messages") from None
    if max_chars is not None and len(text) > max_chars:
        raise APIError(400, f"the messages rendered with the chat template have {len(text)} characters, more than "
                            f"this model's context can hold (at most {max_chars}); send fewer or shorter messages",
                       param="messages")
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request):
    mark(request, "parsed")
    lora = ctx.resolve_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true; send the request without streaming",
                       param="prompt_logprobs")
    if body.chat_template is not None:
        raise APIError(400, "a chat template per request is not served: this server renders every chat with its own "
                            "template (start it with --chat-template FILE); remove chat_template",
                       param="chat_template")
    template_kwargs = ctx.effort.template_kwargs(body.reasoning_effort, check_template_kwargs(body.chat_template_kwargs),
                                                 "reasoning_effort")
    continues = body.continue_final_message
    if continues and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise APIError(400, "continue_final_message continues the last message, and add_generation_prompt starts a "
                            "new one: send add_generation_prompt false with it", param="continue_final_message")
    if continues and body.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message continues the last message, which must be the assistant's "
                            f"(it is {body.messages[-1].role!r})", param="continue_final_message")
    tooling = plan_tools(body, ctx.tool_options)
    messages = plain_messages(body.messages)
    check_chat_chars(ctx, messages, tooling.tools)
    template = ctx.tool_options.template_for(tooling.tools, messages)
    text, token_ids = await unless_disconnected(request, ctx.run_tokenizer(
        lambda tok: render_chat(tok, messages, body.add_generation_prompt and not continues, tooling.tools,
                                ctx.max_prompt_chars, continue_final_message=continues,
                                template_kwargs=template_kwargs, documents=body.documents,
                                add_special_tokens=body.add_special_tokens, chat_template=template,
                                content_format=ctx.frontend.chat_template_content_format)))
    mark(request, "tokenized")
    kept = truncated_prompt(body, token_ids, ctx.max_model_len)
    if len(kept) < len(token_ids):
        text, token_ids = None, kept
    # vLLM's echo: the answer continues the last message when that is the assistant's, and its content says so
    echoed = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
    if body.max_completion_tokens is not None:
        max_tokens = ctx.resolve_max_tokens(len(token_ids), body.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = ctx.resolve_max_tokens(len(token_ids), body.max_tokens)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    structured_outputs, field = structured_outputs_of(body)
    if structured_outputs is not None and tooling.is_forced:
        raise APIError(400, f"tool_choice {body.tool_choice!r} holds the answer to the tool calls' schema, so it "
                            f"cannot be combined with {field}; send one of them", param="tool_choice")
    reasoning = ctx.reasoning_options.plan(text if text is not None else "")
    await check_compiles(ctx.engine, structured_outputs, field, request, ctx.tenant_of(request, body))
    params = reasoning.adjust(tooling.constrain(make_sampling_params(body, max_tokens, num_top, body.prompt_logprobs,
                                                                     structured_outputs, ctx.sampling_defaults)))
    request_id = response_id("chatcmpl", body)
    # vLLM's role of the answer: the server's --response-role, or the last message's when no new turn is opened
    role = ctx.frontend.response_role if body.add_generation_prompt else body.messages[-1].role
    if body.use_beam_search:
        return await _beam_search_chat(ctx, body, request, request_id, token_ids, max_tokens, role, lora, (
            (body.stream, "stream"), (structured_outputs is not None, "response_format"),
            (bool(tooling.tools), "tools"), (reasoning.is_on, "reasoning (the server's --reasoning-parser)"),
            (bool(body.logprobs), "logprobs"), (body.prompt_logprobs is not None, "prompt_logprobs"),
            (bool(echoed), "echo")))
    extras = _Extras(bool(body.return_token_ids), ctx.tokens_as_token_ids(body),
                     text if body.return_prompt_text else None, echoed, role)
    try:
        gen = Generation(ctx.engine, request_id, [{"prompt": text, "prompt_token_ids": token_ids}], params,
                         body.priority, stream=body.stream, tenant=ctx.tenant_of(request, body), lora_request=lora,
                         request_log=ctx.request_log)
        await unless_disconnected(request, gen.start())
        note_started(request, request_id, gen, body.stream)
    except InvalidRequestError as exc:
        raise tooling.explain_refusal(exc) from None
    if body.stream:
        response = StreamingResponse(_stream(ctx, gen, request_id, num_top, ctx.stream_usage(body), tooling, reasoning,
                                             ctx.model_name(lora), extras), media_type="text/event-stream")
        tooling.warn(response, ctx.logged_ignored_fields)
        return response
    (out,) = await unless_disconnected(request, gen.final())
    err = output_error(out)
    if err is not None:
        raise err
    choices = []
    for c in out.outputs:
        read = reasoning.read(c.text)
        message, reason = tooling.message(read.content, finish_reason(c))
        message["role"] = extras.role
        if reasoning.is_on:  # vLLM's field: null when the answer has no thinking; content null when it is all thinking
            message["reasoning_content"] = read.reasoning or None
            if read.reasoning and not message["content"]:
                message["content"] = None
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        choice = {"index": c.index, "message": message,
                  "logprobs": _logprobs(c, 0, num_top, extras.as_token_ids) if num_top is not None else None,
                  "finish_reason": reason, "stop_reason": c.stop_reason}
        if extras.token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    num_completion = sum(len(c.token_ids) for c in out.outputs)
    response = {"id": request_id, "object": "chat.completion", "created": now_s(), "model": ctx.model_name(lora),
                "choices": choices, "usage": usage(len(out.prompt_token_ids), num_completion, out.num_cached_tokens)}
    response.update(extras.prompt_fields(out.prompt_token_ids))
    if body.prompt_logprobs is not None:  # vLLM's field: the rendered prompt's tokens, for the whole response
        response["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                           body.prompt_logprobs)
    answer = JSONResponse(response)
    tooling.warn(answer, ctx.logged_ignored_fields)
    return answer


async def _beam_search_chat(ctx: ServingContext, body: ChatCompletionRequest, request: Request, request_id: str,
                            token_ids: list[int], max_tokens: int, role: str, lora: Any, refused: Any):
    """``use_beam_search`` on a chat: the rendered prompt's ``n`` best beams as the ``n`` choices, best first."""
    params = beam_search_params(ctx, body, max_tokens, refused)
    beams = await unless_disconnected(request, beam_search_async(ctx.engine, request_id, token_ids, params,
                                                                 ctx.tenant_of(request, body), lora))
    choices, num_completion = [], 0
    for j, beam in enumerate(beams):
        generated = beam.output_token_ids
        num_completion += len(generated)
        choice = {"index": j, "message": {"role": role, "content": beam.text}, "logprobs": None,
                  "finish_reason": beam.finish_reason, "stop_reason": None}
        if body.return_token_ids:
            choice["token_ids"] = generated
        choices.append(choice)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": now_s(),
                         "model": ctx.model_name(lora), "choices": choices,
                         "usage": usage(len(token_ids), num_completion, 0)})


@dataclass(frozen=True)
class _Extras:
    """What vLLM's fields add to a chat answer: token ids, tokens named by id in logprobs, the rendered prompt,
    the echoed content of the last message."""

    token_ids: bool = False
    as_token_ids: bool = False
    prompt_text: Optional[str] = None
    echoed: str = ""
    role: str = "assistant"  # of the answer's message (its first delta when streamed)

    def prompt_fields(self, prompt_token_ids: list[int]) -> dict:
        """The response's (or the first chunk's) ``prompt_token_ids`` and ``prompt_text`` when asked for."""
        fields: dict = {}
        if self.token_ids:
            fields["prompt_token_ids"] = list(prompt_token_ids)
        if self.prompt_text is not None:
            fields["prompt_text"] = self.prompt_text
        return fields


def _stream(ctx: ServingContext, gen: Generation, request_id: str, num_top: Optional[int],
            stream_usage: StreamUsage, tooling: ToolRequest, reasoning: ReasoningRequest, model: str,
            extras: _Extras) -> AsyncIterator[str]:
    """The SSE body: each choice's new thinking (``reasoning_content``), content and tool call pieces as a delta,
    the role with its first one."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}
    streams: dict[int, StreamedChoice] = {}
    thoughts: dict[int, StreamedReasoning] = {}

    def choices(_: int, out: RequestOutput) -> list[dict]:
        result = []
        for c in out.outputs:
            first = c.index not in streams
            if first:
                streams[c.index] = tooling.stream()
                thoughts[c.index] = StreamedReasoning(reasoning.new_parser())
            stream = streams[c.index]
            read = thoughts[c.index].delta(c.text, c.finish_reason is not None)
            delta = stream.delta(read.content, c.finish_reason is not None)
            if read.reasoning:
                delta = {"reasoning_content": read.reasoning, **delta}
            has_new_tokens = (num_top is not None or extras.token_ids) and bool(c.token_ids)
            if not first and not delta.get("content") and "tool_calls" not in delta and not has_new_tokens \
                    and not read.reasoning and c.finish_reason is None:
                continue
            if first:  # OpenAI's first delta: the role, and content "" (null when it begins a tool call)
                content = delta.pop("content", None if "tool_calls" in delta else "")
                if extras.echoed:
                    content = extras.echoed + (content or "")
                delta = {"role": extras.role, "content": content, **delta}
            choice = {"index": c.index, "delta": delta,
                      "logprobs": _logprobs(c, 0, num_top, extras.as_token_ids) if num_top is not None else None,
                      "finish_reason": stream.finish_reason(finish_reason(c))}
            if extras.token_ids:
                choice["token_ids"] = list(c.token_ids)
            result.append(choice)
        return result

    return stream_sse(gen, head, choices, stream_usage, lambda out: extras.prompt_fields(out.prompt_token_ids))


def _logprobs(c: CompletionOutput, start: int, num_top: int, as_token_ids: bool = False) -> dict:
    """Chat logprobs (``{"content": [...]}``) for tokens ``start:`` of a choice (``as_token_ids``: each token
    named ``token_id:<id>``, vLLM's ``return_tokens_as_token_ids``)."""
    content = []
    for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen = entry[token_id]
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)[:num_top]
        content.append({"token": token_text(chosen.decoded_token, token_id, as_token_ids), "logprob": chosen.logprob,
                        "bytes": list((chosen.decoded_token or "").encode()),
                        "top_logprobs": [{"token": token_text(lp.decoded_token, t, as_token_ids), "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())} for t, lp in ranked]})
    return {"content": content, "refusal": None}
