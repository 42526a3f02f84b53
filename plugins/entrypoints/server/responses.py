"""``/v1/responses``: OpenAI's Responses API over the chat template, answered whole or as typed SSE events.

A request's input (a string, or items: messages of text, function calls and their outputs) follows its
``instructions`` (as a system message) and, with ``previous_response_id``, the stored conversation it
continues; the chat template renders them, with the request's function tools, as for chat completions
(``responses_input``). The answer's text is a ``message`` output item, each tool call it makes a
``function_call`` item (``responses_output``); ``tool_choice`` follows chat's rules (``tools``).
"""

from __future__ import annotations

import hashlib

import contextlib
import itertools
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.plugins.entrypoints.server.chat import check_chat_chars, check_template_kwargs, render_chat
from pagoda.plugins.entrypoints.server.errors import APIError, to_api_error
from pagoda.plugins.entrypoints.server.response_store import (OwnedResponses, ResponseNotStored, ResponseStore,
                                                              StoredResponse)
from pagoda.plugins.entrypoints.server.responses_input import (chat_messages, input_items,
                                                               plan_response_tools)
from pagoda.plugins.entrypoints.server.responses_output import Event, ResponseOutput
from pagoda.plugins.entrypoints.server.responses_protocol import (ResponsesRequest, TextFormatJSONObject,
                                                                  TextFormatJSONSchema, ToolChoiceFunction)
from pagoda.plugins.entrypoints.server.serving import (ServingContext, answers_499_when_gone, logger, output_error,
                                                       unless_disconnected)
from pagoda.plugins.entrypoints.server.streaming import Generation
from pagoda.plugins.entrypoints.server.tools import ToolRequest
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

IGNORED_HEADER = "x-pagoda-ignored-fields"
# the engine's and the chat template's names for the fields this API names otherwise
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "structured_outputs": "text.format", "prompt": "input",
                "messages": "input"}


def add_responses_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore, streamed: dict) -> None:
    """``POST /v1/responses``, and ``GET``/``DELETE /v1/responses/{response_id}`` of stored responses."""

    @app.post("/v1/responses", responses=streamed)
    @answers_499_when_gone
    async def create(body: ResponsesRequest, request: Request):
        ctx.check_unknown_fields(body)
        return await create_response(ctx, store, body, request)

    not_stored = {404: {"description": "No response with this id is stored (never stored, deleted or expired)",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}}

    @app.get("/v1/responses/{response_id}", responses=not_stored)
    async def retrieve(response_id: str, request: Request):
        return JSONResponse(_stored(store.for_owner(owner_of(ctx, request)), response_id).response)

    @app.delete("/v1/responses/{response_id}", responses=not_stored)
    async def delete(response_id: str, request: Request):
        owned = store.for_owner(owner_of(ctx, request))
        _stored(owned, response_id)
        owned.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def owner_of(ctx: ServingContext, request: Request) -> Optional[str]:
    """Whose stored responses a request sees: its tenant under ``--tenant-source header``, else its API key
    (hashed, as the tenant of ``api-key``); None (one shared owner) for a request with neither."""
    if ctx.tenant_source == "header":
        return ctx.tenant_of(request)
    auth = request.headers.get("authorization", "")
    return "key:" + hashlib.sha256(auth.encode("utf-8", "surrogatepass")).hexdigest()[:16] if auth else None


async def create_response(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, request: Request):
    store = store.for_owner(owner_of(ctx, request))
    lora = ctx.resolve_model(body.model)
    _refuse_unserved(body)
    tooling = plan_response_tools(body, ctx.tool_options)
    structured_outputs = _structured_outputs(body)
    if structured_outputs is not None and tooling.is_forced:
        raise APIError(400, f"tool_choice {_choice_name(body)} holds the answer to the tool calls' schema, so it "
                            "cannot be combined with text.format json_schema or json_object; send one of them",
                       param="tool_choice")
    items = input_items(body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages = system + chat_messages(_history(store, body.previous_response_id), items)
    effort = body.reasoning.effort if body.reasoning is not None else None
    template_kwargs = ctx.effort.template_kwargs(effort, check_template_kwargs(body.chat_template_kwargs),
                                                 "reasoning.effort")
    with _in_responses_terms(tooling):
        check_chat_chars(ctx, messages, tooling.tools, param="input")
        template = ctx.tool_options.template_for(tooling.tools, messages)
        text, token_ids = await unless_disconnected(request, ctx.run_tokenizer(
            lambda tok: render_chat(tok, messages, add_generation_prompt=True, tools=tooling.tools,
                                    max_chars=ctx.max_prompt_chars, template_kwargs=template_kwargs,
                                    chat_template=template, content_format=ctx.frontend.chat_template_content_format)))
        reasoning = ctx.reasoning_options.plan(text)
        record = ResponseRecord(ctx.model_name(lora), body, tooling.new_parser(), _response_id(store, body),
                                reasoning.new_parser(), ctx.sampling_defaults)
        params = SamplingParams(temperature=record.temperature, top_p=record.top_p,
                                top_k=record.setting("top_k", 0), min_p=record.setting("min_p", 0.0),
                                repetition_penalty=record.setting("repetition_penalty", 1.0),
                                logit_bias=_logit_bias(body), skip_special_tokens=body.skip_special_tokens,
                                max_tokens=ctx.resolve_max_tokens(len(token_ids), body.max_output_tokens),
                                logprobs=record.num_top_logprobs, structured_outputs=structured_outputs)
        gen = Generation(ctx.engine, record.id, [{"prompt": text, "prompt_token_ids": token_ids}],
                         reasoning.adjust(tooling.constrain(params)), priority=body.priority, stream=bool(body.stream),
                         tenant=ctx.tenant_of(request, body), lora_request=lora, request_log=ctx.request_log)
        await unless_disconnected(request, gen.start())
    keep = store if body.store is not False else None
    if body.stream:
        response = StreamingResponse(_events(gen, record, keep, items), media_type="text/event-stream")
        ctx.mark_ignored_fields(body, response, _ignored_fields(ctx, body))
        tooling.warn(response, ctx.logged_ignored_fields)
        return response
    (out,) = await unless_disconnected(request, gen.final())
    err = output_error(out)
    if err is not None:
        raise err
    record.add(out)
    record.finish()
    _keep(keep, record, items)
    response = JSONResponse(record.render())
    ctx.mark_ignored_fields(body, response, _ignored_fields(ctx, body))
    tooling.warn(response, ctx.logged_ignored_fields)
    return response


def _ignored_fields(ctx: ServingContext, body: ResponsesRequest) -> list[str]:
    """The request's fields without effect here: the body's, and ``reasoning`` when its effort does nothing (none
    sent, or a chat template that reads no effort), else ``reasoning.summary`` when one is asked for."""
    names = body.ignored_fields()
    reasoning = body.reasoning
    if reasoning is not None and (reasoning.effort is None or not ctx.effort.is_read):
        names.append("reasoning")
    elif reasoning is not None and (reasoning.summary or reasoning.generate_summary):
        names.append("reasoning.summary")
    return names


def _response_id(store: ResponseStore, body: ResponsesRequest) -> str:
    """The response's id: vLLM's ``request_id`` when the request gives one (400 when a stored response already
    has it), else a new one."""
    if body.request_id is None:
        return f"resp_{uuid.uuid4().hex}"
    try:
        store.get(body.request_id)
    except ResponseNotStored:
        logger.info("request %s received", body.request_id)
        return body.request_id
    raise APIError(400, f"request_id {body.request_id!r} is the id of a stored response; give each request its own "
                        "id (or none: the server makes one)", param="request_id")


def _logit_bias(body: ResponsesRequest) -> Optional[dict[int, float]]:
    if not body.logit_bias:
        return None
    try:
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids written as strings, e.g. {\"50256\": -100}",
                       param="logit_bias") from None


class ResponseRecord:
    """One response as it is generated: renders OpenAI's response object at any point. ``parser`` reads the
    answer's tool calls (None: the answer is text)."""

    def __init__(self, model: str, body: ResponsesRequest, parser: Any = None, response_id: Optional[str] = None,
                 reasoning_parser: Any = None, sampling_defaults: Optional[dict[str, Any]] = None) -> None:
        self.id = response_id or f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model, self.body = model, body
        # the model's sampling defaults, for the fields the request does not set
        self.sampling_defaults = sampling_defaults or {}
        self.temperature = self.setting("temperature", 1.0)
        self.top_p = self.setting("top_p", 1.0)
        self.num_top_logprobs = (body.top_logprobs or 0) if body.wants_logprobs else None
        self.status = "in_progress"
        self.output = ResponseOutput(parser, reasoning_parser)
        self.num_input_tokens = self.num_cached_tokens = self.num_output_tokens = 0
        self.finish_reason: Optional[str] = None
        self.error: Optional[dict] = None
        self.completed_at: Optional[int] = None

    def setting(self, name: str, default: Any) -> Any:
        """The request's sampling field ``name``, else the model's default for it, else ``default``."""
        value = getattr(self.body, name)
        return self.sampling_defaults.get(name, default) if value is None else value

    def add(self, out: RequestOutput) -> list[Event]:
        """Take in one engine output (a delta when streaming, else the whole); the events of what it added. The
        tokens' logprobs go with a text answer (a reader of tool calls takes the text apart)."""
        (c,) = out.outputs
        with_logprobs = (self.num_top_logprobs is not None and self.output.parser is None
                         and self.output.reasoning_parser is None)
        logprobs = _token_logprobs(c, self.num_top_logprobs) if with_logprobs else []
        self.num_input_tokens, self.num_cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        self.num_output_tokens += len(c.token_ids)
        self.finish_reason = c.finish_reason or self.finish_reason
        return self.output.read(c.text, logprobs, c.finish_reason is not None)

    def finish(self) -> list[Event]:
        """The answer is whole: the response's status, and the events that close its last item."""
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        self.completed_at = int(time.time())
        return self.output.finish(self.status)

    def fail(self, err: APIError) -> None:
        self.status = "failed"
        self.error = {"code": "server_error", "message": err.message}

    def render(self) -> dict:
        body = self.body
        is_done = self.status in ("completed", "incomplete")
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, ToolChoiceFunction) else (
            body.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "completed_at": self.completed_at, "background": False, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": self.model,
            "output": self.output.render() if is_done else [],
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "service_tier": "default",
            "reasoning": {"effort": body.reasoning.effort, "summary": None} if body.reasoning is not None else None,
            "temperature": self.temperature, "top_p": self.top_p, "top_logprobs": body.top_logprobs,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": tool_choice, "tools": [t.model_dump() for t in body.tools or ()],
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "usage": {"input_tokens": self.num_input_tokens,
                      "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                      "output_tokens": self.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.num_input_tokens + self.num_output_tokens} if is_done else None,
        }


async def _events(gen: Generation, record: ResponseRecord, store: Optional[OwnedResponses],
                  items: list[dict]) -> AsyncIterator[str]:
    """OpenAI's typed events, in order: created, in_progress, then each output item's (added, its text or
    arguments in pieces as the engine produced them, done; see ``responses_output``), then completed
    (incomplete when max_output_tokens cut the answer). An error after the status line went out ends the stream
    with ``error`` and ``response.failed``."""
    numbers = itertools.count()

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    # sent with the first engine output, so every event after the status line comes from inside gen.stream()
    # (whose end aborts the request) and an error event always follows a response.created
    pending = event("response.created", response=record.render()) + event("response.in_progress",
                                                                           response=record.render())
    try:
        async for batch in gen.stream():
            frames = [pending]
            for _, out in batch:
                err = output_error(out)
                if err is not None:
                    raise err
                frames += [event(kind, **fields) for kind, fields in record.add(out)]
            pending = ""
            chunk = "".join(frames)
            if chunk:
                yield chunk
        closing = [event(kind, **fields) for kind, fields in record.finish()]
        _keep(store, record, items)
        # a response cut short ends with OpenAI's response.incomplete, then response.completed carrying the same
        # response (status "incomplete"): the official SDK's stream helpers wait for response.completed
        final = event("response.incomplete", response=record.render()) if record.status == "incomplete" else ""
        yield "".join(closing) + final + event("response.completed", response=record.render())
    except Exception as exc:  # the status line is gone: the error is the last event
        err = to_api_error(exc)
        record.fail(err)
        yield (pending + event("error", code=err.code, message=err.message, param=err.param)
               + event("response.failed", response=record.render()))


def _keep(store: Optional[OwnedResponses], record: ResponseRecord, items: list[dict]) -> None:
    if store is not None:
        store.store(record.id, StoredResponse(record.render(), items, record.output.as_input(),
                                              record.body.previous_response_id))


def _history(store: OwnedResponses, previous_response_id: Optional[str]) -> list[dict]:
    if previous_response_id is None:
        return []
    if not store.is_enabled:
        raise APIError(400, "this server keeps no responses (--max-stored-responses 0), so previous_response_id "
                            "cannot be continued; send the whole conversation as input", param="previous_response_id")
    try:
        return store.conversation(previous_response_id)
    except ResponseNotStored as exc:
        which = ("it is" if exc.response_id == previous_response_id
                 else f"the response {exc.response_id!r} it continues is")
        raise APIError(400, f"previous_response_id {previous_response_id!r} cannot be continued: {which} not stored "
                            f"on this server (responses are kept in memory, at most {store.max_responses}, for "
                            f"{store.ttl_seconds:g} s after their last use, and only with store: true); send the "
                            "whole conversation as input", param="previous_response_id") from None


def _stored(store: OwnedResponses, response_id: str) -> StoredResponse:
    try:
        return store.get(response_id)
    except ResponseNotStored:
        raise APIError(404, f"no response with id {response_id!r} is stored on this server (responses are kept in "
                            f"memory for {store.ttl_seconds:g} s after their last use, and only with store: true)",
                       param="response_id", code="response_not_found") from None


def _refuse_unserved(body: ResponsesRequest) -> None:
    """400 for what pagoda cannot serve on this route, naming the field and what to send instead."""
    if body.background:
        raise APIError(400, "background responses are not served; leave background out (use stream: true for long "
                            "outputs)", param="background")
    if body.conversation is not None:
        raise APIError(400, "conversations are not served; continue a stored response with previous_response_id "
                            "instead", param="conversation")
    if body.prompt is not None:
        raise APIError(400, "stored prompt templates are not served; send the text as instructions and input",
                       param="prompt")
    if body.moderation is not None:
        raise APIError(400, "moderation is not served by this server; leave moderation out", param="moderation")


def _choice_name(body: ResponsesRequest) -> str:
    choice = body.tool_choice
    return f"function {choice.name!r}" if isinstance(choice, ToolChoiceFunction) else repr(choice)


def _structured_outputs(body: ResponsesRequest) -> Optional[StructuredOutputsParams]:
    """``text.format`` as the engine's structured outputs: a JSON schema, or any JSON object; or vLLM's
    ``structured_outputs`` field (a 400 when both constrain the output)."""
    text_format = body.text.format if body.text is not None else None
    so = body.structured_outputs
    if so is not None:
        if isinstance(text_format, (TextFormatJSONSchema, TextFormatJSONObject)):
            raise APIError(400, "the output can follow one constraint, and this request has text.format "
                                f"{text_format.type} and structured_outputs; send only one of them",
                           param="structured_outputs")
        given = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object or None), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar)) if v is not None}
        try:
            return StructuredOutputsParams(**given, backend=so.backend)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None
    if isinstance(text_format, TextFormatJSONSchema):
        return StructuredOutputsParams(json=text_format.schema_)
    if isinstance(text_format, TextFormatJSONObject):
        return StructuredOutputsParams(json_object=True)
    return None


@contextlib.contextmanager
def _in_responses_terms(tooling: ToolRequest) -> Iterator[None]:
    """A 400 raised in the engine's or chat's terms (``max_tokens``, ``messages``) in this API's terms; the
    engine's refusal of the schema a forced tool choice needs names ``tool_choice``."""
    try:
        yield
    except (InvalidRequestError, APIError) as exc:
        if isinstance(exc, APIError) and exc.status != 400:
            raise
        explained = tooling.explain_refusal(exc) if isinstance(exc, InvalidRequestError) else exc
        if explained is not exc:  # already in this API's terms
            raise explained from None
        message = exc.message if isinstance(exc, APIError) else str(exc)
        for old in ("max_tokens", "structured_outputs"):
            message = re.sub(rf"\b{old}\b", _FIELD_NAMES[old], message)
        param = exc.param
        if param is not None and param.startswith("structured_outputs"):
            param = _FIELD_NAMES["structured_outputs"]  # structured_outputs.json and the like: text.format
        raise APIError(400, message, param=_FIELD_NAMES.get(param, param)) from None


def _token_logprobs(c: CompletionOutput, num_top: int) -> list[dict]:
    """The logprobs of ``c``'s tokens, each with its ``num_top`` most likely alternatives."""
    result = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]
        token = chosen.decoded_token or ""
        result.append({"token": token, "bytes": list(token.encode()), "logprob": chosen.logprob,
                       "top_logprobs": [{"token": lp.decoded_token or "", "bytes": list((lp.decoded_token or "")
                                                                                         .encode()),
                                         "logprob": lp.logprob} for lp in ranked]})
    return result
