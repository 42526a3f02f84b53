"""The OpenAI-compatible routes, added through ``pagoda_add_routes`` like any plugin's routes."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagoda import __version__
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.metrics import PrometheusExporter
from pagoda.engine.request_limits import DEFAULT_MAX_TOKENS
from pagoda.plugins.entrypoints.server.chat import check_chat_chars, create_chat_completion, plain_messages, render_chat
from pagoda.plugins.entrypoints.server.completions import create_completion
from pagoda.plugins.entrypoints.server.effort import EffortOptions
from pagoda.plugins.entrypoints.server.errors import APIError, error_response
from pagoda.plugins.entrypoints.server.lora import adapter_models, add_lora_routes
from pagoda.plugins.entrypoints.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                        TokenizeRequest)
from pagoda.plugins.entrypoints.server.request_logging import RequestLog
from pagoda.plugins.entrypoints.server.response_store import ResponseStore
from pagoda.plugins.entrypoints.server.responses import add_responses_routes
from pagoda.plugins.entrypoints.server.serving import ClientGone, ServingContext
from pagoda.plugins.entrypoints.server.reasoning import ReasoningOptions
from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions


# with "stream": true the answer is server-sent events, one JSON chunk per "data:" line, ending "data: [DONE]"
_STREAMED = {200: {"description": "The completion as JSON, or with stream=true as server-sent events",
                   "content": {"text/event-stream": {}},
                   "headers": {"x-pagoda-ignored-fields": {
                       "description": "The request fields this request sent that pagoda accepts but ignores (OpenAI's "
                                      "and vLLM's without effect here, and fields of no schema; comma-separated); "
                                      "absent when there are none",
                       "schema": {"type": "string"}},
                       "x-pagoda-warning": {
                           "description": "Why the request was answered otherwise than asked: tool_choice \"auto\" "
                                          "answered as text because no tool-call parser fits the model; absent "
                                          "otherwise",
                           "schema": {"type": "string"}}}}}


def add_openai_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    ctx = ServingContext.for_engine(engine, getattr(app.state, "default_max_tokens", DEFAULT_MAX_TOKENS),
                                    getattr(app.state, "max_request_chars", None))
    ctx.tool_options = getattr(app.state, "tool_calling", None) or ToolCallingOptions.for_engine(engine.engine)
    ctx.reasoning_options = getattr(app.state, "reasoning", None) or ReasoningOptions.for_engine(engine.engine)
    ctx.effort = EffortOptions.for_engine(engine.engine)
    ctx.tenant_source = getattr(app.state, "tenant_source", ctx.tenant_source)
    ctx.strict_request_fields = getattr(app.state, "strict_request_fields", False)
    ctx.frontend = getattr(app.state, "frontend", ctx.frontend)
    if ctx.frontend.enable_log_requests:
        ctx.request_log = RequestLog(ctx.frontend.enable_log_outputs, ctx.frontend.max_log_len)
    exporter = PrometheusExporter.for_engine(engine.engine, engine.serving_stats)
    created = int(time.time())

    @app.post("/v1/completions", responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request):
        ctx.check_unknown_fields(body)
        try:
            response = await create_completion(ctx, body, request)
        except ClientGone:
            return Response(status_code=499)
        ctx.mark_ignored_fields(body, response)
        return response

    @app.post("/v1/chat/completions", responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ctx.check_unknown_fields(body)
        try:
            response = await create_chat_completion(ctx, body, request)
        except ClientGone:
            return Response(status_code=499)
        ctx.mark_ignored_fields(body, response)
        return response

    # build_app puts the store there (its bounds are server options); an app built otherwise gets the defaults
    store = getattr(app.state, "response_store", None)
    add_responses_routes(app, ctx, store if store is not None else ResponseStore(), _STREAMED)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": ctx.served_model_name, "object": "model", "created": created, "owned_by": "pagoda",
            "root": ctx.served_model_name, "max_model_len": ctx.max_model_len}, *adapter_models(ctx, created)]}

    if getattr(app.state, "allow_runtime_lora_updating", False):
        add_lora_routes(app, ctx)

    @app.get("/health")
    async def health():
        if engine.is_healthy:
            return {"status": "ok"}
        reason = engine.dead_reason or "the server is shutting down"
        return error_response(503, f"the engine cannot serve: {reason}", code="engine_unavailable")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(exporter.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (text) or 'messages' (chat)", param="prompt")
        if body.messages is not None:
            messages = plain_messages(body.messages)
            check_chat_chars(ctx, messages)
            _, ids = await ctx.run_tokenizer(
                lambda tok: render_chat(tok, messages, body.add_generation_prompt, max_chars=ctx.max_prompt_chars,
                                        content_format=ctx.frontend.chat_template_content_format))
        else:
            ctx.check_text_length(body.prompt, "prompt")
            ctx.check_request_chars([len(body.prompt)], "prompt", "prompt")
            ids = await ctx.run_tokenizer(
                lambda tok: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        vocab = engine.engine.config.model.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        text = await ctx.run_tokenizer(lambda tok: tok.decode(body.tokens))
        return JSONResponse({"prompt": text})
