"""The routes of a pooling model: ``/v1/embeddings`` (OpenAI's), ``/v1/score`` (vLLM's) and ``/v1/rerank``,
``/rerank``, ``/v2/rerank`` (the Jina / Cohere shape vLLM serves), added through ``pagoda_add_routes`` when the
server runs an :class:`~pagoda.engine.pooling.AsyncPoolingEngine`."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import time
import uuid
from typing import Literal, Optional, Union

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagoda import __version__
from pagoda.engine.metrics import PoolingExporter
from pagoda.engine.pooling import AsyncPoolingEngine, PoolingInput
from pagoda.modeling.pooling import finish_embedding
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.frontend import FrontendOptions
from pagoda.plugins.entrypoints.server.serving import answers_499_when_gone, unless_disconnected

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
MAX_TEXT_CHARS = 1 << 20
_Text = Field(max_length=MAX_TEXT_CHARS)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None


class EmbeddingRequest(_Body):
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


class ScoreRequest(_Body):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class _Document(BaseModel):
    text: str


class RerankRequest(_Body):
    query: str
    documents: list[Union[str, _Document]] = Field(max_length=MAX_INPUTS)
    top_n: Optional[int] = None
    return_documents: bool = True


def generate_paths() -> list[str]:
    return ["/v1/completions", "/v1/chat/completions", "/v1/responses"]


def add_pooling_routes(app: FastAPI, engine: AsyncPoolingEngine) -> None:
    """Embeddings, scores and reranking for ``engine``'s task; the text-generation paths answer 400 naming it."""
    pooling = engine.engine
    name, task = pooling.served_model_name, pooling.task
    created = int(time.time())
    # tokenizing runs here, never on the event loop nor the engine's thread
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")

    def check_model(model: Optional[str]) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")

    async def run_tokenizer(fn):
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn)

    async def embed(items: list[PoolingInput], param: str, request: Request) -> list[torch.Tensor]:
        """The inputs' vectors; a client that disconnects first cancels them (counted as abort, dropped before
        they run if they still wait)."""
        for item in items:
            pooling.check(item, param)
        return await unless_disconnected(request, engine.encode(items))

    async def pair_scores(first: list[str], second: list[str], param: str,
                          request: Request) -> tuple[list[float], int]:
        """One score per pair (a cross-encoder's, or the cosine of two embeddings) and the tokens it took."""
        for text in (*first, *second):
            if len(text) > MAX_TEXT_CHARS:
                raise APIError(400, f"{param}: a text is over {MAX_TEXT_CHARS} characters", param=param)
        if pooling.scores_pairs_itself:
            items = await run_tokenizer(lambda: [pooling.tokenize_pair(a, b) for a, b in zip(first, second)])
            scores = await embed(items, param, request)
            return [float(s) for s in scores], sum(len(i.token_ids) for i in items)
        texts = list(dict.fromkeys([*first, *second]))
        items = await run_tokenizer(lambda: [pooling.tokenize(t) for t in texts])
        vectors = dict(zip(texts, await embed(items, param, request)))
        scores = [float(torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0))
                  for a, b in zip(first, second)]
        return scores, sum(len(i.token_ids) for i in items)

    if task == "embed":
        @app.post("/v1/embeddings")
        @answers_499_when_gone
        async def embeddings(body: EmbeddingRequest, request: Request):
            check_model(body.model)
            inputs = body.input
            if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
                inputs = [inputs]
            if not inputs:
                raise APIError(400, "input: send a string, a list of strings or token ids; got an empty list",
                               param="input")
            if len(inputs) > MAX_INPUTS:
                raise APIError(400, f"input: {len(inputs)} inputs, more than {MAX_INPUTS} in one request; send "
                                    "them in several requests", param="input")
            if body.dimensions is not None:
                if not pooling.pooling.matryoshka:
                    raise APIError(400, f"dimensions: the model {name!r} has no Matryoshka representation (its "
                                        "config.json sets no is_matryoshka or matryoshka_dimensions); leave "
                                        "dimensions out", param="dimensions")
                if not 1 <= body.dimensions <= pooling.hidden_size:
                    raise APIError(400, f"dimensions: {body.dimensions} is not in [1, {pooling.hidden_size}], the "
                                        "model's embedding size", param="dimensions")
            texts = [t for t in inputs if isinstance(t, str)]
            if sum(len(t) for t in texts) > MAX_TEXT_CHARS:
                raise APIError(400, f"input: over {MAX_TEXT_CHARS} characters in all", param="input")
            encoded = iter(await run_tokenizer(lambda: [pooling.tokenize(t) for t in texts]))
            items = [next(encoded) if isinstance(t, str) else PoolingInput(list(t)) for t in inputs]
            vectors = await embed(items, "input", request)
            data = []
            for i, vector in enumerate(vectors):
                vector = finish_embedding(vector, pooling.pooling.normalize, body.dimensions)
                if body.encoding_format == "base64":
                    value = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
                else:
                    value = vector.tolist()
                data.append({"object": "embedding", "index": i, "embedding": value})
            num_tokens = sum(len(i.token_ids) for i in items)
            return {"object": "list", "data": data, "model": name,
                    "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    @app.post("/v1/score")
    @answers_499_when_gone
    async def score(body: ScoreRequest, request: Request):
        check_model(body.model)
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(first) == 1 and len(second) > 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1 and any "
                                "number of text_2, or lists of the same length", param="text_2")
        if len(first) > MAX_INPUTS:
            raise APIError(400, f"text_2: more than {MAX_INPUTS} pairs in one request", param="text_2")
        scores, num_tokens = await pair_scores(first, second, "text_2", request)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    @answers_499_when_gone
    async def rerank(body: RerankRequest, request: Request):
        check_model(body.model)
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        if not docs:
            raise APIError(400, "documents: send at least one document", param="documents")
        if body.top_n is not None and body.top_n < 1:
            raise APIError(400, f"top_n: {body.top_n} is not >= 1", param="top_n")
        scores, num_tokens = await pair_scores([body.query] * len(docs), docs, "documents", request)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": docs[i]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"total_tokens": num_tokens},
                "meta": {"billed_units": {"search_units": 1}, "api_version": {"version": "2"}}}

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path)(rerank)

    def refuse_generation(path: str):
        async def no_generation():
            raise APIError(400, f"the model {name!r} is served for the {task!r} task (pagoda serve --task {task}): "
                                f"it does not generate text, so {path} is not served; use "
                                f"{'/v1/embeddings, ' if task == 'embed' else ''}/v1/score or /v1/rerank, or serve "
                                "a generative model for text", code="wrong_task")
        return no_generation

    for path in generate_paths():
        app.post(path, include_in_schema=False)(refuse_generation(path))
    if task == "score":
        @app.post("/v1/embeddings", include_in_schema=False)
        async def no_embeddings():
            raise APIError(400, f"the model {name!r} is served for the 'score' task (a cross-encoder scores text "
                                "pairs and has no embeddings); use /v1/score or /v1/rerank, or serve an embedding "
                                "model with --task embed", code="wrong_task")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pagoda",
                                            "root": name, "max_model_len": pooling.max_model_len, "task": task}]}

    @app.get("/health")
    async def health():
        if engine.is_healthy:
            return {"status": "ok"}
        raise APIError(503, f"the engine cannot serve: {engine.dead_reason or 'the server is shutting down'}",
                       code="engine_unavailable")

    exporter = PoolingExporter(engine, name)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(exporter.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}


def build_pooling_app(engine: AsyncPoolingEngine, api_key: Optional[str] = None,
                      max_request_bytes: Optional[int] = None, shutdown_timeout: float = 0.0,
                      body_timeout: Optional[float] = None, allowed_hosts: Optional[frozenset[str]] = None,
                      frontend: Optional[FrontendOptions] = None) -> FastAPI:
    """The server app of a pooling model: every plugin's ``pagoda_add_routes(app, engine)`` with ``engine`` an
    :class:`AsyncPoolingEngine`, errors in OpenAI's shape, the same guard and front end (``frontend``) as the
    generation server's."""
    from pagoda.plugins.entrypoints.server import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
    from pagoda.plugins.entrypoints.server.errors import document_errors, install_error_handlers
    from pagoda.plugins.entrypoints.server.middleware import GuardMiddleware

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        await engine.shutdown(timeout=shutdown_timeout)

    frontend = frontend or FrontendOptions()
    app = FastAPI(title="pagoda", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the pagoda inference engine (a pooling model)",
                  **frontend.fastapi_kwargs())
    app.state.engine = engine
    install_error_handlers(app)
    document_errors(app)
    engine.engine.pm.hook.pagoda_add_routes(app=app, engine=engine)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes or
                       DEFAULT_MAX_REQUEST_BYTES, body_timeout=body_timeout or DEFAULT_BODY_TIMEOUT,
                       allowed_hosts=allowed_hosts, admin_api_key=None)
    frontend.install(app)
    return app

