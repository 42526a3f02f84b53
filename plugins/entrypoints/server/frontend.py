"""What vLLM's front-end flags ask of the HTTP server: CORS, a root path behind a proxy, the docs routes,
``X-Request-Id`` headers, the ``/load`` count of requests in flight, and the defaults of chat and completions
answers (the response role, the chat template's content format, token ids in logprobs, usage in every stream).

:class:`FrontendOptions` is built once from the flags (``pagoda serve``) and read by ``build_app``, the routes
and the pooling server alike.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.plugins.entrypoints.server.middleware import route_path

CONTENT_FORMATS = ("auto", "string", "openai")
# the routes whose requests run the model: /load counts those in flight (vLLM's list, as pagoda serves them)
LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                                "/v1/score", "/v1/rerank", "/score", "/rerank"})


@dataclass(frozen=True)
class FrontendOptions:
    """The server-wide switches of vLLM's ``serve`` flags; the defaults are vLLM's."""

    root_path: str = ""  # the path prefix a proxy serves this server under (--root-path)
    allowed_origins: tuple[str, ...] = ()  # CORS: none unless given (--allowed-origins)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False  # X-Request-Id on every response, the client's or a new one
    enable_server_load_tracking: bool = False  # /load counts the model's requests in flight
    disable_fastapi_docs: bool = False  # no /openapi.json, /docs, /redoc
    response_role: str = "assistant"  # the role of a chat answer to a request with add_generation_prompt
    chat_template_content_format: str = "auto"  # message content as a string or OpenAI's list of parts
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    enable_force_include_usage: bool = False  # every stream carries its usage: in each chunk and at the end
    enable_log_requests: bool = False  # log each request's prompt and sampling parameters
    enable_log_outputs: bool = False  # and its outputs when it finishes
    max_log_len: Optional[int] = None  # characters of a prompt or output, token ids, that a log line shows

    def fastapi_kwargs(self) -> dict[str, Any]:
        """The FastAPI constructor's arguments these options set."""
        if self.disable_fastapi_docs:
            return {"openapi_url": None, "docs_url": None, "redoc_url": None}
        return {}

    def install(self, app: Any) -> None:
        """Add the middleware these options ask for (outside the guard, so its answers carry CORS and request id
        headers too), the root path and the ``/load`` route."""
        # FastAPI's own root path (set in every request's scope), as vLLM sets it: a request reaches its route with
        # the prefix (a proxy that keeps it) or without (one that strips it)
        app.root_path = self.root_path
        app.state.server_load = ServerLoad()
        if self.enable_server_load_tracking:
            app.add_middleware(LoadTrackingMiddleware, load=app.state.server_load)
        if self.enable_request_id_headers:
            app.add_middleware(RequestIdMiddleware)
        if self.allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                               allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                               allow_credentials=self.allow_credentials)

        @app.get("/load")
        async def load():
            """Requests in flight on the routes that run the model (0 without --enable-server-load-tracking)."""
            return {"server_load": app.state.server_load.num_requests}



def resolve_content_format(content_format: str, chat_template: Optional[str]) -> str:
    """``string`` or ``openai`` for a chat rendered with ``chat_template``: ``auto`` is ``openai`` when the
    template loops over a message's content (it takes OpenAI's list of parts), else ``string``."""
    if content_format != "auto":
        return content_format
    return "openai" if chat_template and template_loops_over_content(chat_template) else "string"


@functools.lru_cache(maxsize=16)  # a server renders with one template or two (its tool-aware one)
def template_loops_over_content(source: str) -> bool:
    """Whether a Jinja chat template has a ``for`` loop over some ``<x>['content']`` or ``<x>.content``."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter) and target.node is not None:  # `for p in m.content | list`
            target = target.node
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
    return False


def content_as_parts(messages: list[dict]) -> list[dict]:
    """Messages whose text content is OpenAI's list of parts, ``[{"type": "text", "text": ...}]``, for a template
    that takes content that way (``--chat-template-content-format openai``)."""
    return [dict(m, content=[{"type": "text", "text": m["content"]}]) if isinstance(m.get("content"), str) else m
            for m in messages]


class ServerLoad:
    """The count ``/load`` answers with."""

    def __init__(self) -> None:
        self.num_requests = 0


class LoadTrackingMiddleware:
    """Counts the requests of :data:`LOAD_TRACKED_PATHS` from their arrival to their answer's last byte (a
    stream's included). Pure ASGI, so streams pass through untouched."""

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.num_requests -= 1


class RequestIdMiddleware:
    """Every response carries ``X-Request-Id``: the request's own header, or a new id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = dict(message, headers=[*headers, (b"x-request-id", request_id)])
            await send(message)

        await self.app(scope, receive, send_with_id)
