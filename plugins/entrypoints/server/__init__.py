"""The OpenAI-compatible HTTP server: a FastAPI app whose routes come from ``pagoda_add_routes``.

``build_app`` wires an :class:`~pagoda.engine.async_engine.AsyncLLMEngine` into an
app: every plugin's ``pagoda_add_routes(app, engine)`` adds its routes (the
built-in OpenAI routes arrive the same way), errors take OpenAI's shape, and a
guard checks the Host, the API key and the body first. ``make_uvicorn_server`` runs it under uvicorn
with a clean shutdown and a header deadline; ``ServerThread`` runs the
app under uvicorn in a background thread (tests, embedding applications).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from typing import Any, Optional

from fastapi import FastAPI

from pagoda import __version__
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.request_limits import DEFAULT_MAX_TOKENS
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.server.errors import document_errors, error_body, install_error_handlers
from pagoda.plugins.entrypoints.server.frontend import FrontendOptions
from pagoda.plugins.entrypoints.server.lora import LoRAAdminOptions
from pagoda.plugins.entrypoints.server.middleware import GuardMiddleware, send_error
from pagoda.plugins.entrypoints.server.response_store import (DEFAULT_MAX_RESPONSES, DEFAULT_TTL_SECONDS,
                                                              ResponseStore)
from pagoda.plugins.entrypoints.server.reasoning import ReasoningOptions
from pagoda.plugins.entrypoints.server.timeline import TimelineMiddleware
from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions

logger = logging.getLogger("pagoda.server")

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request body to arrive in full
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a new connection's request line and headers to arrive
# after the drain at shutdown, how long uvicorn waits for the ended requests' connections to close
_CLOSE_SECONDS = 5.0


def build_app(engine: AsyncLLMEngine, api_key: Optional[str] = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, shutdown_timeout: float = 0.0,
              body_timeout: float = DEFAULT_BODY_TIMEOUT, allowed_hosts: Optional[frozenset[str]] = None,
              default_max_tokens: Optional[int] = DEFAULT_MAX_TOKENS, max_stored_responses: int = DEFAULT_MAX_RESPONSES,
              stored_response_ttl: float = DEFAULT_TTL_SECONDS, enable_auto_tool_choice: Optional[bool] = None,
              tool_call_parser: Optional[str] = None, tenant_source: str = "api-key",
              strict_request_fields: bool = False,
              max_request_chars: Optional[int] = None, allow_runtime_lora_updating: bool = False,
              lora_admin: Optional[LoRAAdminOptions] = None, reasoning_parser: Optional[str] = None,
              timeline_log: Optional[str] = None, frontend: Optional[FrontendOptions] = None) -> FastAPI:
    """The server app. The engine thread starts with the app and stops with it. ``default_max_tokens``: the
    output budget of a request that gives none, cut to what the context leaves (None: all it leaves).
    ``max_request_chars``: the characters a request may have in all its prompts or messages, refused with a
    400 before any tokenizing (None: four times the longest prompt the context can hold, see
    :data:`~pagoda.plugins.entrypoints.server.serving.REQUEST_CHARS_FACTOR`).
    ``/v1/responses`` keeps up to ``max_stored_responses`` responses in memory (0: none), each for
    ``stored_response_ttl`` seconds after its last use. ``tool_call_parser`` names the ``pagoda_tool_parsers``
    component that reads chat answers when ``tool_choice`` is ``auto`` (None: the model family's, see
    :mod:`~pagoda.plugins.entrypoints.server.tool_families`; an unknown name is a ConfigError listing the
    parsers); ``enable_auto_tool_choice`` False turns that reading off (``auto`` is then a 400), True requires a
    parser. ``tenant_source``: where a request's tenant comes
    from (``api-key``, ``header`` or ``user``; see ``ServingContext.tenant_of``). ``allow_runtime_lora_updating``
    adds ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (the engine needs LoRA enabled), bounded
    by ``lora_admin`` (default: :class:`~pagoda.plugins.entrypoints.server.lora.LoRAAdminOptions`).
    ``strict_request_fields``: a request field of no OpenAI or vLLM schema is a 400 (otherwise it is ignored,
    logged once and named in the ``x-pagoda-ignored-fields`` header). ``reasoning_parser`` names the
    ``pagoda_reasoning_parsers`` component that sets chat answers' thinking apart (None: the model family's,
    see :mod:`~pagoda.plugins.entrypoints.server.reasoning`; ``"none"``: off). ``timeline_log``: append each
    completion's and chat completion's timeline to its first token to this file
    (:mod:`~pagoda.plugins.entrypoints.server.timeline`). ``frontend``: what vLLM's front-end flags ask for (CORS,
    root path, docs routes, request id headers, ``/load``, answer defaults; see
    :class:`~pagoda.plugins.entrypoints.server.frontend.FrontendOptions`)."""
    tool_calling = ToolCallingOptions.for_engine(engine.engine, enable_auto_tool_choice, tool_call_parser)
    logger.info("%s", tool_calling.describe())
    reasoning = ReasoningOptions.for_engine(engine.engine, reasoning_parser)
    logger.info("%s", reasoning.describe())
    max_request_chars = max_request_chars_option(max_request_chars)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        # uvicorn has already waited (up to its graceful timeout) for open requests; fail what is left
        await engine.shutdown(timeout=shutdown_timeout)

    frontend = frontend or FrontendOptions()
    app = FastAPI(title="pagoda", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the pagoda inference engine", **frontend.fastapi_kwargs())
    app.state.engine = engine
    app.state.frontend = frontend  # read by the routes when they are added
    app.state.default_max_tokens = default_max_tokens  # read by the routes when they are added
    app.state.max_request_chars = max_request_chars  # likewise
    app.state.response_store = ResponseStore(max_stored_responses, stored_response_ttl)
    app.state.tool_calling = tool_calling  # read by the chat route
    app.state.reasoning = reasoning  # likewise
    app.state.tenant_source = tenant_source  # read by the routes when they are added
    app.state.strict_request_fields = strict_request_fields  # likewise
    app.state.allow_runtime_lora_updating = allow_runtime_lora_updating  # read when the routes are added
    app.state.lora_admin = lora_admin or LoRAAdminOptions()  # likewise
    install_error_handlers(app)
    document_errors(app)
    engine.engine.pm.hook.pagoda_add_routes(app=app, engine=engine)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes,
                       body_timeout=body_timeout, allowed_hosts=allowed_hosts,
                       admin_api_key=app.state.lora_admin.admin_api_key)
    frontend.install(app)
    if timeline_log is not None:  # outermost: a request is stamped as uvicorn hands it over
        app.add_middleware(TimelineMiddleware, path=timeline_log)
    return app


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def default_allowed_hosts(host: str, api_key: Optional[str], allowed: Optional[str]) -> Optional[frozenset[str]]:
    """The Host names to answer: ``--allowed-hosts`` if given; on a loopback address without an API key only
    the loopback names (a web page cannot then reach the server through a name of its own); otherwise any."""
    if allowed:
        return frozenset(h.strip().lower() for h in allowed.split(",") if h.strip())
    if api_key is None and host in LOOPBACK_NAMES:
        return LOOPBACK_NAMES
    return None


def default_max_tokens_option(value: int) -> Optional[int]:
    """``--default-max-tokens`` as the server takes it: a number of tokens, or None for 0 (all the context
    leaves)."""
    if value < 0:
        raise ConfigError(f"--default-max-tokens {value}: give a number of tokens, or 0 for all the context leaves")
    return value or None


def max_request_chars_option(value: Optional[int]) -> Optional[int]:
    """``--max-request-chars`` checked: a number of characters >= 1, or None for the default."""
    if value is not None and value < 1:
        raise ConfigError(f"--max-request-chars {value}: give a number of characters >= 1 (leave it out for the "
                          "default, four times the longest prompt the context can hold)")
    return value


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape that closes its connection, written before any request
    reached the app."""
    body = json.dumps(error_body(status, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def _guarded_protocol(header_timeout: float, limit_concurrency: Optional[int]) -> type:
    """uvicorn's HTTP/1.1 protocol with deadlines and limits no client can hold a connection past:

    - every request a connection carries, its first and each keep-alive one, must send its request line and
      headers within ``header_timeout`` seconds of the connection becoming ready for it, or gets a 408 and the
      connection is closed (a keep-alive connection that sent nothing is closed quietly);
    - at ``limit_concurrency`` open connections a new one first closes the connections that carry no running
      request (idle keep-alive ones, those still sending headers), oldest first; only when every connection
      runs a request, or ``limit_concurrency`` requests run, is a request refused with a 503;
    - the answers uvicorn gives itself (400 for malformed HTTP, 503 at the limit) are in OpenAI's error shape.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedProtocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limit_concurrency = None  # uvicorn's own check answers in plain text: this protocol checks
            self.app = self._limited(self.app)
            self._deadline: Optional[asyncio.TimerHandle] = None
            self._waiting_since = 0.0  # when the connection became ready for its next request
            self._received = False  # bytes of that request have arrived

        # ---- the header deadline of each request ----
        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._waiting_since, self._received = time.monotonic(), False
            self._deadline = self.loop.call_later(header_timeout, self._headers_late, self.cycle)

        def _is_waiting(self) -> bool:
            """No request runs on it: it is idle, or still sending a request's headers."""
            return self.cycle is None or self.cycle.response_complete

        def _headers_late(self, cycle_when_armed: Any) -> None:
            if self.transport.is_closing() or self.cycle is not cycle_when_armed:
                return  # a request began since (and the next deadline is armed when it completes)
            if cycle_when_armed is None or self._received:
                self.transport.write(_raw_error(408, "Request Timeout", (
                    f"the request line and headers did not arrive within {header_timeout:g} s "
                    "(--request-header-timeout); send them at once")))
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()
            if limit_concurrency is not None and len(self.connections) > limit_concurrency:
                self._close_waiting_connections(len(self.connections) - limit_concurrency)

        def data_received(self, data: bytes) -> None:
            self._received = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
                self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        # ---- the connection limit ----
        def _close_waiting_connections(self, count: int) -> None:
            waiting = sorted((c for c in self.connections if c is not self and isinstance(c, GuardedProtocol)
                              and c._is_waiting() and not c.transport.is_closing()),
                             key=lambda c: c._waiting_since)
            for conn in waiting[:count]:
                if conn._received:
                    conn.transport.write(_raw_error(503, "Service Unavailable", (
                        "the server is at its connection limit (--limit-concurrency) and closed this connection, "
                        "whose request had not arrived; retry")))
                conn.transport.close()

        def _limited(self, app: Any) -> Any:
            if limit_concurrency is None:
                return app
            protocol = self

            async def limited_app(scope, receive, send) -> None:
                busy = sum(1 for c in protocol.connections if not c.transport.is_closing())
                if scope["type"] == "http" and (busy > limit_concurrency or len(protocol.tasks) > limit_concurrency):
                    await send_error(send, 503, "the server is at its connection limit (--limit-concurrency: "
                                                     f"{limit_concurrency} open connections or running requests); "
                                                     "retry later")
                    return
                await app(scope, receive, send)

            return limited_app

        # ---- malformed HTTP ----
        def send_400_response(self, msg: str) -> None:
            self.transport.write(_raw_error(400, "Bad Request",
                                            f"{msg.rstrip('.')}: the request is not valid HTTP/1.1"))
            self.transport.close()

    return GuardedProtocol


def make_uvicorn_server(app: FastAPI, host: str, port: int, shutdown_timeout: float,
                        header_timeout: float = DEFAULT_HEADER_TIMEOUT, **options: Any):
    """uvicorn serving ``app``, with a shutdown that ends every open request cleanly.

    On SIGTERM (or ``should_exit``) the engine stops accepting, open requests get ``shutdown_timeout`` seconds
    to finish, and those still running are failed by the engine: a stream ends with an error event and
    ``[DONE]``, a plain request gets a 503. Only then does uvicorn close the connections, so none is cut
    mid-response. A shutdown that went this way exits with status 0, not by the signal. A connection whose
    headers take longer than ``header_timeout`` seconds is closed with a 408.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await app.state.engine.drain(shutdown_timeout)
            await super().shutdown(sockets)
            # uvicorn re-raises a caught SIGTERM after shutting down; a clean shutdown is a normal exit
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    # uvicorn's own wait for open connections comes after the drain: it only sees requests already ending
    limit_concurrency = options.pop("limit_concurrency", None)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=_CLOSE_SECONDS, lifespan="on",
                            http=_guarded_protocol(header_timeout, limit_concurrency), **options)
    return Server(config)


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; ``stop()`` shuts it down gracefully.
    ``uvicorn_options``: more of uvicorn's settings (``ssl_certfile``, ``access_log``, ...)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: Optional[int] = None,
                 graceful_timeout: float = 5.0, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 limit_concurrency: Optional[int] = None, **uvicorn_options: Any) -> None:
        self.host, self.port = host, port or free_port(host)
        self.scheme = "https" if uvicorn_options.get("ssl_certfile") else "http"
        self.server = make_uvicorn_server(app, self.host, self.port, graceful_timeout, header_timeout,
                                          log_level="warning", limit_concurrency=limit_concurrency,
                                          **uvicorn_options)
        self.thread = threading.Thread(target=self.server.run, name="pagoda-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
